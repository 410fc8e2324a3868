"""The checkpoint manifest: the JSON files that make a checkpoint directory self-describing.

Format 4 (written now). ``manifest.json``, written last (its presence is the commit marker), holds what
a rank needs besides its boxes' chunks: the step, the placement the checkpoint was saved under (layout,
layer count, tied embedding: `placement.py`), the number of index files, all non-tensor state, and the
global shape and dtype of every parameter (and so of its optimizer states). It is laid out so that a
rank reads only what its pipeline stage holds: a preamble of `PREAMBLE_BYTES` (the header's length and
crc32), a header (everything but the parameters, the length and crc32 of each section, the number of
parameters and keys and the crc32 of the sorted keys), then one section per pipeline stage of the saved
layout (and one for the tied table when two stages hold it; one in all without a placement): the
shapes and dtypes of its parameters (a run of layers with the same entries, differing only in the
layer number in their names, written once as a repeat) and where their keys fall in the sorted order
of every key (`Manifest.to_json`). Rank 0 reads the preamble and the header and shares them; each rank reads the
sections of its own parameters by byte range (`validate.read_sections`) and checks their shapes against
its model's before any other read. The whole file is also one JSON object: a format-3 reader refuses
its ``format_version`` as newer than its own, and tools read every section (`Manifest.from_json`).
Each rank of the save writes its own ``index-rNNNNN.json`` before it: its files
(size, checksum algorithm, header digest), the chunk it wrote of each tensor (file, offsets, sizes,
block digests) and the AdamW step counters of its parameters. A loading rank works out from the
placement which saved ranks wrote the tiles that meet its own boxes, and which keys of each
(`placement.index_keys_for`), and reads only those records of those indexes (`Manifest.merged`, then
`coverage_problems` checks that they tile its boxes); tools read them all and check the whole
(`structure_problems`). A checkpoint saved without a placement (a model `BoxMap` cannot place) has
one too, `null`: its loaders read every index whole.

Format 3 (still read): the same indexes, and a top ``manifest.json`` of one JSON document holding
every parameter, read whole by every rank.

Index layouts: a placed save writes keyed indexes (`KEYED_INDEX_VERSION`): a preamble of
`PREAMBLE_BYTES` (the header's length and crc32), a header (files, step, rank, the size of the digest
section, and a table of the length of each key's record, in the sorted order of every key (`KeyOrder`), runs
of keys it does not hold as one negative count), then one JSON record per line (a chunk's geometry:
its file's number in the header's sorted file names, offsets, sizes, rows per block, and where its
block digests lie in the digest section and how many there are; an optimizer state's also carries its
parameter's step counter), then the digest section: every chunk's block digests back to back, hex, at
the algorithm's fixed width (`checksum.DIGEST_CHARS`). A loader reads the preamble, the header, the
byte ranges of the records it needs, then those of the digests of the blocks whose rows meet its
boxes (`validate.read_index_keys`): a rank that needs half of a chunk reads its geometry and half of
its digests. Keyed indexes of version 4 (written before; still read) carry all their digests inside
each record. The fallback save, and every save before indexes were keyed, writes an index as one JSON
document (``format_version`` 3), read whole.

Format 2 (still read): one manifest naming every chunk of every rank with its block digests. Checksums
(formats 2-4): each file records its algorithm and the digest of its header; each chunk records the
digests of its row blocks (`block_rows` rows of the chunk each, the last one shorter). Together they
cover every byte of the file, and a rank that needs only some rows of a chunk (a resharding load) reads
and verifies only the blocks holding them. Format 1 (still read) had one sha256 per whole file.
Everything that is not a tensor (step, layout, LR schedule, data position, RNG states, AdamW step
counters) lives in JSON: the load path never unpickles.

Pure: no torch import, so `inspect` and the CLI can read manifests cheaply.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_left
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

from parallel.checkpoint.checksum import ALGORITHMS, DIGEST_CHARS, digest_fn

FORMAT = "elastron-checkpoint"
FORMAT_VERSION = 4
"""The newest format this code reads, and the one `CheckpointManager` writes."""
SECTIONED_VERSIONS = (4,)
"""Top-manifest formats split into a header and sections (`Manifest.to_json`), read by byte range."""
INDEX_DOCUMENT_VERSION = 3
"""The ``format_version`` of an index written as one JSON document (`Index.to_json`)."""
WHOLE_FORMAT = 2
"""The newest format whose manifest lists every chunk itself (what an in-memory `Manifest` serialises as
unless told otherwise)."""
MANIFEST_NAME = "manifest.json"
INDEX_FORMAT = "elastron-checkpoint-index"
KEYED_INDEX_VERSION = 5
"""The ``format_version`` of the index readable by key that `Index.to_bytes` writes with a key order: a
fixed-size preamble, a header with a table of where each key's record lies, the records, then the block
digests. An index that is one JSON document (``format_version`` 3: the fallback save's, and every index
written before indexes were keyed) is read whole."""
KEYED_VERSIONS = (4, 5)
"""Keyed index versions this code reads: 4 kept each chunk's block digests in its record."""
PREAMBLE_BYTES = 128
"""A keyed index's first line: ``{"format":...,"format_version":4,"header_bytes":N,"header_crc32":C}``
padded with spaces to this many bytes, the last a newline."""
_KEYED_MAGIC = re.compile(f'\\{{"format":"{INDEX_FORMAT}","format_version":\\d+,"header_bytes":'.encode())
_SECTIONED_MAGIC = re.compile(f'\\{{"format":"{FORMAT}","format_version":\\d+,"header_bytes":'.encode())
_SECTIONS_OPEN = b',"sections":['
_SECTIONS_CLOSE = b"]}\n"


def index_name(rank: int, shared: bool = False) -> str:
    """The file a saving rank describes its files and chunks in (formats 3-4); `shared`: the one for the
    boxes held beyond their data-parallel replicas (`placement.shared`), which every rank writes that
    writes any."""
    return f"index-r{rank:05d}{'-shared' if shared else ''}.json"


def shard_prefix(rank: int) -> str:
    """Every data file a rank writes starts with this (its index may list no other)."""
    return f"shard-r{rank:05d}-"

MODEL_PREFIX = "model."
"""Tensor keys of model parameters: ``model.<canonical name>``."""
OPTIM_PREFIX = "optim."
"""Tensor keys of optimizer state: ``optim.<state name>.<canonical name>`` (e.g. optim.exp_avg.output.weight)."""

