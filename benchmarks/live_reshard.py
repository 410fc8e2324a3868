"""Moving training state between layouts: live transfer against the checkpoint path and raw gloo.

    .venv/bin/python benchmarks/live_reshard.py [--layers 28] [--old tp=2] [--new dp=2] [--reps 5]

State: the `small` preset with `--layers` blocks (28: 0.99 GB of fp32 weights + AdamW moments), trained
one step under `--old`, on spawned gloo ranks (NCCL, one GPU per rank, under ELASTRON_TEST_DEVICE=cuda:
tests/multiproc.py picks, and "raw" is then NCCL's own send/recv) (world = the larger of the two layouts; every rank is a
survivor, as in a planned resize on live workers). Each repetition runs, in rotating order:

  live:   `parallel.live.hold` + `plan_exchange` + `transfer` + `Trainer.adopt` into a trainer of the new
          layout (what a planned resize moves); the bytes that cross the network are counted;
  raw:    `batch_isend_irecv` of exactly those bytes between the same processes (one message per pair):
          the network's own speed, the target's denominator;
  storage: a blocking checkpoint save under the old layout plus a cold load into a fresh trainer of the
          new layout (what the storage path moves).

Reported: medians, the live transfer's throughput as a fraction of raw gloo, and live vs storage, and
the parts of the send/recv step per rank (`parallel.live.transfer`'s timings).

With fewer ranks in `--new` than in `--old` (e.g. `--layers 30 --old dp=2 --new dp=1`: the 1 GB user
resize of benchmarks/elastic.py without the coordinator), the benchmark instead runs the worker's side of
a planned shrink (`shrink_body`) with the send/recv variants of `VARIANTS` interleaved, and reports the
send/recv parts of each against raw gloo between the same processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def body(cfg_dict: dict, old: str, new: str, work: str, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.checkpoint import _drop_cache, _files, _timed
    from models.llama import build_model
    from parallel import live
    from parallel.exchange import plan_exchange
    from parallel.layout import Layout
    from parallel.sharding import boxes
    from tests.multiproc import rank_device
    from workers.config import JobConfig
    from workers.trainer import Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    old_l, new_l = Layout.parse(old), Layout.parse(new)
    if old_l.world_size != world or new_l.world_size != world:
        raise ValueError("this benchmark keeps every worker: both layouts must have the same world size")
    cfg = JobConfig.from_dict(cfg_dict)
    device = rank_device()  # the CPU, or this rank's GPU under ELASTRON_TEST_DEVICE=cuda
    src = Trainer(cfg, layout=old_l, device=device).build()
    src.train_step()
    dst = Trainer(cfg, layout=new_l, device=device).build()
    meta = build_model(cfg.model.build())
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    old_b, new_b = boxes(old_l, shapes, len(meta.layers)), boxes(new_l, shapes, len(meta.layers))
    ident = {r: r for r in range(world)}
    dtypes = {k: torch.float32 for b in list(old_b.values()) + list(new_b.values()) for k in b}
    state = src.checkpoint_state()
    out: dict[str, list[float]] = {"live": [], "raw": [], "storage": [], "plan": [], "transfer": [], "adopt": []}
    moved = [0]

    def run_live() -> None:
        t = time.perf_counter()
        held = live.hold(src.model, src.optimizer)
        plan = plan_exchange(old_b, new_b, same_worker=ident)
        out["plan"].append(time.perf_counter() - t)
        moved[0] = sum(t.box.numel * 4 for t in plan if t.src != t.dst)
        steps: dict[str, int] = {}
        gathered = [None] * world
        dist.all_gather_object(gathered, held.optimizer_steps)
        for part in gathered:
            steps.update(part)
        dist.barrier()
        t = time.perf_counter()
        parts: dict[str, float] = {}
        pieces = live.transfer(plan, old_rank=rank, new_rank=rank, held=held, dtypes=dtypes,
                               old_to_group=ident, new_to_group=ident, device=device, timings=parts)
        out["transfer"].append(time.perf_counter() - t)
        for k, v in parts.items():
            out.setdefault(f"transfer.{k}", []).append(v)
        t = time.perf_counter()
        dst.adopt(pieces, steps, state)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["adopt"].append(time.perf_counter() - t)

    sent = {}

    def run_raw() -> None:
        # What this rank sends in the live plan, to each peer, as one message per pair.
        ops = []
        for peer, n in sent.items():
            ops.append(dist.P2POp(dist.isend, torch.empty(n, dtype=torch.uint8, device=device), peer))
            ops.append(dist.P2POp(dist.irecv, torch.empty(recv[peer], dtype=torch.uint8, device=device), peer))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    root = os.path.join(work, "ckpt")
    step = [100]

    def run_storage() -> None:
        from parallel.checkpoint.manager import CheckpointManager

        mgr = CheckpointManager(root, keep_last=1)
        step[0] += 1
        mgr.save(step[0], src.model, src.optimizer, state=state, blocking=True)
        mgr.flush()  # retention of the previous step too, before its files are listed
        if rank == 0:
            _drop_cache(_files(root))
        dist.barrier()
        fresh = Trainer(cfg, layout=new_l, device=device).build()
        CheckpointManager(root, keep_last=1).load_latest(fresh.model, fresh.optimizer)

    run_live()  # warm-up; also tells the raw run how many bytes go to whom
    plan = plan_exchange(old_b, new_b, same_worker=ident)
    recv: dict[int, int] = {}
    for t in plan:
        if t.src != t.dst and t.src == rank:
            sent[t.dst] = sent.get(t.dst, 0) + t.box.numel * 4
        if t.src != t.dst and t.dst == rank:
            recv[t.src] = recv.get(t.src, 0) + t.box.numel * 4
    for peer in set(sent) | set(recv):
        sent.setdefault(peer, 0)
        recv.setdefault(peer, 0)
    run_storage()  # warm-up
    fns = {"live": run_live, "raw": run_raw, "storage": run_storage}
    order = list(fns)
    for i in range(reps):
        for name in order[i % 3:] + order[:i % 3]:
            out[name].append(_timed(fns[name]))
    shutil.rmtree(root, ignore_errors=True)
    return {"runs": out, "moved_bytes_total": moved[0], "state_bytes_rank": sum(
        t.numel() * 4 for t in live.hold(src.model, src.optimizer).tensors.values()), "sent": sent, "recv": recv}


VARIANTS = {  # the send/recv knobs of parallel.live: (PACK_BELOW, PREFAULT)
    "packed": (1 << 62, False),   # every piece packed into one message per pair: before a5e4a31
    "views": (None, False),       # pieces of >= PACK_BELOW sent from where they lie, one op each
    "views+prefault": (None, True),  # ... and receive buffers faulted in while the receives run (default)
}


def shrink_body(cfg_dict: dict, old: str, new: str, ports: list[int], reps: int, variants: list[str]) -> list[dict]:
    """A planned shrink as the coordinator runs it (workers.reshard: hand over, transfer group of every
    old worker, exchange, new group, build without initial values, adopt), on 1-thread ranks like the
    1-CPU Ray workers; the send/recv variants interleaved, each followed by raw gloo between the same
    processes (a warm buffer, then a fresh one) of the bytes the last old rank sent to rank 0."""
    import torch
    import torch.distributed as dist

    from parallel import live
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.reshard import exchange, hand_over
    from workers.trainer import Trainer

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    old_l, new_l = Layout.parse(old), Layout.parse(new)
    cfg, cpu, port = JobConfig.from_dict(cfg_dict), torch.device("cpu"), iter(ports)

    def init(size: int) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{next(port)}", rank=rank, world_size=size)

    init(world)
    trainer = Trainer(cfg, layout=old_l, device=cpu).build()
    trainer.train_step()
    handover = hand_over(trainer)
    trainer.close()
    dist.destroy_process_group()
    out, default_pack = [], live.PACK_BELOW
    for i in range(reps * len(variants)):
        variant = variants[(i + i // len(variants)) % len(variants)]  # rotate the order every round
        pack_below, live.PREFAULT = VARIANTS[variant]
        live.PACK_BELOW = pack_below or default_pack
        init(world)
        dist.barrier()
        got = exchange(handover, model=cfg.model.build(), old=old_l, new=new_l, old_rank=rank,
                       new_rank=rank if rank < new_l.world_size else None,
                       old_to_group={r: r for r in range(world)},
                       new_to_group={r: r for r in range(new_l.world_size)})
        rec = {"variant": variant, "timings": dict(got.timings), "bytes_received": got.bytes_received}
        nbytes = [got.bytes_received]
        dist.broadcast_object_list(nbytes, src=0)
        if rank in (0, world - 1) and nbytes[0]:
            warm = torch.ones(nbytes[0], dtype=torch.uint8)
            for name in ("raw_warm", "raw_fresh"):
                dist.barrier()
                t = time.perf_counter()
                buf = warm if name == "raw_warm" else torch.empty(nbytes[0], dtype=torch.uint8)
                op, peer = (dist.irecv, world - 1) if rank == 0 else (dist.isend, 0)
                for w in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
                    w.wait()
                rec[name] = time.perf_counter() - t
            del warm, buf
        else:
            for _ in range(2 if nbytes[0] else 0):
                dist.barrier()
        dist.destroy_process_group()
        if rank < new_l.world_size:
            init(new_l.world_size)
            fed = Trainer(cfg, layout=new_l, device=cpu).build(resume=False, init_weights=False)
            t = time.perf_counter()
            fed.adopt(got.pieces, got.optimizer_steps, got.state)
            rec["adopt"] = time.perf_counter() - t
            fed.close()
            del fed
            dist.destroy_process_group()
        else:
            next(port)
        del got
        out.append(rec)
    return out


def shrink_report(res: list[list[dict]], variants: list[str]) -> dict:
    """Per variant, medians: the slowest rank's send_recv and each of its parts, rank 0's adopt, raw gloo."""
    med = statistics.median
    rows = {}
    for v in variants:
        idx = [i for i, rec in enumerate(res[0]) if rec["variant"] == v]
        keys = [k for k in res[0][0]["timings"] if k.startswith("send_recv")]
        row = {k: med([max(r[i]["timings"][k] for r in res) for i in idx]) for k in keys}
        row.update({k: med([res[0][i].get(k, 0.0) for i in idx]) for k in ("adopt", "raw_warm", "raw_fresh")})
        row["send_recv_vs_raw_warm"] = row["raw_warm"] / row["send_recv"]
        rows[v] = row
    print(f"{res[0][0]['bytes_received'] / 1e9:.2f} GB to rank 0; medians of {len(idx)} runs per variant, "
          "slowest rank per part\n")
    cols = [k for k in rows[variants[0]] if k != "send_recv_vs_raw_warm" and any(r[k] for r in rows.values())]
    print("| variant | " + " | ".join(c.replace("send_recv.", "") for c in cols) + " | send/recv vs raw warm |")
    print("|---" * (len(cols) + 2) + "|")
    for v, row in rows.items():
        print(f"| {v} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + f" | {100 * row['send_recv_vs_raw_warm']:.0f}% |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--old", default="tp=2")
    ap.add_argument("--new", default="dp=2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="send/recv variants to interleave when --new has fewer ranks than --old")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from benchmarks.checkpoint import _cfg
    from parallel.layout import Layout
    from tests.multiproc import backend, run_ranks
    from tests.ports import free_port

    old_world, new_world = Layout.parse(args.old).world_size, Layout.parse(args.new).world_size
    if new_world < old_world:
        cfg = _cfg("small", args.layers, None)
        cfg["checkpoint"]["async_save"] = False
        ports = [free_port() for _ in range(1 + 2 * args.reps * len(args.variants))]
        res = run_ranks(old_world, shrink_body, cfg, args.old, args.new, ports, args.reps, args.variants,
                        timeout=3600, spawn=True)
        r = {"date": time.strftime("%Y-%m-%d"), "old": args.old, "new": args.new, "reps": args.reps,
             "variants": shrink_report(res, args.variants), "runs": res, "load_avg": os.getloadavg()[0]}
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
        return 0

    work = tempfile.mkdtemp(prefix="elastron-live-bench-")
    try:
        res = run_ranks(Layout.parse(args.old).world_size, body, _cfg("small", args.layers, None), args.old,
                        args.new, work, args.reps, timeout=3600, spawn=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res[0]["runs"].items()}
    parts = {k: [round(statistics.median(r["runs"][k][1:]), 4) for r in res]  # the warm-up run left out
             for k in res[0]["runs"] if k.startswith("transfer.")}
    moved = res[0]["moved_bytes_total"]
    state = sum(r["state_bytes_rank"] for r in res)
    r = {"date": time.strftime("%Y-%m-%d"), "old": args.old, "new": args.new, "reps": args.reps,
         "state_bytes": state, "network_bytes": moved, "medians_s": med,
         "live_vs_raw_throughput": med["raw"] / med["live"], "storage_vs_live": med["storage"] / med["live"],
         "transfer_vs_raw_throughput": med["raw"] / med["transfer"],
         "transfer_parts_by_rank": parts, "runs": res[0]["runs"], "load_avg": os.getloadavg()[0],
         "backend": backend()}
    print(f"State {state / 1e9:.2f} GB ({args.old} -> {args.new}, every worker a survivor); "
          f"{moved / 1e9:.2f} GB cross the network; medians of {args.reps} interleaved runs.\n")
    print("| path | s | note |\n|---|---|---|")
    print(f"| live path (hold, plan, send/recv, fill) | {med['live']:.2f} | of which hold+plan "
          f"{med['plan']:.3f} s, transfer {med['transfer']:.3f} s, fill {med['adopt']:.3f} s (rank 0) |")
    print(f"| raw {r['backend']} send/recv of the bytes that cross | {med['raw']:.2f} | transfer step at "
          f"{100 * r['transfer_vs_raw_throughput']:.0f}% of raw throughput (target >= 50%); whole live path "
          f"{100 * r['live_vs_raw_throughput']:.0f}% |")
    print(f"| storage path (blocking save + cold load) | {med['storage']:.2f} | live is "
          f"{r['storage_vs_live']:.1f}x faster |")
    print("\nsend/recv parts, median s per rank: " + ", ".join(f"{k[9:]} {v}" for k, v in parts.items()))
    print(json.dumps(r, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
