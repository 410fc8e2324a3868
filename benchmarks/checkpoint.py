"""Checkpoint save/load against the raw disk, and what an async save costs the training loop.

    cd /work/main && .venv/bin/python benchmarks/checkpoint.py [--layers 28] [--save-layout tp=2]
        [--load-layout dp=1] [--reps 5] [--dir DIR] [--json out.json]

State: the `small` preset with `--layers` blocks (28: 82.9M parameters, fp32 weights + AdamW exp_avg and
exp_avg_sq = 0.99 GB), trained one step so the optimizer state exists. Phase 1 runs on the ranks of
`--save-layout` (spawned gloo ranks, as in the tests); phase 2 on those of `--load-layout`. Each number
is the median of `--reps` repetitions, interleaved with its baseline so drift on a shared box hits both:

  (a) load:  `CheckpointManager.load_latest` (checksums + DCP resharding read) / a plain sequential
             read (16 MiB `readinto`) of the same files, cold (posix_fadvise DONTNEED on every file
             before each cold measurement) and warm;             target <= 1.25x raw read (cold)
  (b) save:  bytes / `save(blocking=True)` time (write, fsync, checksums, manifest, commit) vs the same
             per-rank byte counts written with os.write + fsync into the same directory, in parallel
             on the same ranks;                                    target >= 70% of raw write
  (c) async: what `save(blocking=False)` blocks its caller vs `save(blocking=True)` on the same state
             (staging buffers already allocated; the first call is reported too);  target <= 5%

Where time goes is taken on rank 0 by wrapping (never changing) the functions the manager calls: the
checksum pass, the DCP read/write, the read-back of written files, staging. Ranks are spawned with
tests/multiproc.run_ranks (gloo, OMP_NUM_THREADS=1). Prints a markdown table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_CHUNK = 16 << 20
TARGETS = {"load_cold_ratio": 1.25, "save_fraction": 0.70, "async_block_fraction": 0.05}


def _cfg(layers: int) -> dict:
    return {
        "model": {"preset": "small", "overrides": {"n_layers": layers}},
        "data": {"source": "corpus", "seq_len": 32, "max_bytes": 300_000},
        "train": {"steps": 1000, "global_batch_size": 2, "micro_batch_size": 1, "warmup_steps": 0},
        "checkpoint": {"interval_steps": 100_000, "keep_last": 2, "async_save": True},
    }


# -- timing helpers ------------------------------------------------------------------------------------

class _Timers:
    """Seconds spent inside wrapped callables, summed per name since the last `reset()` (thread-safe:
    the writer thread calls some of them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acc: dict[str, float] = {}

    def reset(self) -> dict[str, float]:
        with self.lock:
            out, self.acc = self.acc, {}
        return out

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with self.lock:
                    self.acc[name] = self.acc.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED only drops clean pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resident_bytes(paths: list[str]) -> int | None:
    """Bytes of `paths` in the page cache (util-linux fincore); None where it is unavailable."""
    try:
        r = subprocess.run(["fincore", "--bytes", "--raw", "--noheadings", "-o", "RES", *paths],
                           capture_output=True, text=True, timeout=30, check=True)
        return sum(int(x) for x in r.stdout.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _raw_read(paths: list[str]) -> float:
    buf = bytearray(_CHUNK)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def _raw_write(path: str, nbytes: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, left = memoryview(block), nbytes
        while left:
            left -= os.write(fd, view[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)


def _ckpt_files(root: str) -> tuple[str, list[str]]:
    """(newest committed checkpoint directory, its files: shards first, manifest last)."""
    from parallel.checkpoint.storage import LocalStorage
    from parallel.checkpoint.validate import list_step_dirs

    (_, name), *_ = list_step_dirs(LocalStorage(root))
    d = os.path.join(root, name)
    shards = sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".safetensors"))
    return d, [*shards, os.path.join(d, "manifest.json")]


# -- phase 1: save (rank body) ---------------------------------------------------------------------------

def save_body(cfg_dict: dict, layout: str, root: str, reps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from parallel.checkpoint import state as state_mod
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    cfg = JobConfig.from_dict({**cfg_dict, "checkpoint": {**cfg_dict["checkpoint"], "dir": root}})
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(cfg, layout=Layout.parse(layout), device=torch.device("cpu")).build()
    t0 = time.perf_counter()
    trainer.train_step()  # creates the AdamW state
    first_step_s = time.perf_counter() - t0
    mgr = trainer.checkpointer
    timers = _Timers()
    timers.wrap(dcp, "save", "dcp_save")  # the manager looks dcp.save up at call time
    timers.wrap(mgr, "_describe_files", "read_back_checksums")
    timers.wrap(mgr, "_commit", "commit")
    timers.wrap(mgr.storage, "commit_dir", "commit_dir")
    timers.wrap(mgr.storage, "write_bytes", "manifest_and_latest")
    timers.wrap(mgr, "_retain", "retention")
    timers.wrap(state_mod, "collect", "collect")
    timers.wrap(mgr._stager, "stage", "stage")
    state = trainer._checkpoint_state()
    step = [10_000]

    def save(blocking: bool) -> float:
        step[0] += 1
        dist.barrier()
        t = time.perf_counter()
        mgr.save(step[0], trainer.model, trainer.optimizer, state=state, blocking=blocking)
        return time.perf_counter() - t

    def slowest(x: float) -> float:
        out = [None] * world
        dist.all_gather_object(out, x)
        return max(out)

    # Warm-up save (not counted): first-call costs of DCP and the gloo group; tells us the file sizes.
    warm_s = slowest(save(True))
    _, files = _ckpt_files(root)
    shards = files[:-1]
    sizes = [os.path.getsize(p) for p in shards]
    total = sum(os.path.getsize(p) for p in files)
    # Each rank writes what it wrote in the checkpoint (one shard per rank in distributed mode).
    mine = sizes[rank] if len(sizes) == world else total // world
    block = os.urandom(_CHUNK)
    timers.reset()

    rows: dict[str, list[float]] = {k: [] for k in (
        "raw_write_s", "sync_save_s", "async_block_s", "async_write_s", "step_s", "step_during_write_s")}
    parts: dict[str, list[float]] = {}
    first_async = None
    for i in range(reps):
        raw = os.path.join(root, f"raw-{rank}.bin")
        dist.barrier()
        t = time.perf_counter()
        _raw_write(raw, mine, block)
        dist.barrier()
        rows["raw_write_s"].append(slowest(time.perf_counter() - t))
        os.unlink(raw)

        timers.reset()
        rows["sync_save_s"].append(slowest(save(True)))
        for k, v in timers.reset().items():
            parts.setdefault(f"sync.{k}", []).append(v)

        dist.barrier()
        t = time.perf_counter()
        trainer.train_step()
        rows["step_s"].append(slowest(time.perf_counter() - t))

        blocked = slowest(save(False))
        if i == 0:
            first_async = blocked  # this call allocated the staging buffers
        else:
            rows["async_block_s"].append(blocked)
        for k, v in timers.reset().items():
            if k in ("collect", "stage"):
                parts.setdefault(f"async.{k}", []).append(v)
        t = time.perf_counter()
        trainer.train_step()  # runs while the write is in flight
        rows["step_during_write_s"].append(slowest(time.perf_counter() - t))
        mgr.flush()
        rows["async_write_s"].append(slowest(mgr.write_s))
        timers.reset()
    return {
        "rank": rank, "files": len(files), "bytes": total, "shard_bytes": sizes, "warmup_save_s": warm_s,
        "first_train_step_s": first_step_s, "first_async_block_s": first_async,
        "runs": rows, "parts": parts,
    }


# -- phase 2: load (rank body) ---------------------------------------------------------------------------

def load_body(cfg_dict: dict, layout: str, root: str, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from parallel.checkpoint import manager as manager_mod
    from parallel.checkpoint.manager import CheckpointManager
    from parallel.checkpoint.storage import LocalStorage
    from parallel.checkpoint.tensor_io import ManifestReader
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    cfg = JobConfig.from_dict(cfg_dict)  # no checkpoint dir: build() does not resume, we time the load
    rank = dist.get_rank()
    trainer = Trainer(cfg, layout=Layout.parse(layout), device=torch.device("cpu")).build()
    mgr = CheckpointManager(root, keep_last=2)
    timers = _Timers()
    timers.wrap(manager_mod, "file_problems", "checksums")
    timers.wrap(ManifestReader, "read_data", "read_data")
    ckpt, files = _ckpt_files(root)
    expected = trainer._expected_tensors()

    checked = manager_mod.file_problems

    def load(cold: bool, checksums: bool = True) -> tuple[float, dict[str, float]]:
        if cold:
            _drop_cache(files)
        # Without checksums: what the DCP read path costs on its own, reading cold files itself.
        manager_mod.file_problems = checked if checksums else (lambda *a, **k: [])
        dist.barrier()
        timers.reset()
        t = time.perf_counter()
        try:
            m = mgr.load_latest(trainer.model, trainer.optimizer, expected=expected)
        finally:
            manager_mod.file_problems = checked
        dt = time.perf_counter() - t
        if m is None or m.step < 10_000:
            raise RuntimeError(f"loaded {m and m.step} from {root}, expected the benchmark's checkpoint")
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, dt)
        return max(out), timers.reset()

    # The first load goes into a freshly built trainer: AdamW state is created inside it (DCP's
    # zero-LR step) and every target is touched for the first time, as in a real resume.
    _drop_cache(files)
    dropped = _resident_bytes(files)
    first_s, first_parts = load(cold=True)

    # Does the checksum pass leave the files in the page cache for the DCP read that follows?
    _drop_cache(files)
    storage = LocalStorage(root)
    from parallel.checkpoint.manifest import Manifest

    manifest = Manifest.from_json(Path(files[-1]).read_text())
    from parallel.checkpoint.validate import file_problems  # the unwrapped original

    t = time.perf_counter()
    problems = file_problems(storage, ckpt, manifest)
    checksum_cold_s = time.perf_counter() - t
    if problems:
        raise RuntimeError(f"benchmark checkpoint is broken: {problems}")
    after_checksums = _resident_bytes(files)
    t = time.perf_counter()
    file_problems(storage, ckpt, manifest)
    checksum_warm_s = time.perf_counter() - t

    rows: dict[str, list[float]] = {k: [] for k in ("raw_read_cold_s", "raw_read_warm_s", "load_cold_s",
                                                    "load_warm_s", "load_cold_nochecksum_s")}
    parts: dict[str, list[float]] = {}
    for _ in range(reps):
        _drop_cache(files)
        rows["raw_read_cold_s"].append(_raw_read(files))
        rows["raw_read_warm_s"].append(_raw_read(files))
        for kind in ("cold", "warm"):
            dt, p = load(cold=kind == "cold")
            rows[f"load_{kind}_s"].append(dt)
            for k, v in p.items():
                parts.setdefault(f"{kind}.{k}", []).append(v)
        dt, p = load(cold=True, checksums=False)
        rows["load_cold_nochecksum_s"].append(dt)
        parts.setdefault("cold_nochecksum.read_data", []).append(p.get("read_data", 0.0))
    return {
        "rank": rank, "bytes": sum(os.path.getsize(p) for p in files), "first_load_s": first_s,
        "first_load_parts": first_parts, "resident_after_drop": dropped, "resident_after_checksums":
        after_checksums, "checksum_cold_s": checksum_cold_s, "checksum_warm_s": checksum_warm_s,
        "runs": rows, "parts": parts,
    }


# -- report ----------------------------------------------------------------------------------------------

def summarize(save: dict, load: dict, args: argparse.Namespace, load_avg: tuple) -> dict:
    med = {k: _median(v) for k, v in {**save["runs"], **load["runs"]}.items()}
    gb = 1e9
    sb, lb = save["bytes"], load["bytes"]
    r = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, no GPU",
        "state_bytes": sb,
        "save_layout": args.save_layout, "load_layout": args.load_layout, "reps": args.reps,
        "load_cold_s": med["load_cold_s"], "raw_read_cold_s": med["raw_read_cold_s"],
        "load_warm_s": med["load_warm_s"], "raw_read_warm_s": med["raw_read_warm_s"],
        "first_load_s": load["first_load_s"], "load_cold_nochecksum_s": med["load_cold_nochecksum_s"],
        "load_cold_ratio": med["load_cold_s"] / med["raw_read_cold_s"],
        "load_warm_ratio": med["load_warm_s"] / med["raw_read_warm_s"],
        "first_load_ratio": load["first_load_s"] / med["raw_read_cold_s"],
        "load_cold_nochecksum_ratio": med["load_cold_nochecksum_s"] / med["raw_read_cold_s"],
        "sync_save_s": med["sync_save_s"], "raw_write_s": med["raw_write_s"],
        "save_gbps": sb / med["sync_save_s"] / gb, "raw_write_gbps": sb / med["raw_write_s"] / gb,
        "save_fraction": med["raw_write_s"] / med["sync_save_s"],
        "async_block_s": med["async_block_s"], "first_async_block_s": save["first_async_block_s"],
        "async_block_fraction": med["async_block_s"] / med["sync_save_s"],
        "async_write_s": med["async_write_s"],
        "step_s": med["step_s"], "step_during_write_s": med["step_during_write_s"],
        "load_parts": {k: _median(v) for k, v in load["parts"].items()},
        "first_load_parts": load["first_load_parts"],
        "save_parts": {k: _median(v) for k, v in save["parts"].items()},
        "checksum_cold_s": load["checksum_cold_s"], "checksum_warm_s": load["checksum_warm_s"],
        "resident_after_drop": load["resident_after_drop"],
        "resident_after_checksums": load["resident_after_checksums"],
        "warmup_save_s": save["warmup_save_s"], "load_avg_start_end": load_avg,
        "runs": {**save["runs"], **load["runs"]},
    }
    r["met"] = {
        "load_cold_ratio": r["load_cold_ratio"] <= TARGETS["load_cold_ratio"],
        "save_fraction": r["save_fraction"] >= TARGETS["save_fraction"],
        "async_block_fraction": r["async_block_fraction"] <= TARGETS["async_block_fraction"],
    }
    return r


def table(r: dict) -> str:
    gib = r["state_bytes"] / 2**30
    yes = {True: "yes", False: "**no**"}
    lines = [
        f"State: {r['state_bytes'] / 1e9:.2f} GB ({gib:.2f} GiB) of fp32 weights + AdamW state; saved under "
        f"{r['save_layout']}, loaded under {r['load_layout']}; medians of {r['reps']} runs; 1-min load "
        f"average {r['load_avg_start_end'][0]:.1f} at the start, {r['load_avg_start_end'][1]:.1f} at the end.",
        "",
        "| measurement | Elastron | raw baseline | ratio | target | met |",
        "|---|---|---|---|---|---|",
        f"| (a) load, cold cache | {r['load_cold_s']:.2f} s | read {r['raw_read_cold_s']:.2f} s | "
        f"{r['load_cold_ratio']:.2f}x | <= 1.25x | {yes[r['met']['load_cold_ratio']]} |",
        f"| (a) load, warm cache | {r['load_warm_s']:.2f} s | read {r['raw_read_warm_s']:.2f} s | "
        f"{r['load_warm_ratio']:.2f}x | - | - |",
        f"| (a) first load into a fresh trainer, cold | {r['first_load_s']:.2f} s | read "
        f"{r['raw_read_cold_s']:.2f} s | {r['first_load_ratio']:.2f}x | - | - |",
        f"| (a) load, cold, checksum pass skipped (diagnostic) | {r['load_cold_nochecksum_s']:.2f} s | read "
        f"{r['raw_read_cold_s']:.2f} s | {r['load_cold_nochecksum_ratio']:.2f}x | - | - |",
        f"| (b) save (blocking), throughput | {r['save_gbps']:.2f} GB/s ({r['sync_save_s']:.2f} s) | "
        f"write+fsync {r['raw_write_gbps']:.2f} GB/s ({r['raw_write_s']:.2f} s) | "
        f"{100 * r['save_fraction']:.0f}% | >= 70% | {yes[r['met']['save_fraction']]} |",
        f"| (c) caller blocked by save(blocking=False) | {1000 * r['async_block_s']:.0f} ms | "
        f"save(blocking=True) {r['sync_save_s']:.2f} s | {100 * r['async_block_fraction']:.1f}% | <= 5% | "
        f"{yes[r['met']['async_block_fraction']]} |",
    ]
    return "\n".join(lines)


def breakdown(r: dict) -> str:
    lp, sp = r["load_parts"], r["save_parts"]
    rest_cold = r["load_cold_s"] - lp.get("cold.checksums", 0) - lp.get("cold.read_data", 0)
    rest_sync = (r["sync_save_s"] - sp.get("sync.dcp_save", 0) - sp.get("sync.read_back_checksums", 0)
                 - sp.get("sync.commit", 0))
    first = r.get("first_async_block_s")
    return "\n".join([
        "| where the time goes | s |",
        "|---|---|",
        f"| load cold: checksum pass (sha256 of every file) | {lp.get('cold.checksums', float('nan')):.2f} |",
        f"| load cold: DCP read + copy into the model/optimizer | {lp.get('cold.read_data', float('nan')):.2f} |",
        f"| load cold: rest (state-dict helpers, planning, manifest) | {rest_cold:.2f} |",
        f"| load cold without checksums: DCP read + copy | "
        f"{lp.get('cold_nochecksum.read_data', float('nan')):.2f} |",
        f"| load warm: checksum pass / DCP read | {lp.get('warm.checksums', float('nan')):.2f} / "
        f"{lp.get('warm.read_data', float('nan')):.2f} |",
        f"| checksum pass alone, cold / warm | {r['checksum_cold_s']:.2f} / {r['checksum_warm_s']:.2f} |",
        f"| page cache after drop / after the checksum pass | {_mib(r['resident_after_drop'])} / "
        f"{_mib(r['resident_after_checksums'])} |",
        f"| save: dcp.save (serialise, write, fsync) | {sp.get('sync.dcp_save', float('nan')):.2f} |",
        f"| save: read back + sha256 of written files | {sp.get('sync.read_back_checksums', float('nan')):.2f} |",
        f"| save: commit (manifest, fsync, rename, latest, retention) | {sp.get('sync.commit', float('nan')):.2f} |",
        f"| save: of which fsync files + rename / manifest + latest / retention | "
        f"{sp.get('sync.commit_dir', float('nan')):.2f} / {sp.get('sync.manifest_and_latest', float('nan')):.2f} / "
        f"{sp.get('sync.retention', float('nan')):.2f} |",
        f"| save: rest (collect, thread, collectives) | {rest_sync:.2f} |",
        f"| async: collect / stage copy | {sp.get('async.collect', float('nan')):.3f} / "
        f"{sp.get('async.stage', float('nan')):.3f} |",
        f"| async: first call (allocates staging buffers) | {first if first is None else f'{first:.3f}'} |",
        f"| async: background write + commit | {r['async_write_s']:.2f} |",
        f"| train step alone / with the async write in flight | {r['step_s']:.2f} / {r['step_during_write_s']:.2f} |",
    ])


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28, help="blocks of the small preset (28: 0.99 GB of state)")
    ap.add_argument("--save-layout", default="tp=2")
    ap.add_argument("--load-layout", default="dp=1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", help="where to write (default: a temporary directory under /tmp, removed after)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error("--reps must be >= 2 (the first async save allocates buffers and is reported apart)")

    from parallel.layout import Layout
    from tests.multiproc import run_ranks

    load_avg = [os.getloadavg()[0]]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="elastron-ckpt-bench-"))
    root = str(work / "checkpoints")
    cfg = _cfg(args.layers)
    try:
        t0 = time.perf_counter()
        n = Layout.parse(args.save_layout).world_size
        saves = run_ranks(n, save_body, cfg, args.save_layout, root, args.reps, timeout=1200)
        print(f"save phase: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        t0 = time.perf_counter()
        n = Layout.parse(args.load_layout).world_size
        loads = run_ranks(n, load_body, cfg, args.load_layout, root, args.reps, timeout=1200)
        print(f"load phase: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    load_avg.append(os.getloadavg()[0])
    r = summarize(saves[0], loads[0], args, tuple(load_avg))
    print(table(r))
    print()
    print(breakdown(r))
    print()
    print(json.dumps(r, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
