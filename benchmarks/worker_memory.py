"""Where a training worker's resident memory goes: N forked ranks (one node each, as far as the peer
snapshots' pairing is concerned) drive `workers.actor.Worker` directly, no Ray, and rank 0 records its
RSS at each phase of a job's life: joined (model and optimizer built), after the first step, after
steps with peer snapshots (every step, `peer_budget` 0) or without (`peer_interval` 0), after an async
checkpoint save, and after `malloc_trim(0)` (what the process holds, less the free heap glibc keeps).

    .venv/bin/python benchmarks/worker_memory.py [--workers 4] [--preset small] [--emulate-s-per-sample 0.5] \
        [--json benchmarks/results/worker-memory-small-4.json]

Each phase also records the RSS by kind (anonymous, mapped files, shared memory), glibc's account
(`mallinfo2`) and, with snapshots, the bytes their buffers take (`PeerSnapshots.memory_bytes`) and the
state this rank holds (its shards of the model and the optimizer).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.soak_heap import glibc_heap, rss_mb, rss_parts  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402
from tests.ports import free_port  # noqa: E402

STEPS = 4
"""Steps trained after the first, with or without snapshots."""


def job_config(preset: str, emulate_s_per_sample: float, peer_interval: int) -> dict:
    model = {"preset": preset, **({"overrides": {"emulate_s_per_sample": emulate_s_per_sample}}
                                  if emulate_s_per_sample > 0 else {})}
    return {"name": "worker-memory", "model": model, "data": {"source": "synthetic", "seq_len": 64},
            "train": {"steps": 1_000_000, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-3,
                      "warmup_steps": 2, "seed": 5},
            "parallel": {"dp_mode": "shard", "reshard": "live"},
            "checkpoint": {"interval_steps": 1_000_000, "async_save": True, "keep_last": 2,
                           "peer_interval": peer_interval, "peer_budget": 0.0}}


def phases(cfg_dict: dict, run_dir: str, port: int, world: int) -> dict | None:
    import torch.distributed as dist

    from parallel.live import hold
    from workers.actor import Worker
    from workers.config import JobConfig, job_plan

    rank = dist.get_rank()
    dist.destroy_process_group()
    os.environ["ELASTRON_NODE_ID"] = f"node-{rank}"
    cfg = JobConfig.from_dict(cfg_dict)
    rows: list[dict] = []

    def sample(phase: str) -> None:
        if rank != 0:
            return
        gc.collect()
        row = {"phase": phase, "rss_mb": rss_mb(), **rss_parts(), **glibc_heap()}
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

    sample("started (imports)")
    w = Worker(cfg, run_dir)
    w.join(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, plan=job_plan(cfg, world))
    sample("joined")
    w.run(until_step=1_000_000, steps=1)
    sample("1 step")
    w.run(until_step=1_000_000, steps=STEPS)
    if w.snapshots is not None:
        w.snapshots.wait()
    sample(f"{1 + STEPS} steps")
    w.checkpoint(blocking=False)
    w.run(until_step=1_000_000, steps=1)
    w.trainer.flush_checkpoint()
    sample("async save + 1 step")
    state_mb = sum(t.numel() * t.element_size() for t in hold(w.trainer.model, w.trainer.optimizer).tensors.values())
    snap_mb = w.snapshots.memory_bytes if w.snapshots is not None else 0
    if rank == 0:
        ctypes.CDLL(None).malloc_trim(0)
    sample("after malloc_trim")
    w.leave()
    if rank != 0:
        return None
    return {"rows": rows, "state_mb": state_mb / 2**20, "snapshot_buffers_mb": snap_mb / 2**20}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--emulate-s-per-sample", type=float, default=0.5)
    ap.add_argument("--json", help="default: benchmarks/results/worker-memory-<preset>-<workers>.json")
    a = ap.parse_args(argv)
    if a.workers < 2:
        ap.error(f"--workers must be at least 2 (peer snapshots need a buddy), got {a.workers}")
    out_json = Path(a.json or ROOT / "benchmarks" / "results" / f"worker-memory-{a.preset}-{a.workers}.json")
    out = {"command": " ".join(["python", *sys.argv]), "preset": a.preset, "workers": a.workers,
           "emulate_s_per_sample": a.emulate_s_per_sample, "runs": {}}
    for name, interval in (("snapshots every step", 1), ("snapshots off", 0)):
        print(f"-- {name}", flush=True)
        with tempfile.TemporaryDirectory(prefix="worker-memory-") as run_dir:
            out["runs"][name] = run_ranks(a.workers, phases, job_config(a.preset, a.emulate_s_per_sample, interval),
                                          run_dir, free_port(), a.workers, timeout=900)[0]
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(out, indent=1))
    for name, res in out["runs"].items():
        print(f"{name}: state {res['state_mb']:.0f} MiB, snapshot buffers {res['snapshot_buffers_mb']:.0f} MiB")
        for r in res["rows"]:
            print(f"  {r['phase']:<22} RSS {r['rss_mb']:7.0f} MiB  anon {r.get('anon_mb', 0):7.0f}  "
                  f"heap in use {r['in_use_mb']:6.0f}  free {r['free_mb']:6.0f}  mmapped {r['mmapped_mb']:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
