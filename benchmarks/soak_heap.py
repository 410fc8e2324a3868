"""Where a survivor's memory goes between reconfigurations (soak.py's helper): two forked ranks drive
`workers.actor.Worker` directly through N reconfigurations, no Ray.

    .venv/bin/python benchmarks/soak_heap.py --reconfigs 16 [--preset small] \
        [--json benchmarks/results/soak-heap-small.json]

glibc's tunables apply as usual, e.g. `MALLOC_MMAP_THRESHOLD_=1048576` or `MALLOC_ARENA_MAX=2` in the
environment (the forked ranks inherit it).

Rank 0 survives them all, in the rotation live 2 -> 1, live 1 -> 2, storage 2 -> 1, storage 1 -> 2, each
followed by a non-blocking save and two steps, as the coordinator does after a live move. After each,
rank 0 records the second step's time, its RSS, its RSS after `malloc_trim(0)` (what it holds, less what glibc keeps free),
glibc's own account (`mallinfo2`: bytes in use, free in its arenas, mmapped; the number of arenas) and
the resident set after the trim by kind (anonymous, mapped files, shared memory), the Python objects
alive (`gc.get_objects()`, the import-time ones frozen by `Worker.__init__` aside);
tracemalloc runs from the 2nd, and its snapshots after the 4th and the last (both storage 1 -> 2, so
the same world size and path) are diffed by line: the Python allocation sites that grew.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.multiproc import run_ranks  # noqa: E402
from tests.ports import free_port  # noqa: E402

ROTATION = (("live", 1), ("live", 2), ("storage", 1), ("storage", 2))


def job_config(preset: str) -> dict:
    """The soak's job (benchmarks/soak.py), without its cluster."""
    return {"name": "soak-heap", "model": {"preset": preset}, "data": {"source": "synthetic", "seq_len": 64},
            "train": {"steps": 1_000_000, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-3,
                      "warmup_steps": 2, "seed": 5},
            "parallel": {"dp_mode": "shard"},
            "checkpoint": {"interval_steps": 1_000_000, "async_save": True, "keep_last": 2}}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                  "fsmblks", "uordblks", "fordblks", "keepcost")]


def glibc_heap() -> dict:
    """MB in use, free in the arenas and mmapped (mallinfo2, summed over arenas), and the arena count."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        arenas = len(re.findall(r"<heap nr=", f.read()))
    mb = 2 ** 20
    return {"in_use_mb": m.uordblks / mb, "free_mb": m.fordblks / mb, "mmapped_mb": m.hblkhd / mb, "arenas": arenas}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def rss_parts() -> dict:
    """The resident set by kind (/proc/self/status): anonymous memory, mapped files, shared memory."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                name, kb = line.split()[:2]
                out[f"{name[3:-1].lower()}_mb"] = int(kb) / 1024
    return out


def survivor(cfg_dict: dict, run_dir: str, ports: list[int], n: int, top: int) -> dict | None:
    import tracemalloc

    import torch.distributed as dist

    from workers.actor import Worker
    from workers.config import JobConfig, job_plan

    rank = dist.get_rank()
    dist.destroy_process_group()
    cfg = JobConfig.from_dict(cfg_dict)
    plans = {1: job_plan(cfg, 1).to_dict(), 2: job_plan(cfg, 2).to_dict()}
    port = iter(ports)
    addr = "127.0.0.1"
    w = Worker(cfg, run_dir)
    w.join(rank=rank, world_size=2, master_addr=addr, master_port=next(port), plan=plans[2])
    w.run(until_step=1_000_000, steps=1)
    rows, snaps, kinds = [], {}, {}
    for i in range(1, n + 1):
        path, size = ROTATION[(i - 1) % len(ROTATION)]
        old = 3 - size
        if path == "live":
            if rank < old:
                w.hand_over()
            w.reshard(rank=rank, world_size=2, master_addr=addr, master_port=next(port), old_plan=plans[old],
                      new_plan=plans[size], old_rank=rank if rank < old else None,
                      new_rank=rank if rank < size else None, old_to_group={r: r for r in range(old)},
                      new_to_group={r: r for r in range(size)}, nodes={0: "n", 1: "n"})
        elif rank < old:
            w.checkpoint(blocking=True)
            w.leave()
        p = next(port)
        if rank < size:
            w.join(rank=rank, world_size=size, master_addr=addr, master_port=p, plan=plans[size],
                   adopt=path == "live")
            w.checkpoint(blocking=False)
            steps = w.run(until_step=1_000_000, steps=2)
            w.trainer.flush_checkpoint()
        if rank != 0:
            continue
        gc.collect()
        row = {"reconfigs": i, "kind": f"{path} -> {size}", "step_s": steps.rows[-1].step_time, "rss_mb": rss_mb(),
               **glibc_heap(),
               "objects": len(gc.get_objects()),
               "traced_mb": tracemalloc.get_traced_memory()[0] / 2 ** 20 if tracemalloc.is_tracing() else None}
        ctypes.CDLL(None).malloc_trim(0)
        row["rss_after_trim_mb"] = rss_mb()
        row.update({f"after_trim_{k}": v for k, v in rss_parts().items()})
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if i == 2:
            tracemalloc.start(8)
        if i in (4, n):
            snaps[i] = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            kinds[i] = Counter(type(o).__name__ for o in gc.get_objects())
    w.leave()
    if rank != 0:
        return None
    grew = [{"kb": round(s.size_diff / 1024, 1), "count": s.count_diff, "where": str(s.traceback)}
            for s in snaps[n].compare_to(snaps[4], "lineno")[:top]]
    types = {k: kinds[n][k] - kinds[4].get(k, 0) for k in kinds[n] if kinds[n][k] != kinds[4].get(k, 0)}
    return {"rows": rows, "tracemalloc_top": grew,
            "object_types_grew": dict(sorted(types.items(), key=lambda kv: -abs(kv[1]))[:top])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reconfigs", type=int, default=16, help="at least 8; a multiple of 4 compares like with like")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--top", type=int, default=15, help="allocation sites and object types listed")
    ap.add_argument("--json", help="default: benchmarks/results/soak-heap-<preset>.json")
    a = ap.parse_args(argv)
    if a.reconfigs < 8:
        ap.error("--reconfigs must be at least 8 (the diff starts after the 4th)")
    out_json = Path(a.json or ROOT / "benchmarks" / "results" / f"soak-heap-{a.preset}.json")
    ports = [free_port() for _ in range(2 * a.reconfigs + 2)]
    with tempfile.TemporaryDirectory(prefix="soak-heap-") as run_dir:
        res = run_ranks(2, survivor, job_config(a.preset), run_dir, ports, a.reconfigs, a.top,
                        timeout=300 + 120 * a.reconfigs)[0]
    res = {"command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "preset": a.preset, **res}
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=1))
    print("Python allocation sites that grew from the 4th to the last reconfiguration:")
    for g in res["tracemalloc_top"]:
        print(f"  {g['kb']:8.1f} KB {g['count']:6d}  {g['where']}")
    print("object types that grew:", res["object_types_grew"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
