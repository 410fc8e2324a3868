"""The checkpoint manifest: the JSON file that makes a checkpoint directory self-describing.

It is written last, so its presence is the commit marker; it names every tensor with its global shape,
dtype and the chunks (file, offsets, sizes) that tile it, and every file with its size and checksums, so
a loader can verify every byte it reads before that byte reaches a parameter.

Checksums (format 2): each file records its algorithm and the digest of its header; each chunk records
the digests of its row blocks (`block_rows` rows of the chunk each, the last one shorter). Together they
cover every byte of the file, and a rank that needs only some rows of a chunk (a resharding load) reads
and verifies only the blocks holding them. Format 1 (still read) had one sha256 per whole file. Everything that is not a tensor
(step, layout, LR schedule, data position, RNG states, AdamW step counters) lives here too, as JSON:
the load path never unpickles.

Pure: no torch import, so `inspect` and the CLI can read manifests cheaply.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
import time
from dataclasses import dataclass, field
from typing import Any

from parallel.checkpoint.checksum import ALGORITHMS, digest_fn

FORMAT = "elastron-checkpoint"
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"

MODEL_PREFIX = "model."
"""Tensor keys of model parameters: ``model.<canonical name>``."""
OPTIM_PREFIX = "optim."
"""Tensor keys of optimizer state: ``optim.<state name>.<canonical name>`` (e.g. optim.exp_avg.output.weight)."""

_FIELDS = ("format", "format_version", "step", "created", "optimizer", "tensors", "files")

ITEMSIZE = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
"""Bytes per element of the dtypes a checkpoint may hold (lets the manifest be checked without torch)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or none can be loaded; the message names the checkpoint and why."""


def describe(e: BaseException) -> str:
    """One line for a failure: a CheckpointError's own message, else the exception type and message."""
    if isinstance(e, CheckpointError):
        return str(e)[:1000]
    return f"{type(e).__name__}: {str(e)[:1000]}"


