"""Starting and restarting at size: what a fresh build, a resume, the first save and the first step cost.

    .venv/bin/python benchmarks/startup.py [--preset small] [--layers 28] [--reps 3] [--compile no,yes]
        [--dir DIR] [--json out.json]
    # on a GPU machine: --device cuda --preset 1b --layers 0

One rank, each part in a fresh process (tests/multiproc.run_ranks), as a restarted or new worker is:

  0. async: a fresh process's async saves (call until committed), the first against the steady ones.
  1. fresh: `Trainer.build()` with nothing to resume (phases from `Trainer.build_times`), the first and
     second training steps, then blocking saves: the first of the process against the steady ones.
  3. resume, every repetition: the checkpoint's files are dropped from the page cache, then a fresh
     process builds a trainer that resumes from it; against a raw cold read of the same files (dropped
     again) in the parent, in rotating order. "restart to first step" adds the first training step. The
     same again in a process that first ran `workers.warmup.warm_up` (untimed), as a standby worker has.
  4. with --compile yes: the same restart with train.compile, into an empty compile cache (the first
     worker of a job on a node) and again into the cache the first one filled (a restarted rank).

State: the `small` preset with `--layers` blocks (28: 82.8M parameters, fp32 weights + AdamW moments =
0.99 GB). Medians over the repetitions.
"""

from __future__ import annotations

import argparse
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

TARGETS = {"resume_minus_cold_read_s": 0.5, "first_save_ratio": 1.25}
"""CPU, one rank, ~1 GB: resume <= cold read + 0.5 s; first save <= 1.25x a steady save."""


def _cfg(preset: str, layers: int, *, async_save: bool = False, compile: bool = False) -> dict:
    model = {"preset": preset, **({"overrides": {"n_layers": layers}} if layers else {})}
    return {
        "name": "startup-bench",
        "model": model,
        "data": {"source": "synthetic", "seq_len": 32},
        "train": {"steps": 100_000, "global_batch_size": 2, "micro_batch_size": 1, "warmup_steps": 0,
                  "compile": compile},
        "checkpoint": {"interval_steps": 100_000, "keep_last": 1, "async_save": async_save},
    }


def _newest(root: str) -> str:
    return str(sorted(Path(root).glob("step-*"))[-1])


def _trainer(cfg_dict: dict, run_dir: str, device: str):
    """A trainer for one rank, not yet built."""
    import torch
    import torch.distributed as dist

    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.runtime import destroy_process_group, init_process_group
    from workers.trainer import Trainer

    if device == "cuda":  # run_ranks starts gloo only; the trainer on GPUs wants nccl beside it
        destroy_process_group()
        torch.cuda.set_device(0)
        init_process_group(torch.device("cuda"))
    assert dist.get_world_size() == 1
    return Trainer(JobConfig.from_dict(cfg_dict), layout=Layout.parse("dp=1"), device=torch.device(device),
                   run_dir=run_dir)


def _cuda_context(device: str) -> float:
    """Create the process's CUDA context now (seconds it took): the build target counts from after it,
    and a standby worker has created it while it waited."""
    if device != "cuda":
        return 0.0
    import torch

    t = time.perf_counter()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def fresh_body(cfg_dict: dict, run_dir: str, device: str, saves: int) -> dict:
    """Build with nothing to resume, two steps, then `saves` blocking saves with a step before each."""
    tr = _trainer(cfg_dict, run_dir, device)
    context_s = _cuda_context(device)
    t = time.perf_counter()
    tr.build()
    _sync(device)
    out = {"build_s": time.perf_counter() - t, "build": dict(tr.build_times), "init_elements": tr.init_elements,
           "cuda_context_s": context_s}
    for name in ("first_step_s", "second_step_s"):
        tr.phase_times = {}
        t = time.perf_counter()
        tr.train_step()
        _sync(device)
        out[name] = time.perf_counter() - t
        out[name.removesuffix("_s") + "_phases"], tr.phase_times = tr.phase_times, None
    out["saves"], out["save_phases"] = [], []
    for _ in range(saves):
        tr.train_step()
        os.sync()  # the previous save's dirty pages are not this one's to write back
        t = time.perf_counter()
        tr.save_checkpoint(blocking=True)
        out["saves"].append(time.perf_counter() - t)
        out["save_phases"].append(dict(tr.checkpointer.save_timings.phases))
    out["bytes"] = tr.checkpointer.save_timings.bytes if saves else None
    tr.close()
    return out


