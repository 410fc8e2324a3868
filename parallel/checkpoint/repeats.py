"""Repeats: a run of consecutive layers whose entries are the same, written once in a format-4 section
(`fold`) and spelled back out when it is read (`unfold`)."""

from __future__ import annotations

import re
from typing import Any

from parallel.checkpoint.errors import ManifestError
from parallel.checkpoint.fields import is_int

_NUMBERED = re.compile(r"(.+?\.)(0|[1-9][0-9]*)(\..+)")
"""A name with a number between dots (the first such: ``layers.<n>.attention.wq.weight``), written
without leading zeros so that the number spells the name back."""


def fold(entries: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A format-4 section's entries (name -> its JSON entry) as (those listed one by one, repeats): a
    run of two or more consecutive numbers n whose names ``<prefix><n><rest>`` hold the same rests with
    the same entries (a model's transformer layers) is written once, ``{"prefix", "first", "count",
    "entries": {rest: entry}}``; any layer that differs (another shape, dtype or parameter set) ends
    the run, and names outside every run stay listed (`unfold` reverses it)."""
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


def unfold(listed: dict[str, Any], repeats: Any, most: int, where: str) -> dict[str, Any]:
    """A section's entries from those it lists and its repeats (`fold`); at most `most` in all (the
    header's count: a forged repeat cannot make a reader spell millions of names). Raises ManifestError
    for a malformed repeat or a name given twice."""
    if not isinstance(repeats, list) or not all(
            isinstance(r, dict) and isinstance(r.get("prefix"), str) and is_int(r.get("first")) and r["first"] >= 0
            and is_int(r.get("count")) and r["count"] > 0 and isinstance(r.get("entries"), dict) for r in repeats):
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
