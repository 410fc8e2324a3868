"""Moving training state between layouts: live transfer against the checkpoint path and raw gloo.

    .venv/bin/python benchmarks/live_reshard.py [--layers 28] [--old tp=2] [--new dp=2] [--reps 5]

State: the `small` preset with `--layers` blocks (28: 0.99 GB of fp32 weights + AdamW moments), trained
one step under `--old`, on spawned gloo ranks (world = the larger of the two layouts; every rank is a
survivor, as in a planned resize on live workers). Each repetition runs, in rotating order:

  live:   `parallel.live.hold` + `plan_exchange` + `transfer` + `Trainer.adopt` into a trainer of the new
          layout (what a planned resize moves); the bytes that cross the network are counted;
  raw:    `batch_isend_irecv` of exactly those bytes between the same processes (one message per pair):
          the network's own speed, the target's denominator;
  storage: a blocking checkpoint save under the old layout plus a cold load into a fresh trainer of the
          new layout (what the storage path moves).

Reported: medians, the live transfer's throughput as a fraction of raw gloo, and live vs storage. The
event -> first-step figures of a whole resize (coordinator included) are not here yet: the coordinator
does not use the live path yet (issue 13, deliverable 3).
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
    from workers.config import JobConfig
    from workers.trainer import Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    old_l, new_l = Layout.parse(old), Layout.parse(new)
    if old_l.world_size != world or new_l.world_size != world:
        raise ValueError("this benchmark keeps every worker: both layouts must have the same world size")
    cfg = JobConfig.from_dict(cfg_dict)
    cpu = torch.device("cpu")
    src = Trainer(cfg, layout=old_l, device=cpu).build()
    src.train_step()
    dst = Trainer(cfg, layout=new_l, device=cpu).build()
    meta = build_model(cfg.model.build())
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    old_b, new_b = boxes(old_l, shapes, len(meta.layers)), boxes(new_l, shapes, len(meta.layers))
    ident = {r: r for r in range(world)}
    dtypes = {k: torch.float32 for b in list(old_b.values()) + list(new_b.values()) for k in b}
    state = src._checkpoint_state()
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
        pieces = live.transfer(plan, old_rank=rank, new_rank=rank, held=held, dtypes=dtypes,
                               old_to_group=ident, new_to_group=ident)
        out["transfer"].append(time.perf_counter() - t)
        t = time.perf_counter()
        dst.adopt(pieces, steps, state)
        out["adopt"].append(time.perf_counter() - t)

    sent = {}

    def run_raw() -> None:
        # What this rank sends in the live plan, to each peer, as one message per pair.
        ops = []
        for peer, n in sent.items():
            ops.append(dist.P2POp(dist.isend, torch.empty(n, dtype=torch.uint8), peer))
            ops.append(dist.P2POp(dist.irecv, torch.empty(recv[peer], dtype=torch.uint8), peer))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

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
        fresh = Trainer(cfg, layout=new_l, device=cpu).build()
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--old", default="tp=2")
    ap.add_argument("--new", default="dp=2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from benchmarks.checkpoint import _cfg
    from parallel.layout import Layout
    from tests.multiproc import run_ranks

    work = tempfile.mkdtemp(prefix="elastron-live-bench-")
    try:
        res = run_ranks(Layout.parse(args.old).world_size, body, _cfg("small", args.layers, None), args.old,
                        args.new, work, args.reps, timeout=3600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res[0]["runs"].items()}
    moved = res[0]["moved_bytes_total"]
    state = sum(r["state_bytes_rank"] for r in res)
    r = {"date": time.strftime("%Y-%m-%d"), "old": args.old, "new": args.new, "reps": args.reps,
         "state_bytes": state, "network_bytes": moved, "medians_s": med,
         "live_vs_raw_throughput": med["raw"] / med["live"], "storage_vs_live": med["storage"] / med["live"],
         "transfer_vs_raw_throughput": med["raw"] / med["transfer"],
         "runs": res[0]["runs"], "load_avg": os.getloadavg()[0]}
    print(f"State {state / 1e9:.2f} GB ({args.old} -> {args.new}, every worker a survivor); "
          f"{moved / 1e9:.2f} GB cross the network; medians of {args.reps} interleaved runs.\n")
    print("| path | s | note |\n|---|---|---|")
    print(f"| live path (hold, plan, send/recv, fill) | {med['live']:.2f} | of which hold+plan "
          f"{med['plan']:.3f} s, transfer {med['transfer']:.3f} s, fill {med['adopt']:.3f} s (rank 0) |")
    print(f"| raw gloo send/recv of the bytes that cross | {med['raw']:.2f} | transfer step at "
          f"{100 * r['transfer_vs_raw_throughput']:.0f}% of raw throughput (target >= 50%); whole live path "
          f"{100 * r['live_vs_raw_throughput']:.0f}% |")
    print(f"| storage path (blocking save + cold load) | {med['storage']:.2f} | live is "
          f"{r['storage_vs_live']:.1f}x faster |")
    print(json.dumps(r, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
