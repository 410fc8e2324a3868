"""Reading the checkpoint's safetensors files into a rank's shards: one pass, verified as it reads.

The tensor layout comes from the validated JSON manifest (never from pickle, never from a directory
listing). For every target (this rank's box of a tensor: a DTensor shard or a plain tensor) the reader
intersects the box with the saved chunks, so any layout loads any other. Each needed block of rows of a
chunk is read once into a reusable host buffer, hashed, compared with its manifest digest, and only then
copied into every target box it overlaps: a corrupt byte never reaches a parameter that holds data.
Targets that hold none yet (a trainer being built: `in_place`) take the blocks that land in them
unchanged straight from the file, verified there: one copy less. Files are read in
parallel (one thread per file, largest share first), each in file order with plain `open`/fsspec, so
the same code serves local disks and object stores. Adjacent runs are read with one call of up to 16
MiB, and a file the rank needs most of is read straight through, gaps included. While the reads wait on
the disk, one more thread maps the host targets' pages in, in the order the copies will write them
(`prefault`): fresh memory would otherwise fault page by page inside the copies. A safetensors file is
an 8-byte little-endian header length, a JSON header, then raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import torch

from parallel.checkpoint.checksum import digest_fn
from parallel.checkpoint.entries import Chunk, FileEntry
from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.prefault import Prefaulter
from parallel.checkpoint.storage import LocalStorage, Storage
from parallel.checkpoint.writer import DEFAULT_BLOCK_BYTES, IO_BYTES, block_rows_for

_MAX_HEADER = 100 << 20  # the safetensors library's own limit
_STATS_LOCK = threading.Lock()
READ_BYTES = IO_BYTES
"""The largest single read: adjacent runs are read together up to this size."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint")
    return dt


def read_header(f: IO[bytes], *, file_size: int, where: str, entry: FileEntry | None = None
                ) -> tuple[dict[str, Any], int]:
    """(header, offset of the data section). Checks that the header is sane and that every tensor's
    byte range lies inside the file, so a truncated or corrupted file fails here with its name; with a
    format-2 `entry`, the header bytes must also match its digest."""
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointError(f"{where}: truncated before the safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER or 8 + n > file_size:
        raise CheckpointError(f"{where}: safetensors header length {n} does not fit the file ({file_size} bytes)")
    text = f.read(n)
    if entry is not None and not entry.header_ok(raw + text):
        raise CheckpointError(f"file {where.rsplit('/', 1)[-1]} fails its {entry.algorithm} checksum "
                                  "(corrupted header)")
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where}: safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: safetensors header is not an object")
    start = 8 + n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dt = SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            a, b = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: malformed header entry for {key!r}") from None
        if b - a != math.prod(shape) * dt.itemsize or a < 0 or start + b > file_size:
            raise CheckpointError(f"{where}: tensor {key!r} bytes [{a}, {b}) do not fit its shape or the file")
    return header, start




@dataclass(slots=True)
class Target:
    """Where one tensor's bytes go on this rank: `local` (any device) is the box of the global tensor
    that starts at `offsets`."""

    local: torch.Tensor
    offsets: tuple[int, ...]


@dataclass(slots=True)
class _Copy:
    rows: tuple[int, int]
    """Rows [a, b) of the chunk."""
    src: tuple[slice, ...]
    """Trailing-dim slices of the chunk."""
    dst: torch.Tensor
    """The view of the target that receives them."""


def _overlaps(chunk: Chunk, target: Target) -> list[_Copy]:
    lo = [max(c, t) for c, t in zip(chunk.offsets, target.offsets)]
    hi = [min(c + n, t + m) for c, n, t, m in zip(chunk.offsets, chunk.sizes, target.offsets, target.local.shape)]
    if any(a >= b for a, b in zip(lo, hi)):
        return []
    if not lo:  # 0-d
        return [_Copy(rows=(0, 1), src=(), dst=target.local)]
    dst = target.local[tuple(slice(a - t, b - t) for a, b, t in zip(lo, hi, target.offsets))]
    src = tuple(slice(a - c, b - c) for a, b, c in zip(lo[1:], hi[1:], chunk.offsets[1:]))
    return [_Copy(rows=(lo[0] - chunk.offsets[0], hi[0] - chunk.offsets[0]), src=src, dst=dst)]


@dataclass(slots=True)
class _ChunkRead:
    key: str
    chunk: Chunk
    dtype: torch.dtype
    copies: list[_Copy]
    file_key: str = ""
    """The tensor's name inside the file (another naming scheme's, e.g. a Hugging Face checkpoint's)."""


