"""The checkpoint formats' fixed names: their tags and version numbers, the names of the files a
checkpoint directory holds, and the fixed-size preamble that starts a file read by byte range.

Format 4 is written now (`sections.py`), with keyed indexes (`index.py`); formats 1-3 are still read
(`manifest.py`)."""

from __future__ import annotations

from typing import Any

from parallel.checkpoint.errors import ManifestError
from parallel.checkpoint.fields import is_int

FORMAT = "elastron-checkpoint"
FORMAT_VERSION = 4
"""The newest format this code reads, and the one `CheckpointManager` writes."""
SECTIONED_VERSIONS = (4,)
"""Top-manifest formats split into a header and sections (`sections.encode`), read by byte range."""
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


def index_name(rank: int, shared: bool = False) -> str:
    """The file a saving rank describes its files and chunks in (formats 3-4); `shared`: the one for the
    boxes held beyond their data-parallel replicas (`placement.shared`), which every rank writes that
    writes any."""
    return f"index-r{rank:05d}{'-shared' if shared else ''}.json"


def shard_prefix(rank: int) -> str:
    """Every data file a rank writes starts with this (its index may list no other)."""
    return f"shard-r{rank:05d}-"


def preamble_fields(d: Any, where: str) -> tuple[int, int, int]:
    """(header_bytes, header_crc32, format_version) of a parsed preamble (None: it did not parse), else a
    one-line ManifestError naming the file, `where`."""
    n, crc, v = ((d.get("header_bytes"), d.get("header_crc32"), d.get("format_version")) if isinstance(d, dict)
                 else (None, None, None))
    if not (is_int(n) and n > 0 and is_int(crc) and is_int(v)):
        raise ManifestError(f"{where}: its preamble (the first {PREAMBLE_BYTES} bytes) is damaged: the checkpoint "
                            "is corrupted")
    return n, crc, v