def imports_body(device: str) -> dict:
    """What a fresh process's first build imports that it cannot defer: the seconds of `import
    torch._dynamo` (torch.optim's constructor imports it through `torch._disable_dynamo`) after the CUDA
    context exists, in a process that has imported only what a worker imports before its build."""
    import workers.trainer  # noqa: F401  (what a worker has imported before it builds)

    context_s = _cuda_context(device)
    already = "torch._dynamo" in sys.modules
    t = time.perf_counter()
    import torch._dynamo  # noqa: F401

    return {"dynamo_import_s": time.perf_counter() - t, "dynamo_already_imported": already,
            "cuda_context_s": context_s}


def async_body(cfg_dict: dict, run_dir: str, device: str, saves: int) -> dict:
    """Async saves from a fresh process: per save, what the call blocks and the time until committed."""
    tr = _trainer(cfg_dict, run_dir, device)
    tr.build()
    blocked, total, phases = [], [], []
    for _ in range(saves):
        tr.train_step()
        os.sync()
        t = time.perf_counter()
        tr.save_checkpoint(blocking=False)
        blocked.append(time.perf_counter() - t)
        tr.flush_checkpoint()
        total.append(time.perf_counter() - t)
        phases.append(dict(tr.checkpointer.save_timings.phases))
    tr.close()
    return {"blocked": blocked, "total": total, "phases": phases}


def _warm(device: str) -> float:
    """Run `workers.warmup.warm_up` as a standby worker does while it waits (before it has a rank), then
    join the one-rank group again; returns the warm-up's seconds."""
    import torch
    import torch.distributed as dist

    from workers.runtime import destroy_process_group, init_process_group
    from workers.warmup import warm_up

    destroy_process_group()
    t = time.perf_counter()
    warm_up(device)
    warm_s = time.perf_counter() - t
    init_process_group(torch.device("cpu"))  # run_ranks' rendezvous variables are still set
    assert dist.get_world_size() == 1
    return warm_s


def standby_build_body(cfg_dict: dict, run_dir: str, device: str) -> dict:
    """A fresh build (nothing to resume) in a process that ran `warm_up` first: a standby worker that
    becomes a new job's rank."""
    warm_s = _warm(device)
    tr = _trainer(cfg_dict, run_dir, device)
    t = time.perf_counter()
    tr.build()
    _sync(device)
    out = {"build_s": time.perf_counter() - t, "build": dict(tr.build_times), "warm_up_s": warm_s}
    tr.close()
    return out


