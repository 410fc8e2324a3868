"""What the I/O benchmarks share: a checkpoint's files, dropping them from the page cache, reading them
raw (the baseline a load is measured against), and a median that tolerates no samples."""

from __future__ import annotations

import os
import statistics


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def files(d: str) -> list[str]:
    return sorted(os.path.join(dp, n) for dp, _, ns in os.walk(d) for n in ns)


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED only drops clean pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[str], chunk: int = 16 << 20) -> int:
    """Read `paths` through one buffer, unbuffered; returns the bytes read."""
    buf, n = bytearray(chunk), 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n
