"""Checkpoint save and load: Elastron against plain DCP and the raw disk, side by side in one run.

    .venv/bin/python benchmarks/checkpoint.py [--layers 28] [--save-layout tp=2] [--load-layout dp=2]
        [--reps 5] [--dir DIR] [--json out.json]
    # on a GPU machine: --preset 1b --layers 0 --save-layout dp=1 --load-layout dp=1 --device cuda

State: the `small` preset with `--layers` blocks (28: 82.9M parameters; fp32 weights + AdamW exp_avg and
exp_avg_sq = 0.99 GB), trained one step so the optimizer state exists. Three phases, each on spawned
gloo ranks (tests/multiproc.run_ranks, OMP_NUM_THREADS=1); every repetition runs the contenders in a
rotating order so drift on a shared box hits them alike; the table shows medians.

  1. save, on the ranks of `--save-layout`: Elastron `save(blocking=True)` (write, fsync, checksums,
     manifest, commit) | plain DCP `dcp.save(get_state_dict(...), FileSystemWriter)` of the same state |
     raw os.write + fsync of the bytes each rank writes in Elastron's save. Slowest rank counts.
  2. load, on the ranks of `--load-layout` (a resharding load): cold page cache before every load
     (fsync + POSIX_FADV_DONTNEED on every file of both checkpoints). Elastron `load_latest` (checks,
     verified read) | DCP `get_state_dict` + `dcp.load(FileSystemReader)` + `set_state_dict` | raw read
     of Elastron's files, shared out across the ranks. The first load of each into a fresh trainer
     (optimizer state created there) is reported apart. Both must end with the same values.
  3. async, one rank (the other core free): the trainer's async save (`save_checkpoint(blocking=False)`:
     staging overlapped with the next step) | `dcp.async_save` of the same state. Reported: what the
     save blocks the training thread (the call plus the optimizer step's wait for staging) against a
     blocking save, and the step time while the write is in flight against steps with nothing in flight.

Phase timings come from `CheckpointManager.save_timings` / `load_timings` (its public seam).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.page_cache import drop_cache, files, median, raw_read  # noqa: E402

_CHUNK = 16 << 20
TARGETS = {"save_fraction": 0.70, "save_vs_dcp": 2.0, "load_cold_ratio": 1.3, "load_vs_dcp": 1.0,
           "async_block_fraction": 0.02, "step_during_write_ratio": 1.15}


def _cfg(preset: str, layers: int, root: str | None) -> dict:
    model = {"preset": preset, **({"overrides": {"n_layers": layers}} if layers else {})}
    return {
        "model": model,
        "data": {"source": "synthetic", "seq_len": 32},
        "train": {"steps": 100_000, "global_batch_size": 2, "micro_batch_size": 1, "warmup_steps": 0},
        "checkpoint": {"interval_steps": 100_000, "keep_last": 2, "async_save": True,
                       **({"dir": root} if root else {})},
    }


def _raw_write(path: str, nbytes: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, left = memoryview(block), nbytes
        while left:
            left -= os.write(fd, view[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)


def _setup(cfg_dict: dict, layout: str, device: str, *, run_dir: str | None = None):
    import torch
    import torch.distributed as dist

    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.runtime import destroy_process_group, init_process_group
    from workers.trainer import Trainer

    if device == "cuda":  # run_ranks starts gloo only; the trainer on GPUs wants nccl beside it
        destroy_process_group()
        torch.cuda.set_device(dist.get_rank() if dist.is_initialized() else 0)
        init_process_group(torch.device("cuda"))
    cfg = JobConfig.from_dict(cfg_dict)
    return Trainer(cfg, layout=Layout.parse(layout), device=torch.device(device), run_dir=run_dir).build()


def _slowest(x: float) -> float:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return max(out)


def _timed(fn) -> float:
    import torch.distributed as dist

    os.sync()  # the previous contender's dirty pages are not this one's to write back
    dist.barrier()
    t = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - t)


def _dcp_state(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": msd, "optim": osd}


# -- phase 1: save ---------------------------------------------------------------------------------------

def save_body(cfg_dict: dict, layout: str, work: str, reps: int, device: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    trainer = _setup(cfg_dict, layout, device)
    trainer.train_step()  # creates the AdamW state
    rank, mgr = dist.get_rank(), trainer.checkpointer
    state = trainer.checkpoint_state()
    step = [10_000]
    dcp_dirs: list[str] = []
    dcp_count = itertools.count()

    def elastron() -> None:
        step[0] += 1
        mgr.save(step[0], trainer.model, trainer.optimizer, state=state, blocking=True)

    def plain_dcp() -> None:
        d = os.path.join(work, f"dcp-{next(dcp_count)}")
        dcp.save(_dcp_state(trainer), storage_writer=dcp.FileSystemWriter(d))
        dcp_dirs.append(d)

    elastron()  # warm-up (not counted): first-call costs; tells us how many bytes this rank writes
    plain_dcp()
    mine = mgr.save_timings.bytes
    block = os.urandom(_CHUNK)
    raw_path = os.path.join(work, f"raw-{rank}.bin")

    def raw() -> None:
        _raw_write(raw_path, mine, block)

    runs: dict[str, list[float]] = {"elastron": [], "dcp": [], "raw": []}
    parts: dict[str, list[float]] = {}
    order = list(runs)
    for i in range(reps):
        for name in order[i % 3:] + order[:i % 3]:
            runs[name].append(_timed({"elastron": elastron, "dcp": plain_dcp, "raw": raw}[name]))
            if name == "elastron":
                for k, v in mgr.save_timings.phases.items():
                    parts.setdefault(k, []).append(v)
            dist.barrier()
            if rank == 0:
                if os.path.exists(raw_path):
                    os.unlink(raw_path)
                while len(dcp_dirs) > 1:  # keep the newest DCP checkpoint for the load phase
                    shutil.rmtree(dcp_dirs.pop(0), ignore_errors=True)
            if rank != 0 and os.path.exists(raw_path):
                os.unlink(raw_path)
            dist.barrier()
    dcp_final = os.path.join(work, "dcp-final")
    if rank == 0:
        os.replace(dcp_dirs[-1], dcp_final)
    dist.barrier()
    ckpt = os.path.join(mgr.root, f"step-{step[0]:08d}")
    return {"rank": rank, "runs": runs, "parts": parts, "bytes": sum(map(os.path.getsize, files(ckpt))),
            "dcp_bytes": sum(map(os.path.getsize, files(dcp_final))), "files": len(files(ckpt)),
            "rank_bytes": mine, "ckpt": ckpt, "dcp_dir": dcp_final}


# -- phase 2: load ---------------------------------------------------------------------------------------

def load_body(cfg_dict: dict, layout: str, root: str, ckpt: str, dcp_dir: str, reps: int, device: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from parallel.checkpoint.manager import CheckpointManager

    ours = _setup(cfg_dict, layout, device)
    theirs = _setup(cfg_dict, layout, device)  # a second fresh trainer for DCP's first load
    rank, world = dist.get_rank(), dist.get_world_size()
    mgr = CheckpointManager(root, keep_last=2)
    expected = ours.expected_tensors()
    every = files(ckpt) + files(dcp_dir)
    my_share = files(ckpt)[rank::world]

    def elastron() -> None:
        m = mgr.load_latest(ours.model, ours.optimizer, expected=expected)
        if m is None or m.step < 10_000:
            raise RuntimeError(f"loaded {m and m.step} from {root}, expected the benchmark's checkpoint")

    def plain_dcp() -> None:
        sd = _dcp_state(theirs)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(dcp_dir))
        set_state_dict(theirs.model, theirs.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def raw() -> None:
        raw_read(my_share)

    fns = {"elastron": elastron, "dcp": plain_dcp, "raw": raw}

    def cold(name: str) -> float:
        if rank == 0:
            drop_cache(every)
        dist.barrier()
        return _timed(fns[name])

    first = {"elastron": cold("elastron"), "dcp": cold("dcp")}
    first_parts = dict(mgr.load_timings.phases)
    runs: dict[str, list[float]] = {"elastron": [], "dcp": [], "raw": []}
    parts: dict[str, list[float]] = {}
    order = list(runs)
    for i in range(reps):
        for name in order[i % 3:] + order[:i % 3]:
            runs[name].append(cold(name))
            if name == "elastron":
                for k, v in mgr.load_timings.phases.items():
                    parts.setdefault(k, []).append(v)
    # Both loaders must have put the same values into the same layout.
    a = [t.detach() for t in ours.model.state_dict().values()]
    b = [t.detach() for t in theirs.model.state_dict().values()]
    same = all(torch.equal(x.full_tensor() if hasattr(x, "full_tensor") else x,
                           y.full_tensor() if hasattr(y, "full_tensor") else y) for x, y in zip(a, b))
    return {"rank": rank, "runs": runs, "parts": parts, "first": first, "first_parts": first_parts,
            "bytes_read": mgr.load_timings.bytes, "same_values": _slowest(0.0 if same else 1.0) == 0.0}


# -- phase 3: async saves while training (one rank) ------------------------------------------------------

def async_body(cfg_dict: dict, work: str, reps: int, device: str) -> dict:
    import torch.distributed.checkpoint as dcp

    trainer = _setup(cfg_dict, "dp=1", device, run_dir=work)
    for _ in range(2):
        trainer.train_step()  # warm-up; creates the AdamW state
    mgr = trainer.checkpointer

    def steps(n: int) -> list[float]:
        return [trainer.train_step().step_time for _ in range(n)]

    def elastron() -> tuple[float, list[float]]:
        wait0 = mgr.stage_wait_s
        t = time.perf_counter()
        trainer.save_checkpoint(blocking=False)
        blocked = time.perf_counter() - t
        during = []
        while mgr.in_flight:
            during.append(trainer.train_step().step_time)
        mgr.flush()
        return blocked + mgr.stage_wait_s - wait0, during

    def plain_dcp(i: int) -> tuple[float, list[float]]:
        t = time.perf_counter()
        fut = dcp.async_save(_dcp_state(trainer), storage_writer=dcp.FileSystemWriter(os.path.join(work, f"dcp-a{i}")))
        blocked = time.perf_counter() - t
        during = []
        while not fut.done():
            during.append(trainer.train_step().step_time)
        fut.result()
        shutil.rmtree(os.path.join(work, f"dcp-a{i}"), ignore_errors=True)
        return blocked, during

    elastron()  # warm-up: allocates the staging pool
    plain_dcp(-1)
    out: dict[str, list[float]] = {k: [] for k in (
        "normal_step", "blocking_save", "elastron_blocked", "elastron_step_during", "dcp_blocked", "dcp_step_during")}
    for i in range(reps):
        out["normal_step"] += steps(3)
        t = time.perf_counter()
        trainer.save_checkpoint(blocking=True)
        out["blocking_save"].append(time.perf_counter() - t)
        for name in (("elastron", "dcp") if i % 2 == 0 else ("dcp", "elastron")):
            blocked, during = elastron() if name == "elastron" else plain_dcp(i)
            out[f"{name}_blocked"].append(blocked)
            out[f"{name}_step_during"] += during
        out["normal_step"] += steps(3)
    return out


# -- report ----------------------------------------------------------------------------------------------

def summarize(save: dict, load: dict, asy: dict, args: argparse.Namespace, load_avg: tuple) -> dict:
    s = {k: median(v) for k, v in save["runs"].items()}
    ld = {k: median(v) for k, v in load["runs"].items()}
    a = {k: median(v) for k, v in asy.items()}
    r = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, device {args.device}",
        "preset": args.preset, "layers": args.layers, "state_bytes": save["bytes"], "dcp_bytes": save["dcp_bytes"],
        "files": save["files"], "save_layout": args.save_layout, "load_layout": args.load_layout, "reps": args.reps,
        "save_s": s["elastron"], "dcp_save_s": s["dcp"], "raw_write_s": s["raw"],
        "load_s": ld["elastron"], "dcp_load_s": ld["dcp"], "raw_read_s": ld["raw"],
        "first_load_s": load["first"]["elastron"], "dcp_first_load_s": load["first"]["dcp"],
        "bytes_read_rank0": load["bytes_read"], "same_values": load["same_values"],
        "save_parts": {k: median(v) for k, v in save["parts"].items()},
        "load_parts": {k: median(v) for k, v in load["parts"].items()},
        "first_load_parts": load["first_parts"],
        **{f"async_{k}": v for k, v in a.items()}, "async_samples": {k: len(v) for k, v in asy.items()},
        "load_avg_start_end": load_avg, "raw": {"save": save["runs"], "load": load["runs"], "async": asy},
    }
    r["save_fraction"] = r["raw_write_s"] / r["save_s"]
    r["save_vs_dcp"] = r["dcp_save_s"] / r["save_s"]
    r["load_cold_ratio"] = r["load_s"] / r["raw_read_s"]
    r["load_vs_dcp"] = r["dcp_load_s"] / r["load_s"]
    r["async_block_fraction"] = a["elastron_blocked"] / a["blocking_save"]
    r["dcp_async_block_fraction"] = a["dcp_blocked"] / a["blocking_save"]
    r["step_during_write_ratio"] = a["elastron_step_during"] / a["normal_step"]
    r["dcp_step_during_write_ratio"] = a["dcp_step_during"] / a["normal_step"]
    met = {
        "save_fraction": r["save_fraction"] >= TARGETS["save_fraction"],
        "save_vs_dcp": r["save_vs_dcp"] >= TARGETS["save_vs_dcp"],
        "load_cold_ratio": r["load_cold_ratio"] <= TARGETS["load_cold_ratio"],
        "load_vs_dcp": r["load_vs_dcp"] > TARGETS["load_vs_dcp"],
        "async_block_fraction": r["async_block_fraction"] <= TARGETS["async_block_fraction"],
        "step_during_write_ratio": r["step_during_write_ratio"] <= TARGETS["step_during_write_ratio"],
    }
    r["met"] = {k: None if math.isnan(r[k]) else ok for k, ok in met.items()}  # None: not run (--skip-async)
    return r


def table(r: dict) -> str:
    yes = {True: "yes", False: "**no**", None: "not run"}
    gb = r["state_bytes"] / 1e9
    m = r["met"]
    return "\n".join([
        f"State: {gb:.2f} GB ({r['preset']}, {r['layers'] or 'preset'} layers, fp32 weights + AdamW), "
        f"{r['files']} files; saved under {r['save_layout']}, loaded under {r['load_layout']}; medians of "
        f"{r['reps']} interleaved runs; 1-min load average {r['load_avg_start_end'][0]:.1f} -> "
        f"{r['load_avg_start_end'][1]:.1f}. Loads are cold (page cache dropped before each).",
        "",
        "| measurement | Elastron | plain DCP | raw disk | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
        f"| save (blocking) | {r['save_s']:.2f} s ({gb / r['save_s']:.2f} GB/s) | {r['dcp_save_s']:.2f} s | "
        f"write+fsync {r['raw_write_s']:.2f} s | {100 * r['save_fraction']:.0f}% of raw | >= 70% | "
        f"{yes[m['save_fraction']]} |",
        f"| save vs DCP | | | | {r['save_vs_dcp']:.2f}x faster | >= 2x | {yes[m['save_vs_dcp']]} |",
        f"| load, cold | {r['load_s']:.2f} s | {r['dcp_load_s']:.2f} s | read {r['raw_read_s']:.2f} s | "
        f"{r['load_cold_ratio']:.2f}x raw | <= 1.3x | {yes[m['load_cold_ratio']]} |",
        f"| load vs DCP | | | | {r['load_vs_dcp']:.2f}x faster | > 1x | {yes[m['load_vs_dcp']]} |",
        f"| first load into a fresh trainer, cold | {r['first_load_s']:.2f} s | {r['dcp_first_load_s']:.2f} s | "
        f"read {r['raw_read_s']:.2f} s | {r['first_load_s'] / r['raw_read_s']:.2f}x raw | - | - |",
        f"| async: training blocked per save (1 rank) | {1000 * r['async_elastron_blocked']:.0f} ms | "
        f"`dcp.async_save` {1000 * r['async_dcp_blocked']:.0f} ms | | {100 * r['async_block_fraction']:.1f}% "
        f"of a blocking save ({r['async_blocking_save']:.2f} s); DCP {100 * r['dcp_async_block_fraction']:.0f}% "
        f"| <= 2% | {yes[m['async_block_fraction']]} |",
        f"| async: step while the write is in flight (1 rank) | {r['async_elastron_step_during']:.3f} s | "
        f"{r['async_dcp_step_during']:.3f} s | normal step {r['async_normal_step']:.3f} s | "
        f"{r['step_during_write_ratio']:.2f}x (DCP {r['dcp_step_during_write_ratio']:.2f}x) | <= 1.15x | "
        f"{yes[m['step_during_write_ratio']]} |",
        "",
        f"Same values loaded by Elastron and DCP: {r['same_values']}. Bytes read by rank 0: "
        f"{r['bytes_read_rank0'] / 1e9:.2f} GB of {gb:.2f} GB.",
        "Save phases (rank 0, s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["save_parts"].items()),
        "Load phases (rank 0, s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["load_parts"].items())
        + "; first load: " + ", ".join(f"{k} {v:.2f}" for k, v in r["first_load_parts"].items()),
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=28, help="blocks of the preset (0: the preset's own)")
    ap.add_argument("--save-layout", default="tp=2")
    ap.add_argument("--load-layout", default="dp=2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--skip-async", action="store_true", help="phases 1 and 2 only")
    ap.add_argument("--dir", help="where to write (default: a temporary directory under /tmp, removed after)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")

    from parallel.layout import Layout
    from tests.multiproc import run_ranks

    load_avg = [os.getloadavg()[0]]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="elastron-ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    root = str(work / "checkpoints")
    try:
        t0 = time.perf_counter()
        n = Layout.parse(args.save_layout).world_size
        saves = run_ranks(n, save_body, _cfg(args.preset, args.layers, root), args.save_layout, str(work),
                          args.reps, args.device, timeout=3600, spawn=True)
        print(f"save phase: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        t0 = time.perf_counter()
        n = Layout.parse(args.load_layout).world_size
        loads = run_ranks(n, load_body, _cfg(args.preset, args.layers, None), args.load_layout, root,
                          saves[0]["ckpt"], saves[0]["dcp_dir"], args.reps, args.device, timeout=3600, spawn=True)
        print(f"load phase: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(saves[0]["dcp_dir"], ignore_errors=True)
        asy = {k: [float("nan")] for k in ("normal_step", "blocking_save", "elastron_blocked",
                                           "elastron_step_during", "dcp_blocked", "dcp_step_during")}
        if not args.skip_async:
            t0 = time.perf_counter()
            (asy,) = run_ranks(1, async_body, _cfg(args.preset, args.layers, None), str(work / "async"),
                               args.reps, args.device, timeout=3600, spawn=True)
            print(f"async phase: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    load_avg.append(os.getloadavg()[0])
    r = summarize(saves[0], loads[0], asy, args, tuple(load_avg))
    print(table(r))
    print(json.dumps(r, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