def resume_body(cfg_dict: dict, run_dir: str, device: str, warm: bool = False, no_read_ahead: bool = False) -> dict:
    """A restarted rank: build (resuming from the newest checkpoint), then the first step. `warm`: the
    process first runs `workers.warmup.warm_up` (untimed), as a standby worker does while it waits.
    `no_read_ahead`: without reading the checkpoint ahead beside the build (the comparison row)."""
    warm_s = _warm(device) if warm else None
    tr = _trainer(cfg_dict, run_dir, device)
    if no_read_ahead:
        tr._prefetch = lambda: None
    t0 = time.perf_counter()
    tr.build()
    _sync(device)
    t1 = time.perf_counter()
    tr.phase_times = {}  # where a first step's time goes (each phase ends with a device sync on CUDA)
    tr.train_step()
    _sync(device)
    t2 = time.perf_counter()
    out = {"build_s": t1 - t0, "first_step_s": t2 - t1, "to_first_step_s": t2 - t0, "build": dict(tr.build_times),
           "first_step_phases": tr.phase_times,
           "load": dict(tr.checkpointer.load_timings.phases), "resumed_from": tr.resumed_from.step,
           "prefetched_bytes": tr.prefetched_bytes,
           "init_elements": tr.init_elements, "warm_up_s": warm_s}
    tr.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=28, help="blocks of the preset (0: the preset's own)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--saves", type=int, default=4, help="blocking saves in the fresh process (first + steady)")
    ap.add_argument("--compile", default="no", help="no | yes | no,yes: restart rows with train.compile")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dir", help="where to write (default: a temporary directory under /tmp, removed after)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--project-only", action="store_true", help="print the 8B/70B projection table and stop")
    ap.add_argument("--no-async", action="store_true", help="leave out the async-save rows (saves minutes at 1b)")
    ap.add_argument("--build-only", action="store_true",
                    help="only the fresh builds: a fresh process's, a standby worker's, and the imports a fresh "
                         "process pays in its build (no checkpoint written)")
    ap.add_argument("--ab-read-ahead", action="store_true",
                    help="also resume without the read-ahead beside the build, in the same rotation")
    args = ap.parse_args(argv)
    if args.project_only:
        print(projection_table(projection()))
        return 0
    compiles = [c.strip() == "yes" for c in args.compile.split(",") if c.strip()]

    from tests.multiproc import run_ranks

    load_avg = [os.getloadavg()[0]]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="elastron-startup-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = str(work / "run")
    res: dict = {"args": vars(args)}
    try:
        cfg = _cfg(args.preset, args.layers)
        if args.build_only:
            return _build_only(args, cfg, run_dir, work)
        # Async first, in a directory of its own removed after: one checkpoint (plus the one being
        # written) on the disk at a time, which a 1b state on a lent machine's disk needs.
        if not args.no_async:
            (res["async"],) = run_ranks(1, async_body, _cfg(args.preset, args.layers, async_save=True),
                                        str(work / "async"), args.device, 3, timeout=3600, spawn=True)
            shutil.rmtree(work / "async", ignore_errors=True)
            print(f"async: to commit {res['async']['total']}", file=sys.stderr)
        (res["fresh"],) = run_ranks(1, fresh_body, cfg, run_dir, args.device, args.saves, timeout=3600, spawn=True)
        print(f"fresh: build {res['fresh']['build_s']:.2f} s, saves {res['fresh']['saves']}", file=sys.stderr)
        (res["standby_build"],) = run_ranks(1, standby_build_body, cfg, str(work / "standby"), args.device,
                                            timeout=3600, spawn=True)
        shutil.rmtree(work / "standby", ignore_errors=True)
        ckpt = _newest(str(Path(run_dir) / "checkpoints"))
        ckpt_files = files(ckpt)
        res["ckpt_bytes"] = sum(os.path.getsize(f) for f in ckpt_files)
        res["resume"], res["resume_warm"], res["raw_read"], res["resume_no_read_ahead"] = [], [], [], []
        for rep in range(args.reps):
            order = ("raw", "resume", "resume_warm") + (("resume_no_read_ahead",) if args.ab_read_ahead else ())
            k = rep % len(order)
            for what in order[k:] + order[:k]:
                os.sync()
                drop_cache(ckpt_files)
                if what == "raw":
                    t = time.perf_counter()
                    raw_read(ckpt_files)
                    res["raw_read"].append(time.perf_counter() - t)
                else:
                    (r,) = run_ranks(1, resume_body, cfg, run_dir, args.device, what == "resume_warm",
                                     what == "resume_no_read_ahead", timeout=3600, spawn=True)
                    res[what].append(r)
            print(f"rep {rep}: raw {res['raw_read'][-1]:.2f} s, resume build {res['resume'][-1]['build_s']:.2f} s, "
                  f"after a warm-up {res['resume_warm'][-1]['build_s']:.2f} s", file=sys.stderr)
        res["compile"] = {}
        for c in compiles:
            if not c:
                continue
            os.environ["ELASTRON_COMPILE_CACHE"] = str(work / "compile-cache")  # empty: the job's first worker
            rows = {}
            for kind in ("cold cache", "warm cache"):
                drop_cache(ckpt_files)
                (rows[kind],) = run_ranks(1, resume_body, _cfg(args.preset, args.layers, compile=True), run_dir,
                                          args.device, timeout=3600, spawn=True)
                print(f"compile, {kind}: to first step {rows[kind]['to_first_step_s']:.1f} s", file=sys.stderr)
            res["compile"] = rows
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    load_avg.append(os.getloadavg()[0])
    res["load_avg"] = load_avg
    s = summarize(res)
    print(table(s))
    s["projection"] = projection(s)
    print(projection_table(s["projection"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "raw": res}, indent=1, default=str) + "\n")
    return 0


