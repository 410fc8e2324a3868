"""Checksums of checkpoint bytes, computed as the bytes are written and again as they are read.

Measured on a 2-core box of this project's kind (256 MiB of random bytes in 16 MiB updates, one thread):

    sha256 (hashlib)  1.7 GB/s    blake3  6.7 GB/s (11 GB/s multi-threaded)
    crc32c           15.4 GB/s    xxh3-128  25.7 GB/s

All four release the GIL while hashing a large buffer (a pure-Python loop in another thread slowed by
1.2x, the same as for a memcpy-bound neighbour). xxh3-128 is the default: a non-cryptographic 128-bit
hash that detects truncation, bit flips and torn writes at memory speed, so verifying costs nothing next
to the disk. blake3 is there for users who want cryptographic strength (it still runs at several times
the disk's speed); `none` is for scratch runs; `sha256` is what format-1 manifests recorded and is still
read. Imports are lazy: a tool that only reads manifests does not need the hash packages.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

ALGORITHMS = ("xxh3-128", "blake3", "sha256", "none")
DEFAULT = "xxh3-128"
DIGEST_CHARS = {"xxh3-128": 32, "blake3": 64, "sha256": 64, "none": 0}
"""Characters of one hex digest of each algorithm (`digest_fn`'s output): a keyed index stores a chunk's
block digests back to back at this width, so a loader can read those of some blocks alone."""


def check_algorithm(name: str) -> str:
    if name not in ALGORITHMS:
        raise ValueError(f"checksum algorithm {name!r} is not one of {', '.join(ALGORITHMS)}")
    return name


def digest_fn(algorithm: str) -> Callable[[Any], str]:
    """A one-shot `buffer -> hex digest` function: cheaper per call than a hasher object, which matters
    at tens of thousands of small blocks per GB."""
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128_hexdigest
    if algorithm == "blake3":
        import blake3

        return lambda data: blake3.blake3(data).hexdigest()
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).hexdigest()
    if algorithm == "none":
        return lambda data: ""
    raise ValueError(f"checksum algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
