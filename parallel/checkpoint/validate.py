"""Which checkpoints exist under a root, and whether one may be loaded.

A checkpoint is loadable only if its manifest parses, its chunks tile every tensor, its model tensors
match the model (when the caller says what the model is), and every file it lists exists with the
listed size and checksums. Each check returns human-readable problems rather than raising, so the loader
can log "checkpoint X: reason" and fall back to the previous one, and `inspect` can show them all.

The training loader checks sizes here and verifies format-2/3 checksums while it reads (tensor_io); the
full verification below (every byte, without torch) is for tools and for format-1 checkpoints, whose
whole-file sha256 must be checked before their bytes are used. A format-3-4 checkpoint is checked whole
here (`check_checkpoint` reads every index); a training rank reads and checks only its part (loader).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field

from parallel.checkpoint.checksum import digest_fn
from parallel.checkpoint.checks import ITEMSIZE
from parallel.checkpoint.errors import ManifestError
from parallel.checkpoint.formats import MANIFEST_NAME, PREAMBLE_BYTES, index_name
from parallel.checkpoint.index import Index, IndexHeader, header_size
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.sections import manifest_header_size
from parallel.checkpoint.storage import Storage

LATEST_NAME = "latest"
_STEP_DIR = re.compile(r"step-(\d{8,})")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def list_step_dirs(storage: Storage) -> list[tuple[int, str]]:
    """(step, name) of every step directory under the root, newest first. Staging directories of
    interrupted saves are not step directories."""
    out = [(s, n) for n in storage.list_dir(storage.root) if (s := parse_step(n)) is not None]
    return sorted(out, reverse=True)


def read_latest(storage: Storage) -> str | None:
    """The name the `latest` pointer holds, if it exists and names a step directory."""
    path = storage.join(storage.root, LATEST_NAME)
    if not storage.exists(path):
        return None
    name = storage.read_bytes(path).decode("utf-8", "replace").strip()
    return name if parse_step(name) is not None else None


@dataclass(slots=True)
class Check:
    """Outcome of checking one checkpoint directory."""

    path: str
    manifest: Manifest | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems


def read_manifest_text(storage: Storage, path: str, *, transient: list[str] | None = None, head: bool = False
                       ) -> tuple[str | None, str | None]:
    """(manifest text, None) or (None, why there is none). `head`: of a format-4 manifest only the
    preamble and the header, read by byte range (a loading rank then reads the sections it needs,
    `read_sections`); a manifest of one JSON document (formats 1-3) is read whole either way. A read
    that fails for another reason than a missing file (an I/O error, an object store's 5xx) goes to
    `transient` when the caller passes a list for it (the training loader retries those), else it is the
    reason."""
    mpath = storage.join(path, MANIFEST_NAME)
    try:
        if not storage.exists(mpath):
            return None, f"no {MANIFEST_NAME} (the save did not commit: interrupted or still running)"
        if head:
            (pre,) = storage.read_ranges(mpath, [(0, PREAMBLE_BYTES)])
            try:
                size = manifest_header_size(pre)
            except ManifestError:  # damaged or too new: `Manifest.from_json` says which, from these bytes
                return pre.decode("utf-8", "replace"), None
            if size is not None:
                (header,) = storage.read_ranges(mpath, [(PREAMBLE_BYTES, size[0])])
                return (pre + header).decode("utf-8"), None
        return storage.read_bytes(mpath).decode("utf-8"), None
    except FileNotFoundError:  # removed between the two calls
        return None, f"no {MANIFEST_NAME}"
    except UnicodeDecodeError as e:
        return None, f"cannot read {MANIFEST_NAME}: {e}"
    except (OSError, MemoryError) as e:
        if transient is None:
            return None, f"cannot read {MANIFEST_NAME}: {e}"
        transient.append(f"cannot read {MANIFEST_NAME}: {type(e).__name__}: {e}")
        return None, None


def check_manifest(path: str, text: str | None, why_missing: str | None,
                   expected: dict[str, tuple[tuple[int, ...], str]] | None = None) -> Check:
    """Everything that can be checked from the manifest alone (cheap: no tensor data is read)."""
    check = Check(path)
    if text is None:
        check.problems.append(why_missing or f"no {MANIFEST_NAME}")
        return check
    try:
        check.manifest = Manifest.from_json(text)
    except ManifestError as e:
        check.problems.append(str(e))
        return check
    check.problems += check.manifest.structure_problems()
    if expected is not None:
        check.problems += check.manifest.model_problems(expected)
    return check


def read_indexes(storage: Storage, path: str, manifest: Manifest, wanted, *,
                 transient: list[str] | None = None, optional_shared: bool = False,
                 gap: int | None = None, digest_gap: int | None = None, boxes=None) -> tuple[list[Index], list[str]]:
    """(The parsed indexes `wanted` of the format-3-4 checkpoint at `path`, problems). `wanted`: (saving
    rank, shared) pairs, each index read whole; or a dict from such pairs to the keys needed of it
    (`placement.index_keys_for`), of which a keyed index gives only the records of those keys, read as
    byte ranges after its header (an index of one JSON document is read whole), and of those records'
    block digests, with `boxes` (key -> (offsets, sizes) the rank loads), only those of the blocks whose
    rows meet its box (`Chunk.blocks_meeting`: what the load reads and verifies). A missing or
    malformed index is a problem (a missing shared one not, with `optional_shared`: a rank that
    writes no shared box writes none); another read error goes to `transient` when given."""
    out, problems = [], []
    keys = manifest.keys_in_order()
    for r, shared in sorted(wanted):
        name = index_name(r, shared)
        if not 0 <= r < manifest.indexes:
            problems.append(f"{name} is needed but the manifest lists {manifest.indexes} ranks' indexes")
            continue
        need = wanted[(r, shared)] if isinstance(wanted, dict) else None
        try:
            ipath = storage.join(path, name)
            if need is None:
                out.append(Index.from_bytes(storage.read_bytes(ipath), rank=r, step=manifest.step, shared=shared,
                                            keys=keys))
            else:
                out.append(read_index_keys(storage, ipath, r, shared, manifest.step, keys, need, gap=gap,
                                           digest_gap=digest_gap, boxes=boxes))
        except FileNotFoundError:
            if not (shared and optional_shared):
                problems.append(f"{name} is missing")
        except ManifestError as e:
            problems.append(str(e))
        except (OSError, MemoryError) as e:
            (transient if transient is not None else problems).append(f"cannot read {name}: {type(e).__name__}: {e}")
    return out, problems


def read_sections(storage: Storage, path: str, manifest: Manifest, names, *,
                  transient: list[str] | None = None) -> tuple[Manifest, list[str]]:
    """(The format-4 `manifest`, read without its sections, with those that hold the parameters `names`
    added, problems): what a loading rank reads of the top manifest besides its header, in one request
    of byte ranges (adjacent sections coalesced). A manifest with no sections to read is returned as it
    is. A read error other than a missing file goes to `transient` when given."""
    sec = manifest.sections
    if sec is None:
        return manifest, []
    want = manifest.sections_for(names) - sec.read
    reads = coalesce([(a, n, i) for i, (a, n, _) in enumerate(sec.spans) if i in want], 0)
    mpath = storage.join(path, MANIFEST_NAME)
    try:
        got = storage.read_ranges(mpath, [(a, n) for a, n, _ in reads])
    except FileNotFoundError:
        return manifest, [f"no {MANIFEST_NAME}"]
    except (OSError, MemoryError) as e:
        why = f"cannot read {MANIFEST_NAME}: {type(e).__name__}: {e}"
        if transient is None:
            return manifest, [why]
        transient.append(why)
        return manifest, []
    raw = {}
    for (at, _, ids), data in zip(reads, got):
        for i in ids:
            a, n, _ = sec.spans[i]
            raw[i] = data[a - at:a - at + n]
    try:
        return manifest.with_sections(raw), []
    except ManifestError as e:
        return manifest, [str(e)]


RECORD_GAP = 0
"""Records of a keyed index at most this many bytes apart are read in one range (`IndexHeader.ranges`)."""
DIGEST_GAP = 0
"""Block digests of a keyed index at most this many bytes apart are read in one range (`coalesce`):
more reads the digests between too, in fewer requests."""


def coalesce(spans, gap: int) -> list[tuple[int, int, list]]:
    """(Offset, length, names) of one read per run of `spans` ((offset, length, name) each) at most
    `gap` bytes apart, in file order; empty spans are left out."""
    out: list[tuple[int, int, list]] = []
    for at, n, name in sorted(spans, key=lambda x: x[:2]):
        if not n:
            continue
        if out and at - (out[-1][0] + out[-1][1]) <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], at + n - out[-1][0]), out[-1][2] + [name])
        else:
            out.append((at, n, [name]))
    return out


def read_index_keys(storage: Storage, ipath: str, rank: int, shared: bool, step: int, keys: list[str],
                    need, *, gap: int | None = None, digest_gap: int | None = None, boxes=None) -> Index:
    """The index at `ipath` with only the records of the keys `need` (an index of one JSON document:
    whole). Reads the preamble, the header, the records' byte ranges (those at most `gap` bytes apart,
    default `RECORD_GAP`, in one range), then (a version-5 index) the byte ranges of their block
    digests (at most `digest_gap` apart, default `DIGEST_GAP`, in one): with `boxes` (key -> (offsets,
    sizes)) only of the blocks whose rows meet the key's box, else all."""
    gap = RECORD_GAP if gap is None else gap
    digest_gap = DIGEST_GAP if digest_gap is None else digest_gap
    (pre,) = storage.read_ranges(ipath, [(0, PREAMBLE_BYTES)])
    size = header_size(pre, rank=rank, shared=shared)
    if size is None:  # one JSON document: written before indexes were keyed, or by the fallback save
        return Index.from_json(storage.read_bytes(ipath), rank=rank, step=step, shared=shared)
    (raw,) = storage.read_ranges(ipath, [(PREAMBLE_BYTES, size[0])])
    if len(raw) != size[0]:
        raise ManifestError(f"{index_name(rank, shared)} ends inside its header (truncated)")
    head = IndexHeader.parse(raw, size[1], rank=rank, step=step, shared=shared, keys=keys, version=size[2])
    ranges = head.ranges(need, gap)
    found: dict[str, bytes] = {}
    for (at, _, ks), data in zip(ranges, storage.read_ranges(ipath, [(a, n) for a, n, _ in ranges])):
        for k in ks:
            a, n = head.spans[k]
            found[k] = data[a - at:a - at + n]
    records = head.records(found)
    blocks = None if boxes is None else {k: r.chunk.blocks_meeting(*boxes[k]) for k, r in records.items() if k in boxes}
    spans = head.digest_ranges(records, blocks)
    reads = coalesce([(a, n, k) for k, (a, n, _) in spans.items()], digest_gap)
    digests = {k: (b0, b1, b"") for k, (_, _, (b0, b1)) in spans.items()}
    for (at, _, ks), data in zip(reads, storage.read_ranges(ipath, [(a, n) for a, n, _ in reads])):
        for k in ks:
            a, n, (b0, b1) = spans[k]
            digests[k] = (b0, b1, data[a - at:a - at + n])
    return head.index(records, digests)