def _build_only(args, cfg: dict, run_dir: str, work: Path) -> int:
    """`--build-only`: a fresh process's build (and its first two steps), a standby worker's build, and
    `import torch._dynamo` timed alone in a fresh process: one table and the JSON."""
    from tests.multiproc import run_ranks

    builds = []
    for _ in range(args.reps):
        (r,) = run_ranks(1, fresh_body, cfg, run_dir, args.device, 0, timeout=3600, spawn=True)
        builds.append(r)
        shutil.rmtree(run_dir, ignore_errors=True)
    (standby,) = run_ranks(1, standby_build_body, cfg, str(work / "standby"), args.device, timeout=3600, spawn=True)
    imports = [run_ranks(1, imports_body, args.device, timeout=600, spawn=True)[0] for _ in range(args.reps)]
    fresh_s = median([b["build_s"] for b in builds])
    s = {"fresh_build_s": round(fresh_s, 3), "fresh_build_phases": _phase_medians([b["build"] for b in builds]),
         "fresh_builds_s": [round(b["build_s"], 3) for b in builds],
         "first_step_s": round(median([b["first_step_s"] for b in builds]), 3),
         "standby_build_s": round(standby["build_s"], 3),
         "standby_build_phases": {k: round(v, 3) for k, v in standby["build"].items()},
         "dynamo_import_s": round(median([i["dynamo_import_s"] for i in imports]), 3),
         "dynamo_imported_before_build": any(i["dynamo_already_imported"] for i in imports),
         "cuda_context_s": round(median([b["cuda_context_s"] for b in builds]), 3)}
    s["fresh_build_without_dynamo_import_s"] = round(fresh_s - s["dynamo_import_s"], 3)
    print("| measurement | seconds |\n|---|---|")
    print(f"| fresh build, fresh process (median of {args.reps}: {s['fresh_builds_s']}) | {s['fresh_build_s']} "
          f"({', '.join(f'{k} {v}' for k, v in s['fresh_build_phases'].items() if v >= 0.01)}) |")
    print(f"| of which the process's first `import torch._dynamo` (timed alone in a fresh process) | "
          f"{s['dynamo_import_s']} |")
    print(f"| fresh build less that import | {s['fresh_build_without_dynamo_import_s']} |")
    print(f"| fresh build in a standby worker (after `warm_up`) | {s['standby_build_s']} |")
    print(f"| first step after a fresh build | {s['first_step_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "raw": {"builds": builds, "standby": standby,
                                                                     "imports": imports}}, indent=1, default=str) + "\n")
    return 0


