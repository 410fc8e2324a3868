"""Elastron's per-event work at 32 ... 4,096 ranks, with pure code and a fake pool (no GPU, no Ray).

    .venv/bin/python benchmarks/scale.py plan --model 8b --old dp_shard=64,tp=8 --new dp_shard=60,tp=8
    .venv/bin/python benchmarks/scale.py plan --model 70b --old dp_shard=64,tp=8,pp=2 --new dp_shard=60,tp=8,pp=2
    .venv/bin/python benchmarks/scale.py plan --model 8b --old dp=2 --new dp=1 --baseline 4edddd6
    .venv/bin/python benchmarks/scale.py manifest --model 8b --layout dp_shard=64,tp=8
    .venv/bin/python benchmarks/scale.py coordinator --workers 1024

plan: the live reshard's planning as one worker does it (`workers.reshard.exchange`): two `BoxMap`s
  and `plan_rank`, for a sample of workers (`--ranks N` spread over the world, plus the first and last
  survivor and joiner, or `--ranks all`); survivors keep their rank (new rank r is old rank r), nodes
  hold `--per-node` consecutive ranks. Reported: the slowest sampled worker's plan time, and per worker
  the transfers, the pieces it sends over the network and the messages it posts (one per piece of at
  least `parallel.live.PACK_BELOW` bytes, one per peer for the smaller ones), the largest of each.
  `--baseline REV` also times, on the same box in the same run, the whole-plan flow of git revision REV
  (its `sharding.boxes` of both layouts and `exchange.plan_exchange`, which every worker used to run).
manifest: the bytes of the checkpoint manifest (format 2, one chunk per distinct box with its block
  digests, as `CheckpointManager` writes it) that every rank reads on load, against the metadata of one
  rank's own boxes; built in memory, nothing written. `--load` also times what every rank does with
  metadata: on save, `state.assign_writers` over every rank's boxes (all-gathered to every rank); on
  load, parsing the manifest and checking its structure.
coordinator: the fake pool of tests/fakes.py with `--workers` workers (8 per node) running an `8b` job;
  a preemption notice on one node; the coordinator's time from the `step()` that sees the notice to
  the start of the live transfer (`Group.reshard`), and its whole step.

Shapes: the `8b` preset, and `70b` = dim 8192, 80 layers, 64 heads, 8 KV heads, ffn 28672, vocab
128256 (Llama-3-70B), fp32 state (itemsize 4) with both AdamW moments.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.config import ModelConfig, model_config  # noqa: E402
from parallel.exchange import plan_rank  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from parallel.sharding import BoxMap  # noqa: E402

STATES = ("exp_avg", "exp_avg_sq")
ITEMSIZE = 4
PACK_BELOW = 64 << 10  # parallel.live.PACK_BELOW (not imported: parallel.live imports torch)


def model(name: str) -> ModelConfig:
    if name == "70b":
        return model_config("8b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                            vocab_size=128256)
    return model_config(name)


def shapes_of(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from models.llama import build_model

    return {n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()}  # meta device: no memory


def sample_ranks(old: Layout, new: Layout, n: int | None) -> list[int]:
    world = max(old.world_size, new.world_size)
    if n is None:
        return list(range(world))
    edge = {0, min(old.world_size, new.world_size) - 1, min(old.world_size, new.world_size), world - 1,
            old.world_size - 1, new.world_size - 1}
    return sorted({r for r in edge if 0 <= r < world} | {round(i * (world - 1) / max(1, n - 1)) for i in range(n)})


def plan_one(cfg: ModelConfig, shapes, old: Layout, new: Layout, w: int, per_node: int):
    """One worker's plan as `workers.reshard.exchange` computes it; returns (seconds, transfers)."""
    world = max(old.world_size, new.world_size)
    node = {r: f"n{r // per_node}" for r in range(world)}
    survivors = {r: r for r in range(min(old.world_size, new.world_size))}
    gc.collect()
    t = time.perf_counter()
    plan = plan_rank(BoxMap(old, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings),
                     BoxMap(new, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings),
                     old_rank=w if w < old.world_size else None, new_rank=w if w < new.world_size else None,
                     alive=range(old.world_size), same_worker=survivors, old_node=node, new_node=node)
    return time.perf_counter() - t, plan


def messages(plan, w: int) -> int:
    """Messages worker `w` posts (sends and receives), as `parallel.live.transfer` groups them."""
    pairs: dict[tuple[str, int], list[int]] = defaultdict(list)
    for t in plan:
        if t.src == w and t.dst == w:
            continue
        pairs[("send", t.dst) if t.src == w else ("recv", t.src)].append(t.box.numel * ITEMSIZE)
    return sum((1 if any(b < PACK_BELOW for b in bs) else 0) + sum(b >= PACK_BELOW for b in bs)
               for bs in pairs.values())


