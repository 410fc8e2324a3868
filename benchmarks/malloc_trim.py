"""What glibc's malloc_trim(0) costs a worker: free a layout's worth of tensors (the `small` preset's block
shapes, plus many small ones), then time the trim that returns the freed pages to the system.

    MALLOC_ARENA_MAX=2 .venv/bin/python benchmarks/malloc_trim.py
"""

from __future__ import annotations

import ctypes
import gc
import time

import psutil
import torch


def main() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    proc = psutil.Process()

    def rss() -> float:
        return proc.memory_info().rss / 2**20

    for rnd in range(3):
        ts = [torch.randn(n) for _ in range(30) for n in (262144, 262144, 704 * 256, 704 * 256, 704 * 256)]
        ts += [torch.randn(4096) for _ in range(20000)]
        held = rss()
        del ts
        gc.collect()
        freed = rss()
        t0 = time.perf_counter()
        libc.malloc_trim(0)
        dt = time.perf_counter() - t0
        print(f"round {rnd}: RSS {held:.0f} MB, {freed:.0f} MB after freeing, {rss():.0f} MB after the trim; "
              f"trim {dt * 1000:.1f} ms")
    t0 = time.perf_counter()
    libc.malloc_trim(0)
    print(f"a trim with nothing to return: {(time.perf_counter() - t0) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