def _phase_medians(rows: list[dict]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {k: round(median([r.get(k, 0.0) for r in rows]), 3) for k in sorted(keys)}


def summarize(res: dict) -> dict:
    f, a = res["fresh"], res.get("async")
    steady_save = median(f["saves"][1:])
    resume = res["resume"]
    s = {
        "state_gb": round(f["bytes"] / 1e9, 3), "ckpt_gb": round(res["ckpt_bytes"] / 1e9, 3),
        "fresh_build_s": round(f["build_s"], 3), "fresh_build_phases": {k: round(v, 3) for k, v in f["build"].items()},
        "init_values": f["init_elements"], "cuda_context_s": round(f.get("cuda_context_s", 0.0), 3),
        "standby_build_s": round(res["standby_build"]["build_s"], 3),
        "standby_build_phases": {k: round(v, 3) for k, v in res["standby_build"]["build"].items()},
        "first_step_s": round(f["first_step_s"], 3), "second_step_s": round(f["second_step_s"], 3),
        "first_step_phases": _phase_medians([f.get("first_step_phases", {})]),
        "first_save_s": round(f["saves"][0], 3), "steady_save_s": round(steady_save, 3),
        "first_save_ratio": round(f["saves"][0] / steady_save, 3),
        "first_save_phases": {k: round(v, 3) for k, v in f["save_phases"][0].items()},
        "steady_save_phases": _phase_medians(f["save_phases"][1:]),
        "cold_read_s": round(median(res["raw_read"]), 3),
        "resume_build_s": round(median([r["build_s"] for r in resume]), 3),
        "resume_phases": _phase_medians([r["build"] for r in resume]),
        "resume_load_phases": _phase_medians([r["load"] for r in resume]),
        "resume_init_values": max(r["init_elements"] for r in resume),
        "resume_prefetched_gb": round(median([r.get("prefetched_bytes", 0) for r in resume]) / 1e9, 3),
        "warm_resume_prefetched_gb": round(median([r.get("prefetched_bytes", 0) for r in res["resume_warm"]]) / 1e9, 3),
        "restart_to_first_step_s": round(median([r["to_first_step_s"] for r in resume]), 3),
        "restart_first_step_phases": _phase_medians([r.get("first_step_phases", {}) for r in resume]),
        "warm_resume_build_s": round(median([r["build_s"] for r in res["resume_warm"]]), 3),
        "warm_resume_phases": _phase_medians([r["build"] for r in res["resume_warm"]]),
        "warm_restart_to_first_step_s": round(median([r["to_first_step_s"] for r in res["resume_warm"]]), 3),
        "warm_up_s": round(median([r["warm_up_s"] for r in res["resume_warm"]]), 3),
        "load_avg": res["load_avg"],
    }
    if a is not None:
        steady_async = median(a["total"][1:])
        s.update({"first_async_save_s": round(a["total"][0], 3), "steady_async_save_s": round(steady_async, 3),
                  "first_async_ratio": round(a["total"][0] / steady_async, 3),
                  "async_blocked_s": [round(x, 3) for x in a["blocked"]]})
    if res.get("resume_no_read_ahead"):
        s["resume_no_read_ahead_build_s"] = round(median([r["build_s"] for r in res["resume_no_read_ahead"]]), 3)
        s["resume_no_read_ahead_phases"] = _phase_medians([r["build"] for r in res["resume_no_read_ahead"]])
    s["resume_minus_cold_read_s"] = round(s["resume_build_s"] - s["cold_read_s"], 3)
    s["warm_resume_minus_cold_read_s"] = round(s["warm_resume_build_s"] - s["cold_read_s"], 3)
    for kind, r in res.get("compile", {}).items():
        s[f"compile_{kind.split()[0]}_to_first_step_s"] = round(r["to_first_step_s"], 3)
        s[f"compile_{kind.split()[0]}_first_step_s"] = round(r["first_step_s"], 3)
    s["targets"] = {
        "resume <= cold read + 0.5 s": s["resume_minus_cold_read_s"] <= TARGETS["resume_minus_cold_read_s"],
        "resume after a warm-up <= cold read + 0.5 s":
            s["warm_resume_minus_cold_read_s"] <= TARGETS["resume_minus_cold_read_s"],
        "first save <= 1.25x steady": s["first_save_ratio"] <= TARGETS["first_save_ratio"],
    }
    return s


H200 = {"host_randn_values_per_s": 1.1e9 / 5.8, "cold_read_bytes_per_s": 13.2e9 / 8.8,
        "pin_s_per_byte": 6.5 / 13.2e9}
"""Rates measured on the lent H200 machine with the `1b` state (docs/benchmarks.md, FACTS.md): the old
host `torch.randn` of every full tensor, a raw cold read of one rank's checkpoint files, and allocating +
pinning the staging pool at the first save."""

LAYOUTS = {
    "8B (Llama-3-8B), 8 ranks: dp_shard=8": (
        dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336), "dp_shard=8"),
    "70B (Llama-3-70B), 64 ranks: tp=8, dp_shard=8": (
        dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_hidden=28672),
        "dp_shard=8,tp=8"),
}


def projection(s: dict | None = None, ranks_per_node: int = 8) -> list[dict]:
    """Per-rank init values, bytes read and staged, and times from measured rates, for the big layouts:
    a projection (nothing here ran at that size). Rank 0's shard; 12 bytes of state per parameter (fp32
    weights and two AdamW moments); a node's ranks share its disk."""
    from models.config import ModelConfig
    from models.llama import build_model
    from parallel.layout import Layout
    from parallel.sharding import param_box

    rows = []
    for label, (dims, layout) in LAYOUTS.items():
        cfg, lay = ModelConfig(**dims, max_seq_len=8192), Layout.parse(layout)
        shapes = {n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()}
        before = now = shard = 0
        for name, shape in shapes.items():
            box = param_box(name, shape, lay, 0, cfg.n_layers)
            if box is None:
                continue
            if not name.endswith("norm.weight"):  # norms are ones: nothing drawn, then or now
                before += math.prod(shape)  # the old init: the whole tensor of every parameter it holds
                now += box.numel  # exactly its own box (models.init)
            shard += box.numel
        state = 12 * shard
        node_ranks = min(ranks_per_node, lay.world_size)
        row = {"layout": label, "values_before": before, "values_now": now, "state_bytes": state,
               "old_init_s_h200_host": before / H200["host_randn_values_per_s"],
               "read_s_h200_disk": state * node_ranks / H200["cold_read_bytes_per_s"],
               "first_save_pin_s_before": state * H200["pin_s_per_byte"]}
        if s is not None and s.get("fresh_build_phases", {}).get("init"):
            row["init_now_s_at_cpu_rate"] = now / (s["init_values"] / s["fresh_build_phases"]["init"])
        rows.append(row)
    return rows