def load_revision(rev: str):
    """`sharding` and `exchange` modules of git revision `rev`, importable side by side with today's."""
    tmp = Path(tempfile.mkdtemp(prefix="scale-baseline-"))
    mods = {}
    for name in ("sharding", "exchange"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:parallel/{name}.py"], check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("from parallel.sharding import", "from baseline_sharding import")
        (tmp / f"baseline_{name}.py").write_text(text)
    sys.path.insert(0, str(tmp))
    for name in ("sharding", "exchange"):
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", tmp / f"baseline_{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[f"baseline_{name}"] = mods[name]
        spec.loader.exec_module(mods[name])
    return mods


def cmd_plan(a) -> dict:
    cfg = model(a.model)
    shapes = shapes_of(cfg)
    old, new = Layout.parse(a.old), Layout.parse(a.new)
    ranks = sample_ranks(old, new, None if a.ranks == "all" else int(a.ranks))
    rows = []
    for w in ranks:
        best = math.inf
        for _ in range(a.reps):
            dt, plan = plan_one(cfg, shapes, old, new, w, a.per_node)
            best = min(best, dt)
        sent = [t for t in plan if t.src == w and t.dst != w]
        got = [t for t in plan if t.dst == w and t.src != w]
        rows.append({"rank": w, "plan_s": best, "transfers": len(plan), "sent_pieces": len(sent),
                     "received_pieces": len(got), "messages": messages(plan, w),
                     "bytes_sent": sum(t.box.numel for t in sent) * ITEMSIZE,
                     "bytes_received": sum(t.box.numel for t in got) * ITEMSIZE})
    slow = max(rows, key=lambda r: r["plan_s"])
    out = {"model": a.model, "old": str(old), "new": str(new), "old_ranks": old.world_size,
           "new_ranks": new.world_size, "sampled_workers": len(rows), "slowest_plan_s": slow["plan_s"],
           "slowest_rank": slow["rank"], "median_plan_s": sorted(r["plan_s"] for r in rows)[len(rows) // 2],
           **{f"max_{k}": max(r[k] for r in rows) for k in ("transfers", "sent_pieces", "received_pieces",
                                                               "messages", "bytes_sent", "bytes_received")}}
    if a.baseline:
        base = load_revision(a.baseline)
        gc.collect()
        t = time.perf_counter()
        ob = base["sharding"].boxes(old, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings)
        nb = base["sharding"].boxes(new, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings)
        whole = base["exchange"].plan_exchange(ob, nb, same_worker={r: r for r in range(min(old.world_size,
                                                                                         new.world_size))})
        out["baseline"] = {"rev": a.baseline, "every_worker_plan_s": time.perf_counter() - t,
                           "transfers_in_all": len(whole)}
    if a.verbose:
        out["workers"] = rows
    return out


def cmd_manifest(a) -> dict:
    """Format-2 manifest bytes for one checkpoint of `--layout`, and one rank's own share of them."""
    from parallel.checkpoint.manifest import Chunk, FileEntry, Manifest, TensorEntry

    cfg = model(a.model)
    shapes = shapes_of(cfg)
    lay = Layout.parse(a.layout)
    bm = BoxMap(lay, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings)
    digest = "0" * 32  # xxh3-128 hex, the default algorithm's length
    block_bytes = 1 << 20
    tensors: dict[str, list] = defaultdict(list)
    file_bytes: Counter = Counter()
    writers: dict = {}
    per_rank_chunks: Counter = Counter()
    for r in range(lay.world_size):  # each distinct box written once, by its first holder
        for key, b in bm.held(r).items():
            if (key, b) in writers:
                continue
            writers[(key, b)] = r
            row = math.prod(b.sizes[1:]) * ITEMSIZE
            rows = max(1, min(block_bytes, max(64 << 10, row * b.sizes[0] // 16)) // max(row, 1))
            name = f"shard-r{r:05d}-00.safetensors"
            file_bytes[name] += b.numel * ITEMSIZE
            tensors[key].append(Chunk(file=name, offsets=b.offsets, sizes=b.sizes, block_rows=rows,
                                      digests=(digest,) * -(-b.sizes[0] // rows)))
            per_rank_chunks[r] += 1
    files = {n: FileEntry(size=size, digest=digest, algorithm="xxh3-128", blockwise=True)
             for n, size in file_bytes.items()}
    m = Manifest(step=1, files=files, state={"layout": lay.to_dict()}, tensors={
        k: TensorEntry(shape=shapes[k.split(".", 1)[1] if k.startswith("model.") else k.split(".", 2)[2]],
                       dtype="float32", chunks=tuple(cs)) for k, cs in tensors.items()})
    text = m.to_json().encode()
    total = len(text)
    own = {k: b for k, b in bm.held(0).items()}
    chunks_total = sum(len(c) for c in tensors.values())
    load = {}
    if a.load:  # what every rank does on save today: choose writers from every rank's gathered boxes
        from parallel.checkpoint.state import assign_writers

        plans = [[(k, b.offsets, b.sizes, b.numel * ITEMSIZE) for k, b in bm.held(r).items()]
                 for r in range(lay.world_size)]
        t = time.perf_counter()
        assign_writers(plans)
        load["save_assign_writers_s"] = time.perf_counter() - t
        load["save_gathered_records"] = sum(len(p) for p in plans)
        del plans
    if a.load:  # what every rank does with it on load: parse, then check its structure
        t = time.perf_counter()
        parsed = Manifest.from_json(text)
        load["parse_s"] = time.perf_counter() - t
        t = time.perf_counter()
        problems = parsed.structure_problems()
        load["structure_check_s"] = time.perf_counter() - t
        load["problems"] = len(problems)
    return {**load, "model": a.model, "layout": str(lay), "ranks": lay.world_size, "chunks": chunks_total,
            "manifest_bytes": total, "bytes_per_chunk": total / chunks_total,
            "rank0_boxes": len(own), "rank0_share_bytes": round(total * len(own) / chunks_total)}


def cmd_coordinator(a) -> dict:
    from service.control.coordinator import Coordinator, CoordinatorOptions
    from service.control.job import Job
    from tests.fakes import Disk, FakeCluster, FakeGroup
    from workers.config import JobConfig

    n_nodes = a.workers // 8
    cluster = FakeCluster({f"node{i:05d}": 8 for i in range(n_nodes)})
    cfg = JobConfig.from_dict({
        "model": {"preset": "8b"},
        "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 10_000, "global_batch_size": a.workers * 4, "micro_batch_size": 1},
        "parallel": {"min_workers": 8, "max_workers": a.workers, "gpus_per_node": 8, "reshard": "live",
                     "dp_mode": a.dp_mode, "memory_budget_gb": 80},
        "checkpoint": {"interval_steps": 50},
    })
    calls: dict[str, float] = {}

    class Timed(FakeGroup):
        heals = True  # survivors of a failure keep their state, as real workers do

        def reshard(self, old, new, nodes, *, survivors=None):
            calls.setdefault("heal_called" if survivors is not None else "reshard_called", time.perf_counter())
            return super().reshard(old, new, nodes, survivors=survivors)

        def form(self, plan, *, adopt=False):
            calls.setdefault("form_called", time.perf_counter())
            return super().form(plan, adopt=adopt)

    group = type("G", (Timed,), {"disk": Disk(50), "cluster": cluster, "fail_next": []})
    with tempfile.TemporaryDirectory() as run_dir:
        c = Coordinator(Job.of(cfg, job_id="scale", run_dir=Path(run_dir)), watcher=cluster.watcher(),
                        options=CoordinatorOptions(settle_seconds=0.0, max_restarts=2))
        c.worker_group_cls = group
        c.group_probe = lambda nodes, timeout_s: set(nodes)
        t = time.perf_counter()
        for _ in range(50):
            c.watcher.poll()
            c.step()
            if str(c.sm.state) == "RUNNING" and c.plan is not None:
                break
        start_s = time.perf_counter() - t
        first = c.plan
        for _ in range(3):  # a few steady steps
            c.watcher.poll()
            c.step()
        cluster.draining[f"node{n_nodes - 1:05d}"] = int(time.time() * 1000) + 30_000
        t0 = time.perf_counter()
        c.watcher.poll()
        steps = 0
        while "reshard_called" not in calls and steps < 20:
            c.step()
            steps += 1
        decided_s = calls.get("reshard_called", math.nan) - t0
        total_s = time.perf_counter() - t0
        calls.pop("form_called", None)
        for _ in range(2):
            c.watcher.poll()
            c.step()
        cluster.dead.add("node00000")  # a node dies without notice: salvage, then heal or restore
        t1 = time.perf_counter()
        c.watcher.poll()
        for _ in range(20):
            if "heal_called" in calls or "form_called" in calls:
                break
            c.step()
        failed_s = min(calls.get("heal_called", math.inf), calls.get("form_called", math.inf)) - t1
        return {"workers": a.workers, "first_plan": str(first.layout) if first else None,
                "first_world": first.world_size if first else None, "start_s": start_s,
                "new_plan": str(c.plan.layout) if c.plan else None,
                "new_world": c.plan.world_size if c.plan else None,
                "notice_to_transfer_start_s": decided_s, "steps": steps, "event_steps_s": total_s,
                "failure_to_new_group_s": failed_s, "failure_path": "heal" if "heal_called" in calls else "restore",
                "after_failure_plan": str(c.plan.layout) if c.plan else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--model", default="8b", choices=["8b", "70b", "1b", "small", "tiny"])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--ranks", default="16", help="workers to time: a count spread over the world, or 'all'")
    p.add_argument("--reps", type=int, default=1, help="repetitions per worker (the fastest is kept)")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--baseline", help="git revision whose whole-plan flow to time beside it")
    p.add_argument("--verbose", action="store_true")
    m = sub.add_parser("manifest")
    m.add_argument("--model", default="8b", choices=["8b", "70b", "1b", "small", "tiny"])
    m.add_argument("--layout", required=True)
    m.add_argument("--load", action="store_true", help="also time parsing and checking it, as a load does")
    c = sub.add_parser("coordinator")
    c.add_argument("--workers", type=int, default=1024)
    c.add_argument("--dp-mode", default="shard", choices=["shard", "replicate", "auto"])
    a = ap.parse_args()
    out = {"plan": cmd_plan, "manifest": cmd_manifest, "coordinator": cmd_coordinator}[a.cmd](a)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
