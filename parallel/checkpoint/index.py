"""A saving rank's index (``index-rNNNNN.json``, formats 3-4): its files, the chunk it wrote of each
tensor and the AdamW step counters of its parameters, in either layout.

A placed save writes keyed indexes (`KEYED_INDEX_VERSION`): a preamble of `PREAMBLE_BYTES` (the
header's length and crc32), a header (files, step, rank, the size of the digest section, and a table of
the length of each key's record, in the sorted order of every key (`KeyOrder`), runs of keys it does not
hold as one negative count), then one JSON record per line (a chunk's geometry: its file's number in the
header's sorted file names, offsets, sizes, rows per block, and where its block digests lie in the
digest section and how many there are; an optimizer state's also carries its parameter's step counter),
then the digest section: every chunk's block digests back to back, hex, at the algorithm's fixed width
(`checksum.DIGEST_CHARS`). A loader reads the preamble, the header, the byte ranges of the records it
needs, then those of the digests of the blocks whose rows meet its boxes (`validate.read_index_keys`): a
rank that needs half of a chunk reads its geometry and half of its digests. Keyed indexes of version 4
(written before; still read) carry all their digests inside each record. The fallback save, and every
save before indexes were keyed, writes an index as one JSON document (``format_version`` 3), read whole.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from parallel.checkpoint.checks import index_problems
from parallel.checkpoint.checksum import DIGEST_CHARS
from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry, parse_chunk, parse_file
from parallel.checkpoint.errors import ManifestError
from parallel.checkpoint.fields import is_int, load_json, step_counters
from parallel.checkpoint.formats import (INDEX_DOCUMENT_VERSION, INDEX_FORMAT, KEYED_INDEX_VERSION, KEYED_VERSIONS,
                                         PREAMBLE_BYTES, index_name, preamble_fields, shard_prefix)
from parallel.checkpoint.keys import OPTIM_PREFIX, KeyOrder, keys_crc, param_of

_KEYED_MAGIC = re.compile(f'\\{{"format":"{INDEX_FORMAT}","format_version":\\d+,"header_bytes":'.encode())


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
            if key.startswith(OPTIM_PREFIX) and param_of(key) in self.optimizer_steps:
                rec["step"] = self.optimizer_steps[param_of(key)]
            records.append(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
            table.append(len(records[-1]))
        if skip:
            table.append(-skip)
        header = json.dumps({
            "step": self.step, "rank": self.rank, "shared": self.shared,
            "files": {k: self.files[k].to_dict() for k in names},
            "keys": len(keys), "keys_crc32": keys_crc(keys), "table": table, "digest_bytes": at,
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
        d = load_json(text, where)
        if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT:
            raise ManifestError(f"{where} is not a checkpoint index (format {d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("rank") != rank or d.get("step") != step or bool(d.get("shared")) != shared:
            raise ManifestError(f"{where} describes rank {d.get('rank')!r} of step {d.get('step')!r} "
                                f"(shared: {d.get('shared')!r}), not rank {rank} of step {step}")
        files_d, chunks_d = d.get("files"), d.get("chunks")
        if not isinstance(files_d, dict) or not isinstance(chunks_d, dict):
            raise ManifestError(f"{where} needs 'files' and 'chunks' objects")
        files = {str(k): parse_file(k, v) for k, v in files_d.items()}
        bad = sorted(n for n in files if not n.startswith(shard_prefix(rank)))
        if bad:
            raise ManifestError(f"{where} lists {bad[0]}, which is not a file of rank {rank}")
        return cls(rank=rank, step=step, shared=shared, files=files, chunks={str(k): parse_chunk(k, v) for k, v in chunks_d.items()},
                   optimizer_steps=step_counters(d.get("optimizer_steps", {}), f"{where} optimizer_steps"))

    def problems(self, tensors: dict[str, TensorEntry]) -> list[str]:
        """Chunks of tensors the top manifest does not have, or that fall outside their tensor, name a
        file this index does not list, or lack block digests; files too small for their chunks."""
        return index_problems(index_name(self.rank, self.shared), self.chunks, self.files, tensors)


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
    n, crc, v = preamble_fields(d, where)
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
        d = load_json(data, f"{where} header")
        if not isinstance(d, dict) or d.get("rank") != rank or d.get("step") != step or bool(d.get("shared")) != shared:
            raise ManifestError(f"{where} describes rank {d.get('rank') if isinstance(d, dict) else None!r} of step "
                                f"{d.get('step') if isinstance(d, dict) else None!r}, not rank {rank} of step {step}")
        if d.get("keys") != order.count or d.get("keys_crc32") != order.crc32:
            raise ManifestError(f"{where}: its key table was written for {d.get('keys')!r} keys in another order than "
                                f"the manifest's {order.count} (an index of another checkpoint?)")
        table, files_d, digest_bytes = d.get("table"), d.get("files"), d.get("digest_bytes", 0 if version < 5 else None)
        if not isinstance(files_d, dict) or not isinstance(table, list) or not all(is_int(x) and x != 0 for x in table):
            raise ManifestError(f"{where}: its header needs 'files' and a key table of non-zero integers")
        if not is_int(digest_bytes) or digest_bytes < 0:
            raise ManifestError(f"{where}: its header needs the size of its digest section (digest_bytes)")
        files = {str(k): parse_file(k, v) for k, v in files_d.items()}
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
            if step is not None and (not is_int(step) or not key.startswith(OPTIM_PREFIX)):
                raise ManifestError(f"{where}: the record of {key} has a malformed step counter")
            if self.version < 5:
                out[key] = Record(parse_chunk(key, rec), step, None)
                continue
            f, span = rec.get("file"), rec.get("digests", [0, 0])
            if not (is_int(f) and 0 <= f < len(names)) or not (
                    isinstance(span, list) and len(span) == 2 and all(is_int(x) and x >= 0 for x in span)):
                raise ManifestError(f"{where}: the record of {key} needs a file number below {len(names)} and "
                                    "digests [offset, count]")
            c = parse_chunk(key, {**rec, "file": names[f], "digests": []})
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
                p = param_of(key)
                if steps.setdefault(p, r.step) != r.step:
                    raise ManifestError(f"{where}: its records disagree on the optimizer step of {p}")
        return Index(rank=self.rank, step=self.step, shared=self.shared, files=dict(self.files), chunks=chunks,
                     optimizer_steps=steps)