def projection_table(rows: list[dict]) -> str:
    out = ["| layout (projection) | values drawn per rank, before | now | state per rank (read on resume, staged per save) "
           "| old host init at the H200 host rate | resume read, a node's 8 ranks on one disk at the H200 rate "
           "| first-save pinning before (now in the background) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['layout']} | {r['values_before'] / 1e9:.2f} G | {r['values_now'] / 1e9:.2f} G | "
                   f"{r['state_bytes'] / 1e9:.1f} GB | {r['old_init_s_h200_host']:.0f} s | {r['read_s_h200_disk']:.0f} s | "
                   f"{r['first_save_pin_s_before']:.1f} s |")
    return "\n".join(out)


def _phases(p: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in p.items())


def table(s: dict) -> str:
    rows = [
        ("fresh build", f"{s['fresh_build_s']:.2f} s", _phases(s["fresh_build_phases"])
         + (f" (after a CUDA context made in {s['cuda_context_s']:.2f} s)" if s["cuda_context_s"] else "")),
        ("fresh build after warm_up (standby)", f"{s['standby_build_s']:.2f} s", _phases(s["standby_build_phases"])),
        ("first step / second step", f"{s['first_step_s']:.2f} / {s['second_step_s']:.2f} s",
         _phases(s.get("first_step_phases", {}))),
        ("resume (build, cold cache)", f"{s['resume_build_s']:.2f} s", _phases(s["resume_phases"])),
        ("  its load", f"{s['resume_load_phases'].get('read', 0.0):.2f} s read",
         ", ".join(f"{k.removeprefix('read.').removesuffix(' (thread-s)')} {v:.2f}" for k, v in s["resume_load_phases"].items()
                   if k.startswith("read."))
         + f" (thread-s); {s['resume_prefetched_gb']:.2f} GB read ahead beside the build"),
        *([("resume without the read-ahead", f"{s['resume_no_read_ahead_build_s']:.2f} s",
            _phases(s["resume_no_read_ahead_phases"]))] if "resume_no_read_ahead_build_s" in s else []),
        ("raw cold read of the same files", f"{s['cold_read_s']:.2f} s", f"{s['ckpt_gb']:.2f} GB"),
        ("resume - cold read", f"{s['resume_minus_cold_read_s']:+.2f} s", "target <= +0.5 s"),
        ("restart to first step", f"{s['restart_to_first_step_s']:.2f} s",
         "first step: " + _phases(s.get("restart_first_step_phases", {}))),
        ("resume after warm_up (standby)", f"{s['warm_resume_build_s']:.2f} s", _phases(s["warm_resume_phases"])),
        ("  - cold read", f"{s['warm_resume_minus_cold_read_s']:+.2f} s", f"warm-up itself {s['warm_up_s']:.2f} s"),
        ("  restart to first step", f"{s['warm_restart_to_first_step_s']:.2f} s", ""),
        ("first blocking save / steady", f"{s['first_save_s']:.2f} / {s['steady_save_s']:.2f} s",
         f"{s['first_save_ratio']:.2f}x (target <= 1.25x)"),
    ]
    if "first_async_save_s" in s:
        rows.append(("first async save / steady (to commit)",
                     f"{s['first_async_save_s']:.2f} / {s['steady_async_save_s']:.2f} s", f"{s['first_async_ratio']:.2f}x"))
    for k in ("cold", "warm"):
        if f"compile_{k}_to_first_step_s" in s:
            rows.append((f"restart to first step, compile, {k} cache", f"{s[f'compile_{k}_to_first_step_s']:.2f} s",
                         f"first step {s[f'compile_{k}_first_step_s']:.2f} s"))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b:>16}  {c}" for a, b, c in rows)


if __name__ == "__main__":
    raise SystemExit(main())
