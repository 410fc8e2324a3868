"""The manifest's records: a stored piece of a tensor, a tensor, a file (`Chunk`, `TensorEntry`,
`FileEntry`), and their parsing from untrusted JSON."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from parallel.checkpoint.checksum import ALGORITHMS, digest_fn
from parallel.checkpoint.errors import ManifestError
from parallel.checkpoint.fields import int_list, is_int


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



def parse_chunk(key: Any, c: Any) -> Chunk:
    """A chunk record of tensor `key`."""
    if not isinstance(c, dict) or not isinstance(c.get("file"), str):
        raise ManifestError(f"manifest tensor {key!r} has a malformed chunk {c!r}")
    block_rows, digests = c.get("block_rows", 0), c.get("digests", [])
    if not is_int(block_rows) or block_rows < 0 or not isinstance(digests, list) or not all(
            isinstance(x, str) for x in digests):
        raise ManifestError(f"manifest tensor {key!r} has malformed chunk checksums")
    return Chunk(file=c["file"], offsets=int_list(c.get("offsets"), f"tensor {key!r} chunk offsets"),
                 sizes=int_list(c.get("sizes"), f"tensor {key!r} chunk sizes"),
                 block_rows=block_rows, digests=tuple(digests))


def parse_tensor(key: Any, v: Any, *, chunks: bool = True) -> TensorEntry:
    """A tensor entry; `chunks=False` (a format-3-4 top manifest): shape and dtype only."""
    if not isinstance(v, dict) or not isinstance(v.get("dtype"), str) or (
            chunks and not isinstance(v.get("chunks"), list)):
        raise ManifestError(f"manifest tensor {key!r} needs shape, dtype" + (" and chunks" if chunks else ""))
    return TensorEntry(shape=int_list(v.get("shape"), f"tensor {key!r} shape"), dtype=v["dtype"],
                       chunks=tuple(parse_chunk(key, c) for c in v["chunks"]) if chunks else ())


def parse_file(key: Any, v: Any) -> FileEntry:
    """A file record: its size and checksum (format 1: a sha256 of the whole file)."""
    if "/" in str(key) or "\\" in str(key) or str(key) in ("", ".", ".."):
        # Names are joined to the checkpoint directory: never let a manifest point outside it.
        raise ManifestError(f"manifest file name {key!r} is not a plain file name")
    if not isinstance(v, dict) or not is_int(v.get("size")):
        raise ManifestError(f"manifest file {key!r} needs an integer size and a checksum")
    if isinstance(v.get("sha256"), str):  # format 1
        return FileEntry(size=v["size"], digest=v["sha256"])
    if v.get("algorithm") not in ALGORITHMS or not isinstance(v.get("header_digest"), str):
        raise ManifestError(f"manifest file {key!r} needs a checksum algorithm (one of {', '.join(ALGORITHMS)}) "
                            "and a header_digest string")
    return FileEntry(size=v["size"], digest=v["header_digest"], algorithm=v["algorithm"], blockwise=True)