def _readinto(f: IO[bytes], offset: int, view: memoryview, where: str) -> None:
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{where}: file ends {len(view) - got} bytes early (truncated)")
        got += n


class _Scratch:
    """One reusable host buffer per reading thread (pinned when the targets live on a GPU)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        # Allocated once at the largest read size: a buffer grown step by step is fresh memory each
        # time, and the page faults of filling it cost more system time than the read (measured).
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, READ_BYTES), dtype=torch.uint8, pin_memory=self.pin)
        return self.buf[:nbytes]


def _open(storage: Storage, path: str) -> IO[bytes]:
    # No posix_fadvise hints: on this project's disks POSIX_FADV_SEQUENTIAL made a resharding load
    # ~20% slower and POSIX_FADV_WILLNEED up to 2x slower than plain large reads (docs/benchmarks.md).
    if isinstance(storage, LocalStorage):
        return open(path, "rb", buffering=0)
    return storage.open(path)


@dataclass(slots=True)
class _Segment:
    """Rows [a, z) of one chunk, a whole number of checksummed blocks (unless the chunk's end cuts the
    last one), at file offset `offset`."""

    read: _ChunkRead
    offset: int
    row_bytes: int
    block: int
    a: int
    z: int

    @property
    def nbytes(self) -> int:
        return (self.z - self.a) * self.row_bytes


def _segments(header: dict[str, Any], start: int, reads: list[_ChunkRead], where: str,
              check: bool) -> list[_Segment]:
    """Every run of rows this rank needs from one file, in file order."""
    out = []
    for r in reads:
        info = header.get(r.file_key or r.key)
        if info is None:
            raise CheckpointError(f"{where}: tensor {r.file_key or r.key!r} is not in the file")
        if tuple(int(s) for s in info["shape"]) != r.chunk.sizes:
            raise CheckpointError(f"{where}: tensor {r.file_key or r.key!r} is {info['shape']} in the file, "
                                  f"{list(r.chunk.sizes)} in the manifest")
        base, shape = start + int(info["data_offsets"][0]), r.chunk.sizes
        row_bytes = math.prod(shape[1:]) * r.dtype.itemsize if shape else r.dtype.itemsize
        # A verified read goes by whole checksummed blocks; with nothing to verify, by exact rows.
        block = (r.chunk.block_rows or block_rows_for(shape, r.dtype.itemsize, DEFAULT_BLOCK_BYTES)) if check else 1
        per_run = max(block, IO_BYTES // max(row_bytes, 1) // block * block)
        for a, z in _row_runs([cp.rows for cp in r.copies], block, r.chunk.rows, per_run):
            out.append(_Segment(r, base + a * row_bytes, row_bytes, block, a, z))
    return sorted(out, key=lambda s: s.offset)


def _regions(segs: list[_Segment], *, gap: int = 0, limit: int = READ_BYTES) -> list[list[_Segment]]:
    """Segments grouped into byte regions of at most `limit` bytes (a longer segment is a region of its
    own), each read with one call: runs that continue across chunk boundaries (whole chunks in a row, the
    halves a resharding load needs) become one large read, and gaps of up to `gap` bytes between
    segments are read through rather than skipped."""
    out: list[list[_Segment]] = []
    end = -1
    for s in segs:
        if out and end <= s.offset <= end + gap and s.offset + s.nbytes - out[-1][0].offset <= limit:
            out[-1].append(s)
        else:
            out.append([s])
        end = s.offset + s.nbytes
    return out


def _verify(seg: _Segment, view: memoryview, digest: Any, name: str, algorithm: str) -> None:
    c, a, z, block, row_bytes = seg.read.chunk, seg.a, seg.z, seg.block, seg.row_bytes
    for b in range(a // block, -(-z // block)):
        lo, hi = (b * block - a) * row_bytes, (min((b + 1) * block, z) - a) * row_bytes
        want = c.digest(b)
        if want is None and c.blocks is not None and b < c.n_blocks:  # the index read left it out: a bug here
            raise RuntimeError(f"no digest was read for block {b} of {seg.read.key} in {name} (the loader read "
                               f"blocks {c.blocks[0]}-{c.blocks[1]}): report this")
        if want is None or digest(view[lo:hi]) != want:
            raise CheckpointError(f"file {name} fails its {algorithm} checksum (corrupted: "
                                  f"rows {b * block}-{min((b + 1) * block, c.rows)} of {seg.read.key})")


def _copy_out(seg: _Segment, buf: torch.Tensor) -> None:
    r, a, z = seg.read, seg.a, seg.z
    shape = r.chunk.sizes
    rows = buf.view(r.dtype).reshape((z - a, *shape[1:])) if shape else buf.view(r.dtype).reshape(())
    for cp in r.copies:
        lo, hi = max(cp.rows[0], a), min(cp.rows[1], z)
        if lo >= hi:
            continue
        if not shape:
            cp.dst.copy_(rows)
            continue
        cp.dst[lo - cp.rows[0]:hi - cp.rows[0]].copy_(rows[(slice(lo - a, hi - a), *cp.src)])


def _in_place(seg: _Segment) -> torch.Tensor | None:
    """The bytes of host target memory that rows [a, z) of `seg`'s chunk land in unchanged (whole rows,
    same dtype, contiguous), so they can be read there directly; None if they need the read buffer."""
    r = seg.read
    if not r.chunk.sizes or len(r.copies) != 1:
        return None
    cp = r.copies[0]
    if (cp.dst.device.type != "cpu" or cp.dst.dtype != r.dtype or tuple(cp.dst.shape[1:]) != r.chunk.sizes[1:]
            or not cp.rows[0] <= seg.a < seg.z <= cp.rows[1]):
        return None
    rows = cp.dst[seg.a - cp.rows[0]:seg.z - cp.rows[0]]
    return rows.reshape(-1).view(torch.uint8) if rows.is_contiguous() else None


def _read_file(storage: Storage, ckpt: str, name: str, entry: FileEntry, reads: list[_ChunkRead],
               scratch: _Scratch, verify: bool, stats: dict[str, float] | None = None,
               read_through: bool = True, prefault: Prefaulter | None = None, in_place: bool = False) -> int:
    """Read the blocks of file `name` that `reads` need, verify each, copy it out; returns bytes read.
    `prefault` gets the targets in the order they will be written, to map them while the reads wait.
    `in_place`: a region whose every segment lands in a target unchanged is read there and verified
    there, without the read buffer (see `read_into`)."""
    where = f"{ckpt}/{name}"
    check = verify and entry.blockwise and entry.algorithm != "none"
    digest = digest_fn(entry.algorithm) if check else None
    nread = 0
    io_s = verify_s = copy_s = 0.0
    clock = time.perf_counter
    with torch.no_grad(), _open(storage, storage.join(ckpt, name)) as f:  # grad mode is per thread
        header, start = read_header(f, file_size=entry.size, where=where, entry=entry if verify else None)
        segs = _segments(header, start, reads, where, check)
        if prefault is not None:  # a block read in place faults its pages in inside the read itself
            prefault.add({id(cp.dst): cp.dst for s in segs if not (in_place and _in_place(s) is not None)
                          for cp in s.read.copies}.values())
        # A file this rank needs most of is read straight through, gaps included: one sequential stream
        # beats skipping (measured: 0.33 s against 0.41 s for the 2-rank benchmark's load).
        dense = read_through and 2 * sum(s.nbytes for s in segs) >= entry.size
        regions = _regions(segs, gap=entry.size if dense else 0, limit=READ_BYTES)
        for region in regions:
            views = [_in_place(seg) for seg in region] if in_place else []
            if views and all(v is not None for v in views):
                t0 = clock()
                for seg, v in zip(region, views):
                    _readinto(f, seg.offset, memoryview(v.numpy()), where)
                    nread += seg.nbytes
                t1 = clock()
                if check:
                    for seg, v in zip(region, views):
                        _verify(seg, memoryview(v.numpy()), digest, name, entry.algorithm)
                io_s, verify_s = io_s + t1 - t0, verify_s + clock() - t1
                continue
            lo = region[0].offset
            buf = scratch.get(region[-1].offset + region[-1].nbytes - lo)
            t0 = clock()
            _readinto(f, lo, memoryview(buf.numpy()), where)
            t1 = clock()
            nread += buf.numel()
            for s in region:
                part = buf[s.offset - lo:s.offset - lo + s.nbytes]
                if check:
                    _verify(s, memoryview(part.numpy()), digest, name, entry.algorithm)
            t2 = clock()
            for s in region:  # nothing is copied out before the whole region verified
                _copy_out(s, buf[s.offset - lo:s.offset - lo + s.nbytes])
            io_s, verify_s, copy_s = io_s + t1 - t0, verify_s + t2 - t1, copy_s + clock() - t2
    if stats is not None:
        with _STATS_LOCK:
            for k, v in (("io", io_s), ("verify", verify_s), ("copy", copy_s)):
                stats[k] = stats.get(k, 0.0) + v
    return nread


def _row_runs(intervals: list[tuple[int, int]], block: int, n_rows: int, per_run: int) -> list[tuple[int, int]]:
    """Row ranges [a, z) to read: the needed `intervals` widened to whole blocks of `block` rows, merged,
    and cut into runs of at most `per_run` rows (a multiple of `block`, so runs start on block bounds)."""
    widened = sorted((r0 // block * block, min(-(-r1 // block) * block, n_rows)) for r0, r1 in intervals if r1 > r0)
    merged: list[list[int]] = []
    for a, z in widened:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], z)
        else:
            merged.append([a, z])
    return [(x, min(x + per_run, z)) for a, z in merged for x in range(a, z, per_run)]


def read_into(storage: Storage, ckpt: str, manifest: Manifest, targets: dict[str, Target], *,
              threads: int = 4, verify: bool = True, file_keys: dict[str, str] | None = None,
              stats: dict[str, float] | None = None, read_through: bool = True, in_place: bool = False) -> int:
    """Fill every target from the checkpoint at `ckpt` (resharding as needed); returns the bytes read.
    Raises CheckpointError naming the file on a missing tensor, a short file or a checksum mismatch.
    `verify=False` skips block digests (format 1, whose whole-file sha256 the caller checked first).
    `file_keys` maps a manifest key to the tensor's name inside the files when they differ. `stats`, if
    given, gets the seconds spent in reads (`io`), checksums (`verify`) and copies (`copy`), summed over
    the reading threads, and in mapping host targets in beside them (`prefault`). `read_through=False`:
    never read a file's gaps, even where the rank needs most of it (a Hugging Face import reads only the
    slices each rank owns). `in_place=True`: the targets
    hold no data yet (memory allocated for this load, discarded if it fails), so blocks that land in a
    host target unchanged (whole rows, same dtype, contiguous) are read straight into it and verified
    there, one copy less; a checksum mismatch still fails the load, but leaves the bad bytes in that
    target, so never pass it for memory that holds state worth keeping."""
    by_file: dict[str, list[_ChunkRead]] = defaultdict(list)
    for key, target in targets.items():
        entry = manifest.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{ckpt}: the checkpoint has no tensor {key}")
        if tuple(entry.shape) and len(entry.shape) != target.local.dim():
            raise CheckpointError(f"{ckpt}: tensor {key} has {len(entry.shape)} dims, the target {target.local.dim()}")
        dtype = torch_dtype(entry.dtype)
        for c in entry.meeting(tuple(target.offsets), tuple(target.local.shape)):
            copies = _overlaps(c, target)
            if copies:
                by_file[c.file].append(_ChunkRead(key, c, dtype, copies, (file_keys or {}).get(key, "")))
    pin = any(t.local.is_cuda for t in targets.values())
    # Largest share first, so the reading threads end together (files are read whole by one thread).
    names = sorted(by_file, key=lambda n: (-sum(cp.dst.numel() * r.dtype.itemsize for r in by_file[n]
                                                for cp in r.copies), n))
    prefault = Prefaulter() if any(t.local.device.type == "cpu" for t in targets.values()) else None
    try:
        if threads <= 1 or len(names) <= 1:
            scratch = _Scratch(pin)
            return sum(_read_file(storage, ckpt, n, manifest.files[n], by_file[n], scratch, verify, stats,
                                  read_through, prefault, in_place) for n in names)
        local = threading.local()

        def one(n: str) -> int:
            if not hasattr(local, "scratch"):
                local.scratch = _Scratch(pin)
            return _read_file(storage, ckpt, n, manifest.files[n], by_file[n], local.scratch, verify, stats,
                              read_through, prefault, in_place)

        with ThreadPoolExecutor(max_workers=min(threads, len(names)), thread_name_prefix="ckpt-read") as pool:
            return sum(pool.map(one, names))
    finally:
        if prefault is not None:
            prefault.close()
            if stats is not None:
                stats["prefault"] = stats.get("prefault", 0.0) + prefault.seconds


def assemble(storage: Storage, ckpt: str, manifest: Manifest, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors for `keys`, built in this process from their chunks: no process group."""
    out = {k: torch.empty(manifest.tensors[k].shape, dtype=torch_dtype(manifest.tensors[k].dtype)) for k in keys}
    read_into(storage, ckpt, manifest, {k: Target(t, (0,) * t.dim()) for k, t in out.items()})
    return out
