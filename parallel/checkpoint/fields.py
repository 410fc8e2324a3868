"""Checked reading of untrusted JSON: a manifest's or an index's fields parsed and type-checked, each
failure a one-line `ManifestError` saying what is wrong (the text may come from untrusted storage)."""

from __future__ import annotations

import json
from typing import Any

from parallel.checkpoint.errors import ManifestError


def load_json(text: str | bytes, what: str) -> Any:
    """The JSON value of `text` (`what` names it in the error)."""
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:  # a forged, deeply nested document: a verdict, not a crash of the loader
        raise ManifestError(f"{what} is nested too deeply to be a checkpoint manifest") from None


def is_int(v: Any) -> bool:
    """Whether `v` is a JSON integer (a bool is not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def int_field(d: dict, key: str) -> int:
    """The integer >= 0 at `key` of a manifest object."""
    v = d.get(key)
    if not is_int(v) or v < 0:
        raise ManifestError(f"manifest {key} must be an integer >= 0, got {v!r}")
    return v


def int_list(v: Any, what: str) -> tuple[int, ...]:
    """A list of integers >= 0 (offsets, sizes, a shape) as a tuple."""
    if not isinstance(v, list) or not all(is_int(x) and x >= 0 for x in v):
        raise ManifestError(f"{what} must be a list of integers >= 0, got {v!r}")
    return tuple(v)


def step_counters(v: Any, what: str) -> dict[str, int]:
    """Optimizer step counters: an object of names to integers."""
    if not isinstance(v, dict) or not all(is_int(x) for x in v.values()):
        raise ManifestError(f"{what} must map names to integers")
    return {str(k): int(x) for k, x in v.items()}
