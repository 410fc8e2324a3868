"""Format 4's byte layout of ``manifest.json``: a preamble, a header, then one section per pipeline stage,
so that a rank reads only the parameters its stage holds.

The preamble of `PREAMBLE_BYTES` gives the header's length and crc32; the header holds everything but
the parameters (the step, the placement the checkpoint was saved under (layout, layer count, tied
embedding: `placement.py`), the number of index files, all non-tensor state), the length and crc32 of
each section, the number of parameters and keys and the crc32 of the sorted keys. Then one section per
pipeline stage of the saved layout (and one for the tied table when two stages hold it; one in all
without a placement): the shapes and dtypes of its parameters (a run of layers with the same entries,
differing only in the layer number in their names, written once as a repeat: `repeats.py`) and where
their keys fall in the sorted order of every key. Rank 0 reads the preamble and the header and shares
them; each rank reads the sections of its own parameters by byte range (`validate.read_sections`) and
checks their shapes against its model's before any other read. The whole file is also one JSON object:
a format-3 reader refuses its ``format_version`` as newer than its own, and tools read every section
(`Manifest.from_json`).
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from parallel.checkpoint.entries import TensorEntry, parse_tensor
from parallel.checkpoint.errors import ManifestError
from parallel.checkpoint.fields import is_int, load_json
from parallel.checkpoint.formats import FORMAT, FORMAT_VERSION, MANIFEST_NAME, PREAMBLE_BYTES, SECTIONED_VERSIONS, preamble_fields
from parallel.checkpoint.keys import key_order, keys_crc, param_of, spell_keys
from parallel.checkpoint.repeats import fold, unfold

_SECTIONED_MAGIC = re.compile(f'\\{{"format":"{FORMAT}","format_version":\\d+,"header_bytes":'.encode())
_SECTIONS_OPEN = b',"sections":['
_SECTIONS_CLOSE = b"]}\n"


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


def encode(d: dict[str, Any], *, tensors, parameters: int,
           rule: tuple[int, Callable[[str], int | None]]) -> bytes:
    """The file of a top manifest whose JSON document (`Manifest.to_dict`) is `d`: `tensors`, its keys;
    `parameters`, how many model parameters; `rule`, (how many sections, parameter name -> its
    section) (`Manifest.section_rule`). Each section holds the shapes and dtypes of its parameters and
    where their keys fall in the sorted order of every key, as runs ``[first, count]``. Consecutive
    layers whose parameters have the same entries are written once (``repeats``, `fold`): a section's
    size grows with the distinct layers, not the layer count."""
    d = dict(d)
    version = d.pop("format_version")
    spelled = "params" in d
    entries = d.pop("params" if spelled else "tensors")
    del d["format"]
    count, section = rule
    groups: list[dict[str, Any]] = [{} for _ in range(count)]
    for name, e in entries.items():
        i = section(name if spelled else param_of(name))
        if i is None:
            raise ValueError(f"parameter {name} belongs to no pipeline stage of the placement {d['placement']}")
        groups[i][name] = e
    order = key_order(tensors)
    place = {k: i for i, k in enumerate(order)}
    states = d["optimizer"]["states"]
    parts = []
    for g in groups:
        keys = sorted(spell_keys(g, states)) if spelled else sorted(g)
        listed, repeats = fold(g)
        part = {"params" if spelled else "tensors": listed, **({"repeats": repeats} if repeats else {}),
                "keys": _runs([place[k] for k in keys])}
        parts.append(json.dumps(part, separators=(",", ":")).encode())
    d.update(parameters=parameters, keys=len(order), keys_crc32=keys_crc(order),
             sections=[[len(b), zlib.crc32(b)] for b in parts])
    header = json.dumps(d, separators=(",", ":")).encode()
    pre = json.dumps({"format": FORMAT, "format_version": version, "header_bytes": len(header),
                      "header_crc32": zlib.crc32(header)}, separators=(",", ":"))[:-1] + ',"header":'
    return (pre.ljust(PREAMBLE_BYTES - 1).encode() + b"\n" + header + _SECTIONS_OPEN + b",".join(parts)
            + _SECTIONS_CLOSE)


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
    n, crc, v = preamble_fields(d, MANIFEST_NAME)
    if v > FORMAT_VERSION:
        raise ManifestError(f"manifest format_version {v} is newer than this code reads ({FORMAT_VERSION}): load it "
                            "with a newer Elastron")
    if v not in SECTIONED_VERSIONS:
        raise ManifestError(f"{MANIFEST_NAME}: format_version {v} has no preamble (corrupted)")
    return n, crc, v


def parse_header(data: bytes, crc: int, version: int) -> tuple[dict[str, Any], Sections]:
    """(The JSON document of the top manifest with no parameters, its sections, none read) from the
    header bytes (after the preamble, whose `crc` they must match) of a format-4 ``manifest.json``."""
    if zlib.crc32(data) != crc:
        raise ManifestError(f"{MANIFEST_NAME}: its header fails its crc32 check: the checkpoint is corrupted")
    d = load_json(data, f"{MANIFEST_NAME} header")
    if not isinstance(d, dict):
        raise ManifestError(f"{MANIFEST_NAME}: its header must be a JSON object")
    table, counts = d.pop("sections", None), [d.pop(k, None) for k in ("parameters", "keys", "keys_crc32")]
    if not (isinstance(table, list) and table and all(
            isinstance(x, list) and len(x) == 2 and all(is_int(v) and v >= 0 for v in x) for x in table)
            and all(is_int(v) and v >= 0 for v in counts)):
        raise ManifestError(f"{MANIFEST_NAME}: its header needs a section table of [bytes, crc32] pairs and the "
                            "number of parameters and keys")
    opt = d.get("optimizer")
    states = opt.get("states", []) if isinstance(opt, dict) else []
    spans, at = [], PREAMBLE_BYTES + len(data) + len(_SECTIONS_OPEN)
    for n, c in table:
        spans.append((at, n, c))
        at += n + 1  # the comma between sections
    sections = Sections(spans=tuple(spans), parameters=counts[0], keys=counts[1], keys_crc32=counts[2],
                        states=tuple(states))
    return {**d, "format": FORMAT, "format_version": version, "params": {}}, sections


def split(raw: bytes, sections: Sections) -> dict[int, bytes]:
    """Section number -> its bytes, of a whole format-4 ``manifest.json`` (`raw`) whose header gave
    `sections`; raises ManifestError for a file of another length or a damaged frame."""
    spans = sections.spans
    end = spans[-1][0] + spans[-1][1] + len(_SECTIONS_CLOSE)
    if len(raw) != end or raw[spans[0][0] - len(_SECTIONS_OPEN):spans[0][0]] != _SECTIONS_OPEN:
        raise ManifestError(f"{MANIFEST_NAME} is {len(raw)} bytes, its header says {end} (truncated or corrupted)")
    return {i: raw[a:a + m] for i, (a, m, _) in enumerate(spans)}


def read_sections(sec: Sections, tensors: dict[str, TensorEntry], raw: dict[int, bytes]
                  ) -> tuple[dict[str, TensorEntry], Sections]:
    """(`tensors` with those of the sections `raw` (section number -> its bytes) added, `sec` with them
    read); raises ManifestError for a section that is truncated, fails its crc32 or is malformed. Once
    every section is in, the keys must be the ones the header counts."""
    tensors, positions = dict(tensors), dict(sec.positions)
    for i, data in sorted(raw.items()):
        where = f"{MANIFEST_NAME} section {i}"
        if not 0 <= i < len(sec.spans):
            raise ValueError(f"{MANIFEST_NAME} has no section {i}")
        if len(data) != sec.spans[i][1]:
            raise ManifestError(f"{MANIFEST_NAME} ends inside section {i} (truncated)")
        if zlib.crc32(data) != sec.spans[i][2]:
            raise ManifestError(f"{where} fails its crc32 check: the checkpoint is corrupted")
        d = load_json(data, where)
        spelled = isinstance(d, dict) and "params" in d
        listed = d.get("params" if spelled else "tensors") if isinstance(d, dict) else None
        if not isinstance(listed, dict):
            raise ManifestError(f"{where} needs a 'params' or 'tensors' object")
        listed = unfold(listed, d.get("repeats", []), sec.parameters if spelled else sec.keys, where)
        entries = spell_keys(listed, list(sec.states)) if spelled else listed
        got = {str(k): parse_tensor(k, v, chunks=False) for k, v in entries.items()}
        keys = sorted(got)
        positions.update(zip(keys, _places(d.get("keys"), len(keys), sec.keys, where)))
        tensors.update(got)
    if len(set(positions.values())) != len(positions):
        raise ManifestError(f"{MANIFEST_NAME}: its sections give two keys one place in the key order (corrupted)")
    sections = replace(sec, read=sec.read | frozenset(raw), positions=positions)
    if sections.complete:
        order = key_order(tensors)
        if (len(order) != sec.keys or keys_crc(order) != sec.keys_crc32
                or any(positions[k] != i for i, k in enumerate(order))):
            raise ManifestError(f"{MANIFEST_NAME}: its sections hold {len(order)} keys, not the {sec.keys} its "
                                "header counts in that order (corrupted)")
    return tensors, sections


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
            isinstance(r, list) and len(r) == 2 and is_int(r[0]) and is_int(r[1]) and r[0] >= 0 and r[1] > 0
            and r[0] + r[1] <= total for r in runs):
        raise ManifestError(f"{where}: its 'keys' must be runs [first, count] within the {total} keys")
    out = [p for a, c in runs for p in range(a, a + c)]
    if len(out) != n:
        raise ManifestError(f"{where} places {len(out)} keys but holds {n} (corrupted)")
    return out
