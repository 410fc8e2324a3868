"""Why the first training step after `Trainer.build()` is slow on a GPU: the step's phases in a fresh
process, with the staging pool's background pinning left running beside it (what a worker does) and
waited for first; and how long one CUDA allocation stalls while a large host buffer is pinned in another
thread, by each way of pinning.

    PYTHONPATH=. python3 benchmarks/first_step.py --preset 1b --layers 0 [--json out.json]   # needs CUDA
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.startup import _cfg, _sync, _trainer  # noqa: E402


def step_body(cfg_dict: dict, run_dir: str, device: str, wait_pool: bool) -> dict:
    """Build fresh, optionally wait for the staging pool's reservation, then two timed steps."""
    tr = _trainer(cfg_dict, run_dir, device)
    t = time.perf_counter()
    tr.build()
    _sync(device)
    out: dict = {"build_s": time.perf_counter() - t, "build": dict(tr.build_times)}
    t = time.perf_counter()
    if wait_pool:
        tr.checkpointer._stager._wait_reserved()
    out["pool_wait_s"] = time.perf_counter() - t
    for name in ("first", "second"):
        tr.phase_times = {}
        t = time.perf_counter()
        tr.train_step()
        _sync(device)
        out[f"{name}_step_s"] = time.perf_counter() - t
        out[f"{name}_phases"], tr.phase_times = tr.phase_times, None
    tr.close()
    return out


def _stalls(pin, nbytes: int) -> dict:
    """Run `pin(nbytes)` in a thread; meanwhile allocate fresh 64 MiB device blocks (each a cudaMalloc)
    and launch a small matmul, timing each round: the longest round is the stall."""
    import torch

    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    done = threading.Event()
    res: dict = {}

    def run() -> None:
        t = time.perf_counter()
        res["pool"] = pin(nbytes)
        res["pin_s"] = time.perf_counter() - t
        done.set()

    th = threading.Thread(target=run)
    keep, rounds = [], []
    th.start()
    while not done.is_set():
        t = time.perf_counter()
        keep.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
        (x @ x).sum().item()
        rounds.append(time.perf_counter() - t)
        if len(keep) > 200:
            keep.clear()
            torch.cuda.empty_cache()
    th.join()
    res.pop("pool", None)
    return {"pin_s": res["pin_s"], "rounds": len(rounds), "max_round_s": max(rounds, default=0.0),
            "sum_rounds_s": sum(rounds)}


def pin_alloc(nbytes: int):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pin_register(nbytes: int, chunk: int = 256 << 20):
    """A pageable buffer, faulted in, then registered with the driver piece by piece."""
    import torch

    buf = torch.empty(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    for a in range(0, nbytes, chunk):
        n = min(chunk, nbytes - a)
        buf[a:a + n].fill_(0)
        rc = cudart.cudaHostRegister(buf.data_ptr() + a, n, 0)
        assert int(rc) == 0, rc
    for a in range(0, nbytes, chunk):
        cudart.cudaHostUnregister(buf.data_ptr() + a)
    return buf


def stall_body(nbytes: int) -> dict:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    out = {"idle": _stalls(lambda n: time.sleep(2.0), nbytes)}
    for name, fn in (("pin_memory=True", pin_alloc), ("register 256 MiB pieces", pin_register)):
        out[name] = _stalls(fn, nbytes)
        print(name, out[name], file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--pool-gb", type=float, default=13.2)
    ap.add_argument("--parts", default="steps,stalls")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from tests.multiproc import run_ranks

    import tempfile

    res: dict = {}
    parts = args.parts.split(",")
    if "stalls" in parts:
        (res["stalls"],) = run_ranks(1, stall_body, int(args.pool_gb * 1e9), timeout=900, spawn=True)
    if "steps" in parts:
        for wait in (False, True):
            with tempfile.TemporaryDirectory() as d:
                (r,) = run_ranks(1, step_body, _cfg(args.preset, args.layers), d, "cuda", wait, timeout=900, spawn=True)
            res["wait pool" if wait else "pool beside"] = r
            print(("wait" if wait else "beside"), json.dumps(r), file=sys.stderr, flush=True)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
