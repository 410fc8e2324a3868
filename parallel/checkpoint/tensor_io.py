"""Reading tensor chunks out of the checkpoint's safetensors files, without pickle and without DCP's
metadata file.

DCP's own readers are unsuitable on the load path: `FileSystemReader` unpickles `.metadata`, and
`HuggingFaceStorageReader` builds its metadata by listing every *.safetensors file in the directory
(stray files join the checkpoint) and reads through `safe_open`, which needs a local path. Instead
`ManifestReader` takes the tensor layout from the validated JSON manifest and reads byte ranges with
plain `open`/fsspec, so the same code serves local disks and object stores. A safetensors file is an
8-byte little-endian header length, a JSON header, then raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import math
import struct
from collections import defaultdict
from typing import IO, Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from parallel.checkpoint.manifest import CheckpointError, Chunk, Manifest
from parallel.checkpoint.storage import Storage

_MAX_HEADER = 100 << 20  # the safetensors library's own limit

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


def read_header(f: IO[bytes], *, file_size: int, where: str) -> tuple[dict[str, Any], int]:
    """(header, offset of the data section). Checks that the header is sane and that every tensor's
    byte range lies inside the file, so a truncated or corrupted file fails here with its name."""
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointError(f"{where}: truncated before the safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER or 8 + n > file_size:
        raise CheckpointError(f"{where}: safetensors header length {n} does not fit the file ({file_size} bytes)")
    try:
        header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
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


def saved_offsets(header: dict[str, Any]) -> dict[str, list[int]]:
    """Chunk offsets that DCP's HuggingFace writer stores in the header metadata (DCP_SHARDING_INFO)."""
    meta = header.get("__metadata__") or {}
    info = json.loads(meta.get("DCP_SHARDING_INFO", "{}"))
    return {k: list(v["saved_offsets"]) for k, v in info.items()}


def _read_exact(f: IO[bytes], offset: int, nbytes: int, where: str) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    f.seek(offset)
    got = 0
    while got < nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{where}: file ends {nbytes - got} bytes early (truncated)")
        got += n
    return buf


def read_slab(f: IO[bytes], header: dict, data_start: int, key: str, chunk: Chunk, *,
              rows: tuple[int, int] | None, where: str) -> torch.Tensor:
    """Tensor `key` of one file, or only rows [r0, r1) of it: dim-0 slabs are contiguous on disk, so a
    resharded load reads just the bytes it needs along the first dimension."""
    info = header.get(key)
    if info is None:
        raise CheckpointError(f"{where}: tensor {key!r} is not in the file")
    shape = [int(s) for s in info["shape"]]
    if tuple(shape) != chunk.sizes:
        raise CheckpointError(f"{where}: tensor {key!r} is {shape} in the file, {list(chunk.sizes)} in the manifest")
    dt = SAFETENSORS_DTYPES[info["dtype"]]
    a = int(info["data_offsets"][0])
    if rows is not None and shape:
        row_bytes = math.prod(shape[1:]) * dt.itemsize
        a += rows[0] * row_bytes
        shape = [rows[1] - rows[0], *shape[1:]]
    nbytes = math.prod(shape) * dt.itemsize
    return _read_exact(f, data_start + a, nbytes, where).view(dt).reshape(shape)


class _OpenFiles:
    """Open handles and parsed headers of the files one read touches."""

    def __init__(self, storage: Storage, ckpt: str, manifest: Manifest) -> None:
        self.storage, self.ckpt, self.manifest = storage, ckpt, manifest
        self._open: dict[str, tuple[IO[bytes], dict, int]] = {}

    def get(self, name: str) -> tuple[IO[bytes], dict, int]:
        if name not in self._open:
            entry = self.manifest.files.get(name)
            if entry is None:
                raise CheckpointError(f"{self.ckpt}: file {name!r} is not listed in the manifest")
            f = self.storage.open(self.storage.join(self.ckpt, name))
            header, start = read_header(f, file_size=entry.size, where=f"{self.ckpt}/{name}")
            self._open[name] = (f, header, start)
        return self._open[name]

    def close(self) -> None:
        for f, _, _ in self._open.values():
            f.close()
        self._open.clear()


class ManifestReader(StorageReader):
    """A DCP StorageReader whose metadata is the JSON manifest and whose reads are byte ranges of the
    safetensors shards. DCP's planner does the resharding: it intersects each target shard (DTensor or
    plain tensor) with the saved chunks and asks for exactly those pieces."""

    def __init__(self, storage: Storage, ckpt: str, manifest: Manifest) -> None:
        super().__init__()
        self.storage, self.ckpt, self.manifest = storage, ckpt, manifest
        self._chunks: dict[MetadataIndex, Chunk] = {}

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md: dict[str, TensorStorageMetadata] = {}
        self._chunks = {}
        for key, t in self.manifest.tensors.items():
            md[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(t.dtype)),
                size=torch.Size(t.shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                        for c in t.chunks],
            )
            for c in t.chunks:
                self._chunks[MetadataIndex(key, c.offsets)] = c
        return Metadata(state_dict_metadata=md, storage_data=dict(self._chunks))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._chunks = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = defaultdict(list)
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{self.ckpt}: non-tensor item {req.dest_index.fqn!r} requested; "
                                      "this format stores only tensors")
            by_file[self._chunks[req.storage_index].file].append(req)
        files = _OpenFiles(self.storage, self.ckpt, self.manifest)
        try:
            for name, reqs in sorted(by_file.items()):
                f, header, start = files.get(name)
                for req in reqs:
                    chunk = self._chunks[req.storage_index]
                    so, ln = list(req.storage_offsets), list(req.lengths)
                    rows = (so[0], so[0] + ln[0]) if so else None
                    slab = read_slab(f, header, start, req.storage_index.fqn, chunk, rows=rows,
                                     where=f"{self.ckpt}/{name}")
                    if so:
                        slab = slab[(slice(None), *(slice(o, o + n) for o, n in zip(so[1:], ln[1:])))]
                    target = planner.resolve_tensor(req).detach()
                    if target.shape != slab.shape:
                        raise CheckpointError(f"{self.ckpt}: read {list(slab.shape)} for {req.dest_index.fqn} "
                                              f"but the target slice is {list(target.shape)}")
                    target.copy_(slab)
                    planner.commit_tensor(req, target)
        finally:
            files.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def assemble(storage: Storage, ckpt: str, manifest: Manifest, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors for `keys`, built in this process from their chunks: no process group."""
    out = {k: torch.empty(manifest.tensors[k].shape, dtype=torch_dtype(manifest.tensors[k].dtype)) for k in keys}
    by_file: dict[str, list[tuple[str, Chunk]]] = defaultdict(list)
    for k in keys:
        for c in manifest.tensors[k].chunks:
            by_file[c.file].append((k, c))
    files = _OpenFiles(storage, ckpt, manifest)
    try:
        for name, items in sorted(by_file.items()):
            f, header, start = files.get(name)
            for k, c in items:
                slab = read_slab(f, header, start, k, c, rows=None, where=f"{ckpt}/{name}")
                out[k][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))].copy_(slab)
    finally:
        files.close()
    return out