def whole(storage: Storage, path: str, manifest: Manifest) -> tuple[Manifest, list[str]]:
    """A format-3-4 manifest with every index merged in (formats 1-2: as it is), and the problems found."""
    if manifest.scope != "top":
        return manifest, []
    every = [(r, s) for r in range(manifest.indexes) for s in (False, True)]
    indexes, problems = read_indexes(storage, path, manifest, every, optional_shared=True)
    merged, more = manifest.merged(indexes, whole=True)
    return merged, problems + more


def file_problems(storage: Storage, path: str, manifest: Manifest, names: list[str] | None = None,
                  *, checksums: bool = True, transient: list[str] | None = None) -> list[str]:
    """Missing files, wrong sizes (truncation) and checksum mismatches (corruption) among `names`
    (default: every file in the manifest). Callers split the names across ranks to share the reading.
    A read that fails for another reason (an OSError other than a missing file) goes to `transient`
    when the caller passes a list for it, else it is reported as a problem."""
    problems = []
    for name in sorted(manifest.files) if names is None else names:
        entry = manifest.files[name]
        fpath = storage.join(path, name)
        try:
            if not storage.exists(fpath):
                problems.append(f"file {name} is missing")
                continue
            size = storage.size(fpath)
            if size != entry.size:
                problems.append(f"file {name} is {size} bytes, the manifest says {entry.size} (truncated or replaced)")
                continue
            if not checksums or entry.algorithm == "none":
                continue
            if entry.blockwise:
                problems += _block_problems(storage, fpath, name, manifest)
            elif storage.sha256(fpath) != entry.digest:
                problems.append(f"file {name} fails its sha256 checksum (corrupted)")
        except FileNotFoundError:
            problems.append(f"file {name} is missing")
        except OSError as e:
            (transient if transient is not None else problems).append(f"file {name} cannot be read: {e}")
    return problems


