"""The streaming shard writer: safetensors files written straight from host buffers.

A file is the 8-byte header length, the JSON header (padded with spaces to 8 bytes, as the safetensors
library writes it), then each tensor's bytes in header order. The header is computed from shapes alone,
so nothing is serialised into an intermediate `bytes` object: each tensor is written from its own
memory in blocks of at most `block_bytes`, and each block is hashed as it goes out (`checksum.py`; the
hashers and `os.write` release the GIL, so a writer thread hardly competes with a training thread).
Blocks are whole rows of the tensor (dim 0), so a loader that needs rows [a, b) of a chunk reads and
verifies only the blocks that hold them. Files stay readable by `safetensors.safe_open`.

Large rank shards are split into several files written by parallel threads (`split_files`): one
stream does not fill a fast disk. The files of one rank carry the rank in their name, so ranks never
collide.
"""

from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from parallel.checkpoint.checksum import digest_fn
from parallel.checkpoint.storage import LocalStorage, Storage

ST_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64", torch.uint64: "U64", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DEFAULT_BLOCK_BYTES = 1 << 20
"""Checksum granularity: small enough that a resharding load that needs half the rows of a few-MB chunk
reads about half of it (a load must read whole blocks to verify them), large enough that the digests
add ~32 bytes of manifest per MiB of state."""
MIN_BLOCK_BYTES = 64 << 10
IO_BYTES = 16 << 20
"""Bytes per write or read call: several blocks at a time, so the syscall count stays low."""
MIN_FILE_BYTES = 256 << 20
"""A rank's shard is split into more files (one writer thread each) only above this size per file."""


@dataclass(slots=True)
class Piece:
    """One chunk this rank writes: `data` (host memory, contiguous) is the box of tensor `key` that starts
    at the global `offsets`."""

    key: str
    data: torch.Tensor
    offsets: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(slots=True)
class WrittenChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    block_rows: int
    digests: list[str] = field(default_factory=list)


@dataclass(slots=True)
class WrittenFile:
    name: str
    size: int
    header_digest: str
    chunks: dict[str, WrittenChunk]


def block_rows_for(shape: tuple[int, ...] | torch.Size, itemsize: int, block_bytes: int) -> int:
    """Rows of dim 0 per checksummed block: about 1/16 of the chunk (at least 64 KiB, at most
    `block_bytes`), so a load that needs part of a chunk reads little beyond it; at least one row."""
    row = math.prod(shape[1:]) * itemsize if len(shape) else itemsize
    total = row * (shape[0] if len(shape) else 1)
    target = min(block_bytes, max(MIN_BLOCK_BYTES, total // 16))
    return max(1, target // max(row, 1))


def header_bytes(pieces: list[Piece]) -> bytes:
    """The safetensors prefix (length + JSON header, space-padded to a multiple of 8) for `pieces` in order."""
    header: dict[str, Any] = {"__metadata__": {
        "format": "pt",
        "elastron_offsets": json.dumps({p.key: list(p.offsets) for p in pieces}, separators=(",", ":")),
    }}
    pos = 0
    for p in pieces:
        if p.key in header:
            raise ValueError(f"tensor {p.key} would be in one file twice; a rank writes one box per tensor")
        if p.data.dtype not in ST_DTYPES:
            raise TypeError(f"tensor {p.key}: dtype {p.data.dtype} cannot be stored in safetensors")
        header[p.key] = {"dtype": ST_DTYPES[p.data.dtype], "shape": list(p.data.shape),
                         "data_offsets": [pos, pos + p.nbytes]}
        pos += p.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def split_files(pieces: list[Piece], n_files: int) -> list[list[Piece]]:
    """Balance pieces over `n_files` files by bytes (largest first onto the lightest file); each file's
    pieces then go in key order, so the same state always gives the same files."""
    n_files = max(1, min(n_files, len(pieces)))
    bins: list[list[Piece]] = [[] for _ in range(n_files)]
    load = [0] * n_files
    for p in sorted(pieces, key=lambda p: (-p.nbytes, p.key)):
        i = load.index(min(load))
        bins[i].append(p)
        load[i] += p.nbytes
    return [sorted(b, key=lambda p: p.key) for b in bins if b]


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _FdSink:
    """Unbuffered writes to a local file, fsync on close: large writes go straight to the kernel."""

    def __init__(self, path: str, sync: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.sync = sync

    def write(self, view: memoryview) -> None:
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def close(self, ok: bool) -> None:
        try:
            if ok and self.sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


class _StreamSink:
    def __init__(self, f: IO[bytes]) -> None:
        self.f = f

    def write(self, view: memoryview) -> None:
        self.f.write(view)

    def close(self, ok: bool) -> None:
        self.f.close()


class ShardWriter:
    """Writes one rank's shard files into the checkpoint directory `directory` of `storage`."""

    def __init__(self, storage: Storage, directory: str, *, algorithm: str, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 sync: bool = True) -> None:
        self.storage, self.directory = storage, directory
        self.algorithm, self.block_bytes, self.sync = algorithm, block_bytes, sync

    def _sink(self, path: str):
        if isinstance(self.storage, LocalStorage):
            return _FdSink(path, self.sync)
        return _StreamSink(self.storage.open(path, "wb"))

    def write_file(self, name: str, pieces: list[Piece]) -> WrittenFile:
        head = header_bytes(pieces)
        digest = digest_fn(self.algorithm)
        out = WrittenFile(name=name, size=len(head), header_digest=digest(head), chunks={})
        sink = self._sink(self.storage.join(self.directory, name))
        ok = False
        try:
            sink.write(memoryview(head))
            for p in pieces:
                shape = tuple(p.data.shape)
                rows = block_rows_for(shape, p.data.element_size(), self.block_bytes)
                chunk = WrittenChunk(offsets=tuple(p.offsets), sizes=shape, block_rows=rows)
                view = _byte_view(p.data)
                step = max(1, rows * (len(view) // shape[0] if shape and shape[0] else len(view)))
                span = max(step, IO_BYTES // step * step)  # whole blocks per write
                for a in range(0, len(view), span):
                    out_view = view[a:a + span]
                    if self.algorithm != "none":
                        chunk.digests += [digest(out_view[b:b + step]) for b in range(0, len(out_view), step)]
                    sink.write(out_view)
                out.chunks[p.key] = chunk
                out.size += len(view)
            ok = True
        finally:
            sink.close(ok)
        return out

    def write(self, files: dict[str, list[Piece]], *, threads: int = 1) -> list[WrittenFile]:
        """Write every file, up to `threads` at once; returns them in name order."""
        names = sorted(files)
        if threads <= 1 or len(names) <= 1:
            return [self.write_file(n, files[n]) for n in names]
        with ThreadPoolExecutor(max_workers=min(threads, len(names)), thread_name_prefix="ckpt-file") as pool:
            return list(pool.map(lambda n: self.write_file(n, files[n]), names))