_FIELDS = ("format", "format_version", "step", "created", "optimizer", "tensors", "files", "placement", "indexes",
           "params", "header_bytes", "header_crc32", "header", "sections", "parameters", "keys", "keys_crc32")

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
    """One digest per block of `block_rows` rows, in order (empty when the file's algorithm is none);
    with `blocks`, those of blocks [blocks[0], blocks[1]) only."""
    blocks: tuple[int, int] | None = None
    """None: `digests` holds every block's. (first, end): a loader read only the digests of these blocks
    (`validate.read_index_keys`): those whose rows meet its box."""

    @property
    def rows(self) -> int:
        return self.sizes[0] if self.sizes else 1

    @property
    def n_blocks(self) -> int:
        return -(-self.rows // self.block_rows) if self.block_rows else 0

    def digest(self, b: int) -> str | None:
        """The digest of block `b`; None if it is not held (beyond the chunk's blocks, or not read)."""
        i = b - (self.blocks[0] if self.blocks else 0)
        if self.blocks is not None and b >= self.blocks[1]:
            return None
        return self.digests[i] if 0 <= i < len(self.digests) else None

    def blocks_meeting(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int]:
        """(First, end) of the blocks whose rows meet the box [offsets, offsets + sizes): the blocks a
        load of the box reads and verifies (blocks are rows of dim 0; a 0-d chunk has one)."""
        if not self.block_rows:
            return 0, 0
        if not self.sizes:
            return 0, self.n_blocks
        lo = max(offsets[0], self.offsets[0]) - self.offsets[0]
        hi = min(offsets[0] + sizes[0], self.offsets[0] + self.sizes[0]) - self.offsets[0]
        if hi <= lo:
            return 0, 0
        return lo // self.block_rows, -(-hi // self.block_rows)

    def to_dict(self) -> dict[str, Any]:
        """The chunk's JSON record (in a format-2 manifest's tensor, or an index of one
        document)."""
        if self.blocks is not None:
            raise ValueError(f"a chunk in {self.file} holds the digests of blocks {list(self.blocks)} only: "
                             "it cannot be written as a record")
        d: dict[str, Any] = {"file": self.file, "offsets": list(self.offsets), "sizes": list(self.sizes)}
        if self.block_rows:
            d["block_rows"] = self.block_rows
            d["digests"] = list(self.digests)
        return d


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


@dataclass(frozen=True, slots=True)
class KeyOrder:
    """The checkpoint's keys in the order a keyed index's table lists them (sorted), as far as a reader
    knows them: how many there are and the crc32 of the whole list (which an index header must match),
    and the place of each key it knows. A format-4 top manifest read in part knows the keys of its
    sections read only."""

    count: int
    crc32: int
    at: dict[int, str]
    """Place in the order -> key, for the keys known."""

    @classmethod
    def of(cls, keys: list[str]) -> "KeyOrder":
        """The order of every key (`keys`, already in order)."""
        return cls(len(keys), _keys_crc(keys), dict(enumerate(keys)))


@dataclass(frozen=True, slots=True)
class Sections:
    """Format 4: where the sections of ``manifest.json`` lie, what they hold together, and which of them
    a `Manifest`'s tensors come from."""

    spans: tuple[tuple[int, int, int], ...]
    """(Offset in the file, bytes, crc32) of each section. With a placement, section s < pp holds the
    parameters of pipeline stage s of the saved layout, the one after them the tied table when two
    stages hold it (`placement.Placement.section`); without one, one section holds them all."""
    parameters: int
    """Parameters in all sections."""
    keys: int
    keys_crc32: int
    """How many keys the checkpoint has, and the crc32 of their sorted list (`KeyOrder`)."""
    states: tuple[str, ...] = ()
    """The optimizer state names every parameter has (sections spell their keys from them), or none:
    the sections list their keys one by one."""
    read: frozenset[int] = frozenset()
    """The sections whose tensors the manifest holds."""
    positions: dict[str, int] = field(default_factory=dict, compare=False)
    """Key -> its place in the sorted order of every key, for the keys of the sections read."""

    @property
    def complete(self) -> bool:
        return len(self.read) == len(self.spans)


@dataclass(kw_only=True, slots=True)
class Manifest:
    step: int
    """Optimizer steps completed when the checkpoint was taken."""
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    optimizer_steps: dict[str, int] = field(default_factory=dict)
    """AdamW's per-parameter step counters by canonical name. Kept out of the tensor files: DCP's
    consolidation writes 0-d tensors as zero (FACTS.md), and an integer needs no tensor. Formats 3-4 keep
    them in the indexes: a merged manifest has those of the indexes read."""
    optimizer_name: str = "AdamW"
    state: dict[str, Any] = field(default_factory=dict)
    """All other non-tensor state (layout, model_config, job_config_digest, lr_schedule, data, rng, ...),
    stored as top-level keys of the JSON document."""
    format_version: int = WHOLE_FORMAT
    created: float = field(default_factory=time.time)
    placement: dict[str, Any] | None = None
    """Formats 3-4: the layout the checkpoint was saved under (`placement.Placement.to_dict`), None when
    the save could not place its boxes by it (then every index is read)."""
    indexes: int = 0
    """Formats 3-4: the number of index files (``index-r00000.json`` ...), one per saving rank."""
    scope: str = "whole"
    """What the chunks and files cover: ``whole`` (formats 1-2, or format 3-4 with every index merged),
    ``top`` (a format-3-4 top manifest alone: no chunks), ``part`` (some indexes merged)."""
    sections: Sections | None = None
    """Format 4 as read: its sections, and which of them `tensors` holds (None: formats 1-3, or a
    manifest built in memory, whose tensors are all there)."""

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

    def optimizer_states(self) -> tuple[str, ...]:
        """The optimizer state names the tensors hold (``optim.<state>.<name>``), sorted."""
        return tuple(sorted({k[len(OPTIM_PREFIX):].split(".", 1)[0] for k in self.tensors
                             if k.startswith(OPTIM_PREFIX)}))

    def placement_of(self):
        """The `placement.Placement` of a format-3-4 manifest (None without one)."""
        from parallel.checkpoint.placement import Placement

        if self.placement is None:
            return None
        params = {n: (tuple(t.shape), t.dtype) for n, t in self.model_tensors().items()}
        return Placement.from_dict(self.placement, params)

    def section_rule(self):
        """(How many sections a format-4 top manifest has, parameter name -> the section holding it, or
        None where no section can): by the saved placement's pipeline stages, one section without it."""
        placement = self.placement_of()
        if placement is None:
            return 1, lambda name: 0
        return placement.n_sections, placement.section

    def sections_for(self, names) -> set[int]:
        """The sections of a format-4 manifest that hold the parameters `names` (canonical names)."""
        _, section = self.section_rule()
        return {i for n in names if (i := section(n)) is not None}

    def keys_in_order(self) -> "list[str] | KeyOrder":
        """The checkpoint's keys in the order keyed indexes list them (`key_order`); a format-4 manifest
        with some of its sections read: a `KeyOrder` of the keys of those."""
        sec = self.sections
        if sec is None or sec.complete:
            return key_order(self.tensors)
        return KeyOrder(sec.keys, sec.keys_crc32, {p: k for k, p in sec.positions.items()})

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        head = {"format": FORMAT, "format_version": self.format_version, "step": self.step, "created": self.created,
                **self.state}
        if self.format_version >= 3:  # the top manifest: no chunks, no files (they are in the indexes)
            params, states = self.model_tensors(), self.optimizer_states()
            spelled = {f"{p}{n}": (t.shape, t.dtype) for n, t in params.items()
                       for p in (MODEL_PREFIX, *(f"{OPTIM_PREFIX}{st}." for st in states))}
            if spelled == {k: (t.shape, t.dtype) for k, t in self.tensors.items()}:
                # Every parameter with the same optimizer states (AdamW's moments take its shape and
                # dtype): the parameters and the state names say it, a third of the bytes.
                tensors = {"params": {n: {"shape": list(t.shape), "dtype": t.dtype} for n, t in sorted(params.items())}}
            else:
                tensors = {"tensors": {k: {"shape": list(t.shape), "dtype": t.dtype} for k, t in sorted(self.tensors.items())}}
                states = ()
            return {**head, "optimizer": {"name": self.optimizer_name, "states": list(states)},
                    "placement": self.placement, "indexes": self.indexes, **tensors}
        return {
            **head,
            "optimizer": {"name": self.optimizer_name, "steps": dict(sorted(self.optimizer_steps.items()))},
            "tensors": {
                k: {"shape": list(t.shape), "dtype": t.dtype,
                    "chunks": [c.to_dict() for c in t.chunks]}
                for k, t in sorted(self.tensors.items())
            },
            "files": {k: f.to_dict() for k, f in sorted(self.files.items())},
        }

    def to_json(self) -> str:
        if self.format_version in SECTIONED_VERSIONS:
            return self._sectioned().decode()
        if self.format_version >= 3:  # read by every rank on every load: no indentation
            return json.dumps(self.to_dict(), separators=(",", ":"))
        return json.dumps(self.to_dict(), indent=1)

    def _sectioned(self) -> bytes:
        """Format 4: a preamble of `PREAMBLE_BYTES` (the header's length and crc32), the header (what a
        format-3 top manifest holds but the parameters, plus the length and crc32 of each section, the
        number of parameters and keys and the crc32 of the sorted keys), then the sections: each the
        shapes and dtypes of its parameters and where their keys fall in the sorted order of every key,
        as runs ``[first, count]``. Consecutive layers whose parameters have the same entries are written
        once (``repeats``, `_fold`): a section's size grows with the distinct layers, not the layer count. A loading rank reads the preamble, the header and the sections of the
        parameters it holds (`validate.read_sections`). The whole file is also one JSON object whose
        ``format_version`` a reader of format 3 refuses as too new."""
        d = self.to_dict()
        spelled = "params" in d
        entries = d.pop("params" if spelled else "tensors")
        del d["format"], d["format_version"]
        count, section = self.section_rule()
        groups: list[dict[str, Any]] = [{} for _ in range(count)]
        for name, e in entries.items():
            i = section(name if spelled else _param_of(name))
            if i is None:
                raise ValueError(f"parameter {name} belongs to no pipeline stage of the placement {self.placement}")
            groups[i][name] = e
        order = key_order(self.tensors)
        place = {k: i for i, k in enumerate(order)}
        states = d["optimizer"]["states"]
        parts = []
        for g in groups:
            keys = sorted(_spelled(g, states)) if spelled else sorted(g)
            listed, repeats = _fold(g)
            part = {"params" if spelled else "tensors": listed, **({"repeats": repeats} if repeats else {}),
                    "keys": _runs([place[k] for k in keys])}
            parts.append(json.dumps(part, separators=(",", ":")).encode())
        d.update(parameters=len(self.model_tensors()), keys=len(order), keys_crc32=_keys_crc(order),
                 sections=[[len(b), zlib.crc32(b)] for b in parts])
        header = json.dumps(d, separators=(",", ":")).encode()
        pre = json.dumps({"format": FORMAT, "format_version": self.format_version, "header_bytes": len(header),
                          "header_crc32": zlib.crc32(header)}, separators=(",", ":"))[:-1] + ',"header":'
        return (pre.ljust(PREAMBLE_BYTES - 1).encode() + b"\n" + header + _SECTIONS_OPEN + b",".join(parts)
                + _SECTIONS_CLOSE)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        """Parse and type-check a manifest; raises ManifestError saying what is wrong. The text may come
        from untrusted storage, so every field is checked rather than trusted. Format 4: the whole file
        (every section read), or its preamble and header alone (no section read: add them with
        `with_sections`)."""
        raw = text.encode() if isinstance(text, str) else text
        size = manifest_header_size(raw[:PREAMBLE_BYTES])
        if size is None:
            return cls.from_dict(_load_json(text, "manifest"))
        n, crc, version = size
        head = cls.from_header(raw[PREAMBLE_BYTES:PREAMBLE_BYTES + n], crc, version)
        if len(raw) == PREAMBLE_BYTES + n:
            return head
        spans = head.sections.spans
        end = spans[-1][0] + spans[-1][1] + len(_SECTIONS_CLOSE)
        if len(raw) != end or raw[PREAMBLE_BYTES + n:spans[0][0]] != _SECTIONS_OPEN:
            raise ManifestError(f"{MANIFEST_NAME} is {len(raw)} bytes, its header says {end} (truncated or corrupted)")
        return head.with_sections({i: raw[a:a + m] for i, (a, m, _) in enumerate(spans)})

    @classmethod
    def from_header(cls, data: bytes, crc: int, version: int) -> "Manifest":
        """A format-4 top manifest from its header bytes (after the preamble, whose `crc` they must
        match): everything but the parameters, which its sections hold (none read yet)."""
        if zlib.crc32(data) != crc:
            raise ManifestError(f"{MANIFEST_NAME}: its header fails its crc32 check: the checkpoint is corrupted")
        d = _load_json(data, f"{MANIFEST_NAME} header")
        if not isinstance(d, dict):
            raise ManifestError(f"{MANIFEST_NAME}: its header must be a JSON object")
        table, counts = d.pop("sections", None), [d.pop(k, None) for k in ("parameters", "keys", "keys_crc32")]
        if not (isinstance(table, list) and table and all(
                isinstance(x, list) and len(x) == 2 and all(_is_int(v) and v >= 0 for v in x) for x in table)
                and all(_is_int(v) and v >= 0 for v in counts)):
            raise ManifestError(f"{MANIFEST_NAME}: its header needs a section table of [bytes, crc32] pairs and the "
                                "number of parameters and keys")
        opt = d.get("optimizer")
        states = opt.get("states", []) if isinstance(opt, dict) else []
        m = cls.from_dict({**d, "format": FORMAT, "format_version": version, "params": {}})
        need = m.section_rule()[0]
        if len(table) != need:
            raise ManifestError(f"{MANIFEST_NAME} has {len(table)} section(s); its placement makes {need} (corrupted)")
        spans, at = [], PREAMBLE_BYTES + len(data) + len(_SECTIONS_OPEN)
        for n, c in table:
            spans.append((at, n, c))
            at += n + 1  # the comma between sections
        m.sections = Sections(spans=tuple(spans), parameters=counts[0], keys=counts[1], keys_crc32=counts[2],
                              states=tuple(states))
        return m

    def with_sections(self, raw: dict[int, bytes]) -> "Manifest":
        """This format-4 manifest with the tensors of the sections `raw` (section number -> its bytes)
        added; raises ManifestError for a section that is truncated, fails its crc32 or is malformed.
        Once every section is in, the keys must be the ones the header counts."""
        sec = self.sections
        if sec is None:
            raise ValueError("only a format-4 manifest has sections")
        tensors, positions = dict(self.tensors), dict(sec.positions)
        for i, data in sorted(raw.items()):
            where = f"{MANIFEST_NAME} section {i}"
            if not 0 <= i < len(sec.spans):
                raise ValueError(f"{MANIFEST_NAME} has no section {i}")
            if len(data) != sec.spans[i][1]:
                raise ManifestError(f"{MANIFEST_NAME} ends inside section {i} (truncated)")
            if zlib.crc32(data) != sec.spans[i][2]:
                raise ManifestError(f"{where} fails its crc32 check: the checkpoint is corrupted")
            d = _load_json(data, where)
            spelled = isinstance(d, dict) and "params" in d
            listed = d.get("params" if spelled else "tensors") if isinstance(d, dict) else None
            if not isinstance(listed, dict):
                raise ManifestError(f"{where} needs a 'params' or 'tensors' object")
            listed = _unfold(listed, d.get("repeats", []), sec.parameters if spelled else sec.keys, where)
            entries = _spelled(listed, list(sec.states)) if spelled else listed
            got = {str(k): _tensor(k, v, chunks=False) for k, v in entries.items()}
            keys = sorted(got)
            positions.update(zip(keys, _places(d.get("keys"), len(keys), sec.keys, where)))
            tensors.update(got)
        if len(set(positions.values())) != len(positions):
            raise ManifestError(f"{MANIFEST_NAME}: its sections give two keys one place in the key order (corrupted)")
        sections = replace(sec, read=sec.read | frozenset(raw), positions=positions)
        if sections.complete:
            order = key_order(tensors)
            if (len(order) != sec.keys or _keys_crc(order) != sec.keys_crc32
                    or any(positions[k] != i for i, k in enumerate(order))):
                raise ManifestError(f"{MANIFEST_NAME}: its sections hold {len(order)} keys, not the {sec.keys} its "
                                    "header counts in that order (corrupted)")
        return replace(self, tensors=tensors, sections=sections)

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
        steps = _steps(opt.get("steps", {}), "manifest optimizer.steps")
        tensors_d = d.get("tensors")
        if version >= 3 and "params" in d:
            tensors_d = _spelled(d["params"], opt.get("states", []))
        files_d = d.get("files", {} if version >= 3 else None)
        if not isinstance(tensors_d, dict) or not isinstance(files_d, dict):
            raise ManifestError("manifest needs 'tensors' and 'files' objects")
        tensors = {str(k): _tensor(k, v, chunks=version < 3) for k, v in tensors_d.items()}
        files = {str(k): _file(k, v) for k, v in files_d.items()}
        created = d.get("created", 0.0)
        m = cls(
            step=_int(d, "step"),
            tensors=tensors,
            files=files,
            optimizer_steps=steps,
            optimizer_name=str(opt.get("name", "AdamW")),
            state={k: v for k, v in d.items() if k not in _FIELDS},
            format_version=version,
            created=float(created) if isinstance(created, (int, float)) else 0.0,
        )
        if version >= 3:
            m.indexes, m.placement, m.scope = _int(d, "indexes"), d.get("placement"), "top"
            if m.indexes < 1:
                raise ManifestError("manifest indexes must be at least 1 (one index file per saving rank)")
            try:
                m.placement_of()
            except ValueError as e:
                raise ManifestError(f"manifest placement is malformed: {e}") from None
        return m

    def merged(self, indexes: list["Index"], *, whole: bool) -> tuple["Manifest", list[str]]:
        """(This top manifest with the chunks, files and step counters of `indexes`, problems found on
        the way). `whole`: every index of the checkpoint is among them (then `structure_problems` checks
        the whole); else the result covers only what those indexes describe (`coverage_problems`)."""
        chunks: dict[str, list[Chunk]] = {k: [] for k in self.tensors}
        files: dict[str, FileEntry] = {}
        steps: dict[str, int] = {}
        problems: list[str] = []
        for ix in indexes:
            problems += ix.problems(self.tensors)
            files.update(ix.files)
            for key, c in ix.chunks.items():
                if key in chunks:
                    chunks[key].append(c)
            for p, n in ix.optimizer_steps.items():
                if steps.setdefault(p, n) != n:
                    problems.append(f"indexes disagree on the optimizer step of {p}: {steps[p]} vs {n}")
        tensors = {k: TensorEntry(shape=t.shape, dtype=t.dtype, chunks=tuple(sorted(chunks[k], key=lambda c: c.offsets)))
                   for k, t in self.tensors.items()}
        out = Manifest(step=self.step, tensors=tensors, files=files, optimizer_steps=steps,
                       optimizer_name=self.optimizer_name, state=self.state, format_version=self.format_version,
                       created=self.created, placement=self.placement, indexes=self.indexes,
                       scope="whole" if whole else "part", sections=self.sections)
        return out, problems

    # -- checks ------------------------------------------------------------------------------------
    def structure_problems(self) -> list[str]:
        """Chunks that fall outside their tensor, overlap, leave holes, or name unlisted files; files
        too small for the chunks they are said to hold (so a forged manifest cannot make a loader
        allocate more than the checkpoint's size). A format-3-4 top manifest alone (scope ``top``) has
        no chunks: only its dtypes are checked (`coverage_problems` checks a rank's part, once read)."""
        problems: list[str] = []
        if self.scope != "whole":
            return [f"tensor {key}: unsupported dtype {t.dtype!r}" for key, t in self.tensors.items()
                    if t.dtype not in ITEMSIZE]
        in_file: dict[str, int] = dict.fromkeys(self.files, 0)
        for key, t in self.tensors.items():
            if t.dtype not in ITEMSIZE:
                problems.append(f"tensor {key}: unsupported dtype {t.dtype!r}")
                continue
            covered = 0
            boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
            for c in t.chunks:
                found, fits = _chunk_problems(key, c, t, self.files, in_file, lister="the manifest")
                problems += found
                if fits:
                    boxes.append((c.offsets, c.sizes))
                    covered += math.prod(c.sizes)
            problems += [f"tensor {key}: chunks at {list(a)} and {list(b)} overlap" for a, b in _overlapping(boxes)]
            if covered != math.prod(t.shape):
                problems.append(f"tensor {key}: chunks cover {covered} of {math.prod(t.shape)} elements")
        for name, nbytes in sorted(in_file.items()):
            if nbytes > self.files[name].size:
                problems.append(f"file {name}: its chunks need {nbytes} bytes but the file has {self.files[name].size}")
        return problems

    def coverage_problems(self, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str]:
        """Whether the chunks merged in (scope ``part``) tile each of `boxes` (key -> (offsets, sizes) a
        rank loads) exactly: what one rank checks of a format-3-4 checkpoint before reading; the ranks'
        boxes together cover every tensor. Also that every parameter whose moments it loads has its
        step counter. The chunks' own fit and checksums were checked per index (`Index.problems`)."""
        problems: list[str] = []
        for key, (offsets, sizes) in sorted(boxes.items()):
            t = self.tensors.get(key)
            if t is None:
                problems.append(f"the checkpoint has no tensor {key}")
                continue
            meet = t.meeting(offsets, sizes)
            covered = sum(math.prod(min(a + n, b + m) - max(a, b) for a, n, b, m in zip(offsets, sizes, c.offsets, c.sizes))
                          for c in meet)
            problems += [f"tensor {key}: chunks at {list(a)} and {list(b)} overlap"
                         for a, b in _overlapping([(c.offsets, c.sizes) for c in meet])]
            if covered != math.prod(sizes):
                problems.append(f"tensor {key}: the indexes read cover {covered} of the {math.prod(sizes)} elements "
                                f"of the box at {list(offsets)} (an index is missing chunks)")
            if key.startswith(OPTIM_PREFIX) and key[len(OPTIM_PREFIX):].split(".", 1)[1] not in self.optimizer_steps:
                problems.append(f"tensor {key}: no index read has the optimizer step of its parameter")
        return problems

    def model_problems(self, expected: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
        """Differences between the checkpoint's model tensors and the model about to receive them
        (`expected`: canonical name -> (global shape, dtype name)). Shape mismatches come first: they show
        both shapes, the clearest sign of a different model when only the first problem is shown. A
        format-4 manifest with some sections read compares the parameters of those sections (and the
        number of parameters in all)."""
        have = self.model_tensors()
        shapes, others = [], []
        sec = self.sections
        if sec is not None and not sec.complete:
            if len(expected) != sec.parameters:
                others.append(f"the checkpoint has {sec.parameters} parameters but the model {len(expected)} "
                              "(different model shape)")
            _, section = self.section_rule()
            expected = {n: v for n, v in expected.items() if (i := section(n)) is None or i in sec.read}
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


def _chunk_problems(key: str, c: Chunk, t: TensorEntry, files: dict[str, "FileEntry"], in_file: dict[str, int], *,
                    lister: str) -> tuple[list[str], bool]:
    """One chunk's problems: a file `lister` (the manifest, an index) does not list, a box outside its
    tensor (then nothing more is checked), its block digests. Adds its bytes to `in_file`; returns the
    problems and whether it fits its tensor."""
    out = [f"tensor {key}: chunk in file {c.file!r}, which {lister} does not list"] if c.file not in files else []
    if not _fits(c, t):
        return out + [f"tensor {key}: chunk offsets {list(c.offsets)} sizes {list(c.sizes)} "
                      f"do not fit shape {list(t.shape)}"], False
    if t.dtype in ITEMSIZE and c.file in in_file:
        in_file[c.file] += math.prod(c.sizes) * ITEMSIZE[t.dtype]
    return out + _block_problems(key, c, files.get(c.file)), True


def _block_problems(key: str, c: Chunk, f: FileEntry | None) -> list[str]:
    if f is None or not f.blockwise:
        return []
    if c.block_rows < 1:
        return [f"tensor {key}: chunk in {c.file} has no checksum blocks"]
    if c.blocks is not None:  # a part read by a loader: checked against its record as it was read
        b0, b1 = c.blocks
        if f.algorithm != "none" and not (0 <= b0 <= b1 <= c.n_blocks and len(c.digests) == b1 - b0):
            return [f"tensor {key}: chunk in {c.file} has {len(c.digests)} digests for its blocks {b0}-{b1} "
                    f"of {c.n_blocks}"]
        return []
    if f.algorithm != "none" and len(c.digests) != c.n_blocks:
        return [f"tensor {key}: chunk in {c.file} has {len(c.digests)} block digests, expected {c.n_blocks}"]
    return []


def _preamble_fields(d: Any, where: str) -> tuple[int, int, int]:
    """(header_bytes, header_crc32, format_version) of a parsed preamble (None: it did not parse), else a
    one-line ManifestError naming the file, `where`."""
    n, crc, v = ((d.get("header_bytes"), d.get("header_crc32"), d.get("format_version")) if isinstance(d, dict)
                 else (None, None, None))
    if not (_is_int(n) and n > 0 and _is_int(crc) and _is_int(v)):
        raise ManifestError(f"{where}: its preamble (the first {PREAMBLE_BYTES} bytes) is damaged: the checkpoint "
                            "is corrupted")
    return n, crc, v


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


def _chunk(key: Any, c: Any) -> Chunk:
    if not isinstance(c, dict) or not isinstance(c.get("file"), str):
        raise ManifestError(f"manifest tensor {key!r} has a malformed chunk {c!r}")
    block_rows, digests = c.get("block_rows", 0), c.get("digests", [])
    if not _is_int(block_rows) or block_rows < 0 or not isinstance(digests, list) or not all(
            isinstance(x, str) for x in digests):
        raise ManifestError(f"manifest tensor {key!r} has malformed chunk checksums")
    return Chunk(file=c["file"], offsets=_ints(c.get("offsets"), f"tensor {key!r} chunk offsets"),
                 sizes=_ints(c.get("sizes"), f"tensor {key!r} chunk sizes"),
                 block_rows=block_rows, digests=tuple(digests))


def _tensor(key: Any, v: Any, *, chunks: bool = True) -> TensorEntry:
    """A tensor entry; `chunks=False` (a format-3-4 top manifest): shape and dtype only."""
    if not isinstance(v, dict) or not isinstance(v.get("dtype"), str) or (
            chunks and not isinstance(v.get("chunks"), list)):
        raise ManifestError(f"manifest tensor {key!r} needs shape, dtype" + (" and chunks" if chunks else ""))
    return TensorEntry(shape=_ints(v.get("shape"), f"tensor {key!r} shape"), dtype=v["dtype"],
                       chunks=tuple(_chunk(key, c) for c in v["chunks"]) if chunks else ())


def _spelled(params: Any, states: Any) -> dict[str, Any]:
    """A format-3 top manifest's (or a format-4 section's) tensors from its parameters and optimizer state names."""
    if not isinstance(params, dict) or not isinstance(states, list) or not all(
            isinstance(s, str) and s and "." not in s for s in states):
        raise ManifestError("manifest params must be an object and optimizer.states a list of names")
    return {f"{p}{n}": v for n, v in params.items() for p in (MODEL_PREFIX, *(f"{OPTIM_PREFIX}{s}." for s in states))}


def _param_of(key: str) -> str:
    """``model.<p>``, ``optim.<state>.<p>`` -> ``<p>``."""
    return _param(key) if key.startswith(OPTIM_PREFIX) else key.removeprefix(MODEL_PREFIX)


_NUMBERED = re.compile(r"(.+?\.)(0|[1-9][0-9]*)(\..+)")
"""A name with a number between dots (the first such: ``layers.<n>.attention.wq.weight``), written
without leading zeros so that the number spells the name back."""


def _fold(entries: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A format-4 section's entries (name -> its JSON entry) as (those listed one by one, repeats): a
    run of two or more consecutive numbers n whose names ``<prefix><n><rest>`` hold the same rests with
    the same entries (a model's transformer layers) is written once, ``{"prefix", "first", "count",
    "entries": {rest: entry}}``; any layer that differs (another shape, dtype or parameter set) ends
    the run, and names outside every run stay listed (`_unfold` reverses it)."""
    layers: dict[str, dict[int, dict[str, Any]]] = {}
    for name, e in entries.items():
        if m := _NUMBERED.fullmatch(name):
            layers.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = e
    listed, repeats = dict(entries), []
    for prefix, by_n in sorted(layers.items()):
        ns = sorted(by_n)
        i = 0
        while i < len(ns):
            j = i + 1
            while j < len(ns) and ns[j] == ns[j - 1] + 1 and by_n[ns[j]] == by_n[ns[i]]:
                j += 1
            if j - i > 1:
                for n in ns[i:j]:
                    for rest in by_n[n]:
                        del listed[f"{prefix}{n}{rest}"]
                repeats.append({"prefix": prefix, "first": ns[i], "count": j - i,
                                "entries": dict(sorted(by_n[ns[i]].items()))})
            i = j
    return dict(sorted(listed.items())), repeats


def _unfold(listed: dict[str, Any], repeats: Any, most: int, where: str) -> dict[str, Any]:
    """A section's entries from those it lists and its repeats (`_fold`); at most `most` in all (the
    header's count: a forged repeat cannot make a reader spell millions of names). Raises ManifestError
    for a malformed repeat or a name given twice."""
    if not isinstance(repeats, list) or not all(
            isinstance(r, dict) and isinstance(r.get("prefix"), str) and _is_int(r.get("first")) and r["first"] >= 0
            and _is_int(r.get("count")) and r["count"] > 0 and isinstance(r.get("entries"), dict) for r in repeats):
        raise ManifestError(f"{where}: its 'repeats' must be objects with a prefix, first >= 0, count > 0 and "
                            "entries")
    total = len(listed) + sum(r["count"] * len(r["entries"]) for r in repeats)
    if total > most:
        raise ManifestError(f"{where} holds {total} entries, more than the {most} its header counts (corrupted)")
    out = dict(listed)
    for r in repeats:
        for n in range(r["first"], r["first"] + r["count"]):
            for rest, e in r["entries"].items():
                name = f"{r['prefix']}{n}{rest}"
                if out.setdefault(name, e) is not e:
                    raise ManifestError(f"{where} gives {name} twice (corrupted)")
    return out


def _runs(places: list[int]) -> list[list[int]]:
    """Increasing places as runs ``[first, count]`` of consecutive ones."""
    out: list[list[int]] = []
    for p in places:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return out


def _places(runs: Any, n: int, total: int, where: str) -> list[int]:
    """The `n` places in the key order (of `total` keys) that `runs` (``[first, count]`` each) spell."""
    if not isinstance(runs, list) or not all(
            isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and r[0] >= 0 and r[1] > 0
            and r[0] + r[1] <= total for r in runs):
        raise ManifestError(f"{where}: its 'keys' must be runs [first, count] within the {total} keys")
    out = [p for a, c in runs for p in range(a, a + c)]
    if len(out) != n:
        raise ManifestError(f"{where} places {len(out)} keys but holds {n} (corrupted)")
    return out


def manifest_header_size(preamble: bytes) -> tuple[int, int, int] | None:
    """(Header bytes, header crc32, format version) from the first `PREAMBLE_BYTES` bytes of a format-4
    ``manifest.json``; None when the manifest is one JSON document (formats 1-3: read it whole). Raises
    ManifestError for a damaged preamble or a version newer than this code reads."""
    if not _SECTIONED_MAGIC.match(preamble):
        return None
    text, tail = preamble.rstrip(), b',"header":'
    d = None
    if len(preamble) == PREAMBLE_BYTES and preamble.endswith(b"\n") and text.endswith(tail):
        try:
            d = json.loads(text[:-len(tail)] + b"}")
        except ValueError:
            d = None
    n, crc, v = _preamble_fields(d, MANIFEST_NAME)
    if v > FORMAT_VERSION:
        raise ManifestError(f"manifest format_version {v} is newer than this code reads ({FORMAT_VERSION}): load it "
                            "with a newer Elastron")
    if v not in SECTIONED_VERSIONS:
        raise ManifestError(f"{MANIFEST_NAME}: format_version {v} has no preamble (corrupted)")
    return n, crc, v


def _load_json(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:  # a forged, deeply nested document: a verdict, not a crash of the loader
        raise ManifestError(f"{what} is nested too deeply to be a checkpoint manifest") from None


def _steps(v: Any, what: str) -> dict[str, int]:
    if not isinstance(v, dict) or not all(_is_int(x) for x in v.values()):
        raise ManifestError(f"{what} must map names to integers")
    return {str(k): int(x) for k, x in v.items()}


def _fits(c: Chunk, t: TensorEntry) -> bool:
    return len(c.offsets) == len(t.shape) and len(c.sizes) == len(t.shape) and all(
        o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(c.offsets, c.sizes, t.shape))


@dataclass(kw_only=True, slots=True)
class Index:
    """One saving rank's part of a format-3-4 checkpoint (``index-rNNNNN.json``): its files, the chunk it
    wrote of each tensor, and the AdamW step counters of the parameters it holds."""

    rank: int
    step: int
    shared: bool = False
    """The rank's shared index (`index_name`)."""
    files: dict[str, FileEntry] = field(default_factory=dict)
    chunks: dict[str, Chunk] = field(default_factory=dict)
    """Key -> the one box of it this rank wrote (a rank writes at most one box per tensor)."""
    optimizer_steps: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({
            "format": INDEX_FORMAT, "format_version": INDEX_DOCUMENT_VERSION, "step": self.step, "rank": self.rank,
            "shared": self.shared,
            "optimizer_steps": dict(sorted(self.optimizer_steps.items())),
            "files": {k: f.to_dict() for k, f in sorted(self.files.items())},
            "chunks": {k: c.to_dict() for k, c in sorted(self.chunks.items())},
        }, separators=(",", ":"))

    def to_bytes(self, keys: list[str] | None = None) -> bytes:
        """The index file. `keys`: the checkpoint's keys in order (`key_order` of the top manifest's
        tensors): a keyed index (`KEYED_INDEX_VERSION`), whose header maps each key to the byte range
        of its chunk record, and each record to its block digests in the digest section, so a loader
        reads the records of the keys it meets and the digests of the blocks it reads, no other. Each
        record of an optimizer state carries its parameter's step counter (``step``). None: one JSON
        document (`to_json`)."""
        if keys is None:
            return self.to_json().encode()
        where = index_name(self.rank, self.shared)
        unknown = sorted(set(self.chunks) - set(keys))
        if unknown:
            raise ValueError(f"{where}: key {unknown[0]} is not in the key order")
        names = sorted(self.files)
        number = {n: i for i, n in enumerate(names)}
        table: list[int] = []
        records: list[bytes] = []
        digests: list[bytes] = []
        at = skip = 0
        for key in keys:
            c = self.chunks.get(key)
            if c is None:
                skip += 1
                continue
            if skip:
                table.append(-skip)
                skip = 0
            if c.file not in number or c.blocks is not None:
                raise ValueError(f"{where}: the chunk of {key} is in {c.file}, which the index does not list"
                                 if c.file not in number else f"{where}: the chunk of {key} lacks some digests")
            rec: dict[str, Any] = {"file": number[c.file], "offsets": list(c.offsets), "sizes": list(c.sizes)}
            if c.block_rows:
                width = DIGEST_CHARS[self.files[c.file].algorithm]
                if any(len(d) != width for d in c.digests):
                    raise ValueError(f"{where}: a block digest of {key} is not {width} characters long")
                rec["block_rows"] = c.block_rows
                rec["digests"] = [at, len(c.digests)]
                digests.append("".join(c.digests).encode("ascii"))
                at += len(digests[-1])
            if key.startswith(OPTIM_PREFIX) and _param(key) in self.optimizer_steps:
                rec["step"] = self.optimizer_steps[_param(key)]
            records.append(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
            table.append(len(records[-1]))
        if skip:
            table.append(-skip)
        header = json.dumps({
            "step": self.step, "rank": self.rank, "shared": self.shared,
            "files": {k: self.files[k].to_dict() for k in names},
            "keys": len(keys), "keys_crc32": _keys_crc(keys), "table": table, "digest_bytes": at,
        }, separators=(",", ":")).encode() + b"\n"
        pre = json.dumps({"format": INDEX_FORMAT, "format_version": KEYED_INDEX_VERSION,
                          "header_bytes": len(header), "header_crc32": zlib.crc32(header)}, separators=(",", ":"))
        return pre.ljust(PREAMBLE_BYTES - 1).encode() + b"\n" + header + b"".join(records) + b"".join(digests)

    @classmethod
    def from_bytes(cls, data: bytes, *, rank: int, step: int, shared: bool = False,
                   keys: "list[str] | KeyOrder") -> "Index":
        """Parse a whole index file of either layout (`keys`: the top manifest's key order, which a
        keyed index must have been written with)."""
        size = header_size(data[:PREAMBLE_BYTES], rank=rank, shared=shared)
        if size is None:
            return cls.from_json(data, rank=rank, step=step, shared=shared)
        head = IndexHeader.parse(data[PREAMBLE_BYTES:PREAMBLE_BYTES + size[0]], size[1], rank=rank, step=step,
                                 shared=shared, keys=keys, version=size[2])
        if len(data) != head.end:
            raise ManifestError(f"{index_name(rank, shared)} is {len(data)} bytes, its key table says {head.end} "
                                "(truncated or corrupted)")
        records = head.records({k: data[a:a + n] for k, (a, n) in head.spans.items()})
        return head.index(records, {k: (b0, b1, data[a:a + n])
                                    for k, (a, n, (b0, b1)) in head.digest_ranges(records).items()})

    @classmethod
    def from_json(cls, text: str | bytes, *, rank: int, step: int, shared: bool = False) -> "Index":
        """Parse and type-check the index of saving rank `rank` of the checkpoint of `step`; raises
        ManifestError saying what is wrong (also for another rank's or another step's index, and for a
        file name that is not one of this rank's)."""
        where = index_name(rank, shared)
        d = _load_json(text, where)
        if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT:
            raise ManifestError(f"{where} is not a checkpoint index (format {d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("rank") != rank or d.get("step") != step or bool(d.get("shared")) != shared:
            raise ManifestError(f"{where} describes rank {d.get('rank')!r} of step {d.get('step')!r} "
                                f"(shared: {d.get('shared')!r}), not rank {rank} of step {step}")
        files_d, chunks_d = d.get("files"), d.get("chunks")
        if not isinstance(files_d, dict) or not isinstance(chunks_d, dict):
            raise ManifestError(f"{where} needs 'files' and 'chunks' objects")
        files = {str(k): _file(k, v) for k, v in files_d.items()}
        bad = sorted(n for n in files if not n.startswith(shard_prefix(rank)))
        if bad:
            raise ManifestError(f"{where} lists {bad[0]}, which is not a file of rank {rank}")
        return cls(rank=rank, step=step, shared=shared, files=files, chunks={str(k): _chunk(k, v) for k, v in chunks_d.items()},
                   optimizer_steps=_steps(d.get("optimizer_steps", {}), f"{where} optimizer_steps"))

    def problems(self, tensors: dict[str, TensorEntry]) -> list[str]:
        """Chunks of tensors the top manifest does not have, or that fall outside their tensor, name a
        file this index does not list, or lack block digests; files too small for their chunks."""
        where = index_name(self.rank, self.shared)
        out: list[str] = []
        in_file = dict.fromkeys(self.files, 0)
        for key, c in sorted(self.chunks.items()):
            t = tensors.get(key)
            if t is None:
                out.append(f"{where}: tensor {key} is not in the manifest")
                continue
            out += _chunk_problems(key, c, t, self.files, in_file, lister=where)[0]
        out += [f"file {n}: its chunks need {b} bytes but the file has {self.files[n].size}"
                for n, b in sorted(in_file.items()) if b > self.files[n].size]
        return out


def key_order(tensors) -> list[str]:
    """The order a keyed index's table lists the checkpoint's keys in: sorted."""
    return sorted(tensors)


def _keys_crc(keys: list[str]) -> int:
    return zlib.crc32("\n".join(keys).encode())


def _param(key: str) -> str:
    """``optim.<state>.<p>`` -> ``<p>``."""
    return key[len(OPTIM_PREFIX):].split(".", 1)[1]


def header_size(preamble: bytes, *, rank: int, shared: bool = False) -> tuple[int, int, int] | None:
    """(Header bytes, header crc32, keyed version) from the first `PREAMBLE_BYTES` bytes of a keyed
    index; None when the file is an index of one JSON document (read it whole). Raises ManifestError
    for a keyed index whose preamble is damaged or of a version this code does not read."""
    if not _KEYED_MAGIC.match(preamble):
        return None
    where = index_name(rank, shared)
    try:
        d = json.loads(preamble) if len(preamble) == PREAMBLE_BYTES and preamble.endswith(b"\n") else None
    except ValueError:
        d = None
    n, crc, v = _preamble_fields(d, where)
    if v not in KEYED_VERSIONS:
        raise ManifestError(f"{where} is a keyed index of version {v}; this code reads versions "
                            f"{', '.join(map(str, KEYED_VERSIONS))}: load it with a newer Elastron")
    return n, crc, v


@dataclass(frozen=True, slots=True)
class Record:
    """One key's record of a keyed index, parsed: its chunk (version 4: with every block digest;
    version 5: none yet), its parameter's step counter, and where its digests lie (version 5)."""

    chunk: Chunk
    step: int | None
    digests: tuple[int, int] | None
    """(Offset in the digest section, count); None in version 4."""


@dataclass(frozen=True, slots=True)
class IndexHeader:
    """A keyed index's header: its files, and where in the file the record of each key it holds lies."""

    rank: int
    step: int
    shared: bool
    files: dict[str, FileEntry]
    spans: dict[str, tuple[int, int]]
    """Key -> (byte offset in the file, length) of its chunk record."""
    end: int
    """The file's size, as the table gives it."""
    version: int = KEYED_INDEX_VERSION
    digests_at: int = 0
    """Where the digest section starts (version 5: after the last record)."""

    @classmethod
    def parse(cls, data: bytes, crc: int, *, rank: int, step: int, shared: bool, keys: "list[str] | KeyOrder",
              version: int = KEYED_INDEX_VERSION) -> "IndexHeader":
        """Check and parse the header bytes (after the preamble, whose `crc` they must match) of the
        keyed index (of `version`) of saving rank `rank` of `step`, against the top manifest's key
        order `keys` (every key, or a `KeyOrder` of those known: the spans of the others are left out);
        raises ManifestError naming the file and what is wrong."""
        where = index_name(rank, shared)
        order = keys if isinstance(keys, KeyOrder) else KeyOrder.of(keys)
        if zlib.crc32(data) != crc:
            raise ManifestError(f"{where}: its header (key table, files) fails its crc32 check: the checkpoint is "
                                "corrupted")
        d = _load_json(data, f"{where} header")
        if not isinstance(d, dict) or d.get("rank") != rank or d.get("step") != step or bool(d.get("shared")) != shared:
            raise ManifestError(f"{where} describes rank {d.get('rank') if isinstance(d, dict) else None!r} of step "
                                f"{d.get('step') if isinstance(d, dict) else None!r}, not rank {rank} of step {step}")
        if d.get("keys") != order.count or d.get("keys_crc32") != order.crc32:
            raise ManifestError(f"{where}: its key table was written for {d.get('keys')!r} keys in another order than "
                                f"the manifest's {order.count} (an index of another checkpoint?)")
        table, files_d, digest_bytes = d.get("table"), d.get("files"), d.get("digest_bytes", 0 if version < 5 else None)
        if not isinstance(files_d, dict) or not isinstance(table, list) or not all(_is_int(x) and x != 0 for x in table):
            raise ManifestError(f"{where}: its header needs 'files' and a key table of non-zero integers")
        if not _is_int(digest_bytes) or digest_bytes < 0:
            raise ManifestError(f"{where}: its header needs the size of its digest section (digest_bytes)")
        files = {str(k): _file(k, v) for k, v in files_d.items()}
        bad = sorted(n for n in files if not n.startswith(shard_prefix(rank)))
        if bad:
            raise ManifestError(f"{where} lists {bad[0]}, which is not a file of rank {rank}")
        spans: dict[str, tuple[int, int]] = {}
        pos, at = 0, PREAMBLE_BYTES + len(data)
        for x in table:
            if x < 0:
                pos -= x
                continue
            if pos >= order.count:
                pos += 1
                break
            if (key := order.at.get(pos)) is not None:
                spans[key] = (at, x)
            pos, at = pos + 1, at + x
        if pos != order.count:
            raise ManifestError(f"{where}: its key table spans {pos} keys, the manifest has {order.count}: the "
                                "checkpoint is corrupted")
        return cls(rank=rank, step=step, shared=shared, files=files, spans=spans, end=at + digest_bytes,
                   version=version, digests_at=at)

    def ranges(self, keys, gap: int = 0) -> list[tuple[int, int, list[str]]]:
        """(Offset, length, keys) of the records of those of `keys` this index holds, in file order; two
        records at most `gap` bytes apart share one range (0: only adjacent ones; more: fewer requests
        for the bytes of the records between, read and dropped)."""
        out: list[tuple[int, int, list[str]]] = []
        for at, n, key in sorted((*self.spans[k], k) for k in keys if k in self.spans):
            if out and at - (out[-1][0] + out[-1][1]) <= gap:
                out[-1] = (out[-1][0], at + n - out[-1][0], out[-1][2] + [key])
            else:
                out.append((at, n, [key]))
        return out

    def records(self, raw: dict[str, bytes]) -> dict[str, Record]:
        """Parse the records read (key -> its record's bytes); raises ManifestError naming the file and
        the key for a truncated or malformed one."""
        where = index_name(self.rank, self.shared)
        names = sorted(self.files)
        out: dict[str, Record] = {}
        for key, data in raw.items():
            if len(data) != self.spans[key][1]:
                raise ManifestError(f"{where} ends inside the record of {key} (truncated)")
            try:
                rec = json.loads(data)
            except (ValueError, UnicodeDecodeError, RecursionError):
                rec = None
            if not isinstance(rec, dict):
                raise ManifestError(f"{where}: the record of {key} at bytes {self.spans[key][0]}+{len(data)} is not a "
                                    "JSON object (corrupted key table or records)")
            step = rec.get("step")
            if step is not None and (not _is_int(step) or not key.startswith(OPTIM_PREFIX)):
                raise ManifestError(f"{where}: the record of {key} has a malformed step counter")
            if self.version < 5:
                out[key] = Record(_chunk(key, rec), step, None)
                continue
            f, span = rec.get("file"), rec.get("digests", [0, 0])
            if not (_is_int(f) and 0 <= f < len(names)) or not (
                    isinstance(span, list) and len(span) == 2 and all(_is_int(x) and x >= 0 for x in span)):
                raise ManifestError(f"{where}: the record of {key} needs a file number below {len(names)} and "
                                    "digests [offset, count]")
            c = _chunk(key, {**rec, "file": names[f], "digests": []})
            algorithm = self.files[c.file].algorithm
            if c.block_rows and algorithm != "none" and span[1] != c.n_blocks:
                raise ManifestError(f"{where}: the record of {key} has {span[1]} block digests, its "
                                    f"{c.rows} rows in blocks of {c.block_rows} need {c.n_blocks}")
            if span[0] + span[1] * DIGEST_CHARS[algorithm] > self.end - self.digests_at:
                raise ManifestError(f"{where}: the digests of {key} lie beyond its digest section (corrupted)")
            out[key] = Record(c, step, (span[0], span[1]))
        return out

    def digest_ranges(self, records: dict[str, Record], blocks: dict[str, tuple[int, int]] | None = None
                      ) -> dict[str, tuple[int, int, tuple[int, int]]]:
        """Key -> (offset in the file, length, (first, end) block) of the digests to read: of the blocks
        `blocks` gives for the key (every block of a key it does not name). Empty for version 4, whose
        records carry their digests."""
        out: dict[str, tuple[int, int, tuple[int, int]]] = {}
        for key, r in records.items():
            if r.digests is None:
                continue
            at, count = r.digests
            b0, b1 = (blocks or {}).get(key, (0, count))
            b0, b1 = min(b0, count), min(max(b0, b1), count)
            width = DIGEST_CHARS[self.files[r.chunk.file].algorithm]
            out[key] = (self.digests_at + at + b0 * width, (b1 - b0) * width, (b0, b1))
        return out

    def index(self, records: dict[str, Record], digests: dict[str, tuple[int, int, bytes]] | None = None
              ) -> "Index":
        """The `Index` of the records read: those chunks, the step counters they carry, and every file
        the header lists. `digests` (version 5): key -> (first block, end block, the bytes read at the
        offset `digest_ranges` gave); a chunk whose digests cover only some of its blocks says which
        (`Chunk.blocks`); a key absent gets none."""
        where = index_name(self.rank, self.shared)
        chunks: dict[str, Chunk] = {}
        steps: dict[str, int] = {}
        for key, r in records.items():
            c = r.chunk
            if r.digests is not None:
                b0, b1, raw = (digests or {}).get(key, (0, 0, b""))
                width = DIGEST_CHARS[self.files[c.file].algorithm]
                if len(raw) != (b1 - b0) * width:
                    raise ManifestError(f"{where} ends inside the block digests of {key} (truncated)")
                try:
                    text = raw.decode("ascii")
                except UnicodeDecodeError:
                    raise ManifestError(f"{where}: the block digests of {key} are not text (corrupted)") from None
                ds = tuple(text[i * width:(i + 1) * width] for i in range(b1 - b0))
                whole = (b0, b1) == (0, r.digests[1])
                c = Chunk(c.file, c.offsets, c.sizes, c.block_rows, ds, None if whole else (b0, b1))
            chunks[key] = c
            if r.step is not None:
                p = _param(key)
                if steps.setdefault(p, r.step) != r.step:
                    raise ManifestError(f"{where}: its records disagree on the optimizer step of {p}")
        return Index(rank=self.rank, step=self.step, shared=self.shared, files=dict(self.files), chunks=chunks,
                     optimizer_steps=steps)


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