def _block_problems(storage: Storage, fpath: str, name: str, manifest: Manifest) -> list[str]:
    """Verify a format-2 file completely: its header digest, then every block of every chunk it holds."""
    entry = manifest.files[name]
    bad = f"file {name} fails its {entry.algorithm} checksum"
    with storage.open(fpath) as f:
        raw = f.read(8)
        if len(raw) != 8:
            return [f"file {name} is truncated before its header"]
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > entry.size:
            return [f"{bad} (corrupted header length)"]
        text = f.read(n)
        if not entry.header_ok(raw + text):
            return [f"{bad} (corrupted header)"]
        try:
            header = json.loads(text)
            starts = {k: int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            return [f"file {name} has an unreadable header ({type(e).__name__})"]
        chunks = sorted(((starts.get(k, -1), k, c, t.dtype) for k, t in manifest.tensors.items()
                         for c in t.chunks if c.file == name), key=lambda x: x[0])
        digest = digest_fn(entry.algorithm)
        buf = bytearray()
        for start, key, c, dtype in chunks:
            if start < 0:
                return [f"file {name} does not hold tensor {key}"]
            row = math.prod(c.sizes[1:]) * ITEMSIZE[dtype] if c.sizes else ITEMSIZE[dtype]
            f.seek(8 + n + start)
            for b in range(c.n_blocks):
                want = (min((b + 1) * c.block_rows, c.rows) - b * c.block_rows) * row
                if len(buf) < want:
                    buf = bytearray(want)
                view = memoryview(buf)[:want]
                got = 0
                while got < want:
                    k = f.readinto(view[got:])
                    if not k:
                        return [f"file {name} ends early (truncated)"]
                    got += k
                if b >= len(c.digests) or digest(view) != c.digests[b]:
                    return [f"{bad} (corrupted: block {b} of {key})"]
    return []


def check_checkpoint(storage: Storage, path: str, *, expected=None, checksums: bool = True) -> Check:
    """All checks, in this process (for tools and single-process loads)."""
    text, why = read_manifest_text(storage, path)
    check = check_manifest(path, text, why, expected)
    if check.manifest is not None and not check.problems and check.manifest.scope == "top":
        check.manifest, more = whole(storage, path, check.manifest)
        check.problems += more or check.manifest.structure_problems()
    if check.manifest is not None and not check.problems:
        check.problems += file_problems(storage, path, check.manifest, checksums=checksums)
    return check