class ManifestError(CheckpointError):
    """A manifest that is not valid JSON or does not have the expected structure."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a tensor: the slab ``[offsets, offsets + sizes)`` lives in `file` under the
    tensor's key (DCP's HuggingFace storage writes one such piece per rank that owns it)."""

    file: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    block_rows: int = 0
    """Rows (along dim 0) per checksummed block; 0 in format 1, which checksummed whole files."""
    digests: tuple[str, ...] = ()
    """One digest per block of `block_rows` rows, in order (empty when the file's algorithm is none)."""

    @property
    def rows(self) -> int:
        return self.sizes[0] if self.sizes else 1

    @property
    def n_blocks(self) -> int:
        return -(-self.rows // self.block_rows) if self.block_rows else 0


@dataclass(frozen=True, slots=True)
class TensorEntry:
    shape: tuple[int, ...]
    """Global (unsharded) shape."""
    dtype: str
    """torch dtype name without the prefix, e.g. "float32"."""
    chunks: tuple[Chunk, ...]
    _by_row: Any = field(default=None, compare=False, repr=False)
    """(chunks sorted by first row, their first rows, the most rows of one), built on first use."""

    def meeting(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[Chunk]:
        """The chunks that meet the box [offsets, offsets + sizes), found by bisection on their first rows:
        a rank's read plan costs its own boxes' overlaps, not a scan of every rank's chunks."""
        if not self.shape:
            return list(self.chunks)
        if self._by_row is None:
            ordered = sorted(self.chunks, key=lambda c: c.offsets)
            object.__setattr__(self, "_by_row", (ordered, [c.offsets[0] for c in ordered],
                                                 max((c.sizes[0] for c in ordered), default=0)))
        ordered, starts, most = self._by_row
        lo, hi = offsets[0], offsets[0] + sizes[0]
        return [c for c in ordered[bisect_left(starts, lo - most + 1):bisect_left(starts, hi)]
                if all(a < b + m and b < a + n for a, n, b, m in zip(offsets, sizes, c.offsets, c.sizes))]


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    digest: str
    """Format 2 (`blockwise`): digest of the header bytes; format 1: sha256 of the whole file."""
    algorithm: str = "sha256"
    blockwise: bool = False
    """True: the data bytes are covered by the chunks' block digests (format 2)."""

    def header_ok(self, prefix: bytes) -> bool:
        """Whether the file's first bytes (length + JSON header) match the recorded digest; always true
        for format 1 and `none`, which record no header digest."""
        if not self.blockwise or self.algorithm == "none":
            return True
        return digest_fn(self.algorithm)(prefix) == self.digest

    def to_dict(self) -> dict[str, Any]:
        if not self.blockwise:
            return {"size": self.size, "sha256": self.digest}
        return {"size": self.size, "algorithm": self.algorithm, "header_digest": self.digest}


@dataclass(kw_only=True, slots=True)
class Manifest:
    step: int
    """Optimizer steps completed when the checkpoint was taken."""
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    optimizer_steps: dict[str, int] = field(default_factory=dict)
    """AdamW's per-parameter step counters by canonical name. Kept out of the tensor files: DCP's
    consolidation writes 0-d tensors as zero (FACTS.md), and an integer needs no tensor."""
    optimizer_name: str = "AdamW"
    state: dict[str, Any] = field(default_factory=dict)
    """All other non-tensor state (layout, model_config, job_config_digest, lr_schedule, data, rng, ...),
    stored as top-level keys of the JSON document."""
    format_version: int = FORMAT_VERSION
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        clash = sorted(set(self.state) & set(_FIELDS))
        if clash:
            raise ValueError(f"manifest state keys {clash} collide with reserved manifest fields")

    # -- views -------------------------------------------------------------------------------------
    @property
    def layout(self) -> dict | None:
        return self.state.get("layout")

    def model_tensors(self) -> dict[str, TensorEntry]:
        """Model parameters by canonical name."""
        n = len(MODEL_PREFIX)
        return {k[n:]: v for k, v in self.tensors.items() if k.startswith(MODEL_PREFIX)}

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "step": self.step,
            "created": self.created,
            **self.state,
            "optimizer": {"name": self.optimizer_name, "steps": dict(sorted(self.optimizer_steps.items()))},
            "tensors": {
                k: {"shape": list(t.shape), "dtype": t.dtype,
                    "chunks": [_chunk_dict(c) for c in t.chunks]}
                for k, t in sorted(self.tensors.items())
            },
            "files": {k: f.to_dict() for k, f in sorted(self.files.items())},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        """Parse and type-check a manifest; raises ManifestError saying what is wrong. The text may come
        from untrusted storage, so every field is checked rather than trusted."""
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        except RecursionError:  # a forged, deeply nested document: a verdict, not a crash of the loader
            raise ManifestError("manifest is nested too deeply to be a checkpoint manifest") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        if not isinstance(d, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise ManifestError(f"manifest format is {d.get('format')!r}, expected {FORMAT!r}")
        version = _int(d, "format_version")
        if version > FORMAT_VERSION:
            raise ManifestError(f"manifest format_version {version} is newer than this code reads ({FORMAT_VERSION})")
        opt = d.get("optimizer", {})
        if not isinstance(opt, dict):
            raise ManifestError("manifest optimizer must be an object")
        steps = opt.get("steps", {})
        if not isinstance(steps, dict) or not all(_is_int(v) for v in steps.values()):
            raise ManifestError("manifest optimizer.steps must map names to integers")
        tensors_d = d.get("tensors")
        files_d = d.get("files")
        if not isinstance(tensors_d, dict) or not isinstance(files_d, dict):
            raise ManifestError("manifest needs 'tensors' and 'files' objects")
        tensors = {str(k): _tensor(k, v) for k, v in tensors_d.items()}
        files = {str(k): _file(k, v) for k, v in files_d.items()}
        created = d.get("created", 0.0)
        return cls(
            step=_int(d, "step"),
            tensors=tensors,
            files=files,
            optimizer_steps={str(k): int(v) for k, v in steps.items()},
            optimizer_name=str(opt.get("name", "AdamW")),
            state={k: v for k, v in d.items() if k not in _FIELDS},
            format_version=version,
            created=float(created) if isinstance(created, (int, float)) else 0.0,
        )

    # -- checks ------------------------------------------------------------------------------------
    def structure_problems(self) -> list[str]:
        """Chunks that fall outside their tensor, overlap, leave holes, or name unlisted files; files
        too small for the chunks they are said to hold (so a forged manifest cannot make a loader
        allocate more than the checkpoint's size)."""
        problems: list[str] = []
        in_file: dict[str, int] = dict.fromkeys(self.files, 0)
        for key, t in self.tensors.items():
            if t.dtype not in ITEMSIZE:
                problems.append(f"tensor {key}: unsupported dtype {t.dtype!r}")
                continue
            covered = 0
            boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
            for c in t.chunks:
                if c.file not in self.files:
                    problems.append(f"tensor {key}: chunk in file {c.file!r}, which the manifest does not list")
                if len(c.offsets) != len(t.shape) or len(c.sizes) != len(t.shape) or any(
                    o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, t.shape)
                ):
                    problems.append(f"tensor {key}: chunk offsets {list(c.offsets)} sizes {list(c.sizes)} "
                                    f"do not fit shape {list(t.shape)}")
                    continue
                boxes.append((c.offsets, c.sizes))
                covered += math.prod(c.sizes)
                if c.file in in_file:
                    in_file[c.file] += math.prod(c.sizes) * ITEMSIZE[t.dtype]
                problems += _block_problems(key, c, self.files.get(c.file))
            problems += [f"tensor {key}: chunks at {list(a)} and {list(b)} overlap" for a, b in _overlapping(boxes)]
            if covered != math.prod(t.shape):
                problems.append(f"tensor {key}: chunks cover {covered} of {math.prod(t.shape)} elements")
        for name, nbytes in sorted(in_file.items()):
            if nbytes > self.files[name].size:
                problems.append(f"file {name}: its chunks need {nbytes} bytes but the file has {self.files[name].size}")
        return problems

    def model_problems(self, expected: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
        """Differences between the checkpoint's model tensors and the model about to receive them
        (`expected`: canonical name -> (global shape, dtype name)). Shape mismatches come first: they show
        both shapes, the clearest sign of a different model when only the first problem is shown."""
        have = self.model_tensors()
        shapes, others = [], []
        for name, (shape, dtype) in sorted(expected.items()):
            t = have.get(name)
            if t is None:
                others.append(f"model parameter {name} is missing from the checkpoint")
            elif tuple(t.shape) != tuple(shape):
                shapes.append(f"model parameter {name} has shape {list(t.shape)} in the checkpoint but "
                              f"{list(shape)} in the model (different model shape)")
            elif t.dtype != dtype:
                others.append(f"model parameter {name} is {t.dtype} in the checkpoint but {dtype} in the model")
        extra = sorted(set(have) - set(expected))
        if extra:
            others.append(f"checkpoint has {len(extra)} parameter(s) the model does not, e.g. {extra[0]} "
                          "(different model shape)")
        return shapes + others


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The offsets of every pair of boxes (offsets, sizes) that overlap. A sweep along dim 0 compares a
    box only with those whose rows it shares, so a tensor's chunks (a grid: rows of FSDP shards, columns
    of TP shards) cost about (chunks x columns), not chunks squared."""
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if boxes and not boxes[0][0]:  # 0-d: any second chunk overlaps the first
        return [(o, boxes[0][0]) for o, _ in boxes[1:]]
    active: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []  # (row end, offsets, sizes)
    for o, n in sorted(boxes):
        active = [x for x in active if x[0] > o[0]]
        for _, o2, n2 in active:
            if all(a < b + m and b < a + k for a, k, b, m in zip(o, n, o2, n2)):
                out.append((o, o2))
        active.append((o[0] + n[0], o, n))
    return out


def _chunk_dict(c: Chunk) -> dict[str, Any]:
    d: dict[str, Any] = {"file": c.file, "offsets": list(c.offsets), "sizes": list(c.sizes)}
    if c.block_rows:
        d["block_rows"] = c.block_rows
        d["digests"] = list(c.digests)
    return d


def _block_problems(key: str, c: Chunk, f: FileEntry | None) -> list[str]:
    if f is None or not f.blockwise:
        return []
    if c.block_rows < 1:
        return [f"tensor {key}: chunk in {c.file} has no checksum blocks"]
    if f.algorithm != "none" and len(c.digests) != c.n_blocks:
        return [f"tensor {key}: chunk in {c.file} has {len(c.digests)} block digests, expected {c.n_blocks}"]
    return []


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d: dict, key: str) -> int:
    v = d.get(key)
    if not _is_int(v) or v < 0:
        raise ManifestError(f"manifest {key} must be an integer >= 0, got {v!r}")
    return v


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
        raise ManifestError(f"{what} must be a list of integers >= 0, got {v!r}")
    return tuple(v)


def _tensor(key: Any, v: Any) -> TensorEntry:
    if not isinstance(v, dict) or not isinstance(v.get("dtype"), str) or not isinstance(v.get("chunks"), list):
        raise ManifestError(f"manifest tensor {key!r} needs shape, dtype and chunks")
    chunks = []
    for c in v["chunks"]:
        if not isinstance(c, dict) or not isinstance(c.get("file"), str):
            raise ManifestError(f"manifest tensor {key!r} has a malformed chunk {c!r}")
        block_rows, digests = c.get("block_rows", 0), c.get("digests", [])
        if not _is_int(block_rows) or block_rows < 0 or not isinstance(digests, list) or not all(
                isinstance(x, str) for x in digests):
            raise ManifestError(f"manifest tensor {key!r} has malformed chunk checksums")
        chunks.append(Chunk(file=c["file"], offsets=_ints(c.get("offsets"), f"tensor {key!r} chunk offsets"),
                            sizes=_ints(c.get("sizes"), f"tensor {key!r} chunk sizes"),
                            block_rows=block_rows, digests=tuple(digests)))
    return TensorEntry(shape=_ints(v.get("shape"), f"tensor {key!r} shape"), dtype=v["dtype"], chunks=tuple(chunks))


def _file(key: Any, v: Any) -> FileEntry:
    if "/" in str(key) or "\\" in str(key) or str(key) in ("", ".", ".."):
        # Names are joined to the checkpoint directory: never let a manifest point outside it.
        raise ManifestError(f"manifest file name {key!r} is not a plain file name")
    if not isinstance(v, dict) or not _is_int(v.get("size")):
        raise ManifestError(f"manifest file {key!r} needs an integer size and a checksum")
    if isinstance(v.get("sha256"), str):  # format 1
        return FileEntry(size=v["size"], digest=v["sha256"])
    if v.get("algorithm") not in ALGORITHMS or not isinstance(v.get("header_digest"), str):
        raise ManifestError(f"manifest file {key!r} needs a checksum algorithm (one of {', '.join(ALGORITHMS)}) "
                            "and a header_digest string")
    return FileEntry(size=v["size"], digest=v["header_digest"], algorithm=v["algorithm"], blockwise=True)
