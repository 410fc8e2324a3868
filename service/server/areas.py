"""Where a job writes: its run directory and its checkpoint directory. Each belongs to one job; no two
jobs the server keeps (running or finished, until deleted) may share one, or nest one inside another,
so that no job can read, overwrite or delete another's checkpoints (retention, a save's clean-up and
resume all act on the whole directory)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath

__all__ = ["Area", "SCHEME_ALIASES", "area_of", "areas_of", "overlap", "within"]

SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs", "az": "abfs", "abfss": "abfs"}
"""URL schemes fsspec reads from the same store as another: compared as that one."""

Area = tuple[str, tuple[str, ...]]
"""(what it is, as a message names it: "run_dir" or "checkpoint.dir"; its path parts, a URL's scheme first)."""


def area_of(where: str) -> tuple[str, ...]:
    """A local path (absolute, resolved) or a URL as comparable parts, a URL's scheme first (aliases as
    the scheme they stand for): a nested one extends the other's. A URL's '..' parts are refused where
    the request enters (service.server.specs), never resolved here."""
    if "://" in where and not where.lower().startswith("file://"):
        scheme, rest = where.split("://", 1)
        scheme = SCHEME_ALIASES.get(scheme.lower(), scheme.lower())
        return (scheme + "://", *[p for p in PurePosixPath(rest).parts if p not in ("", "/", ".")])
    local = where[len("file://"):] if where.lower().startswith("file://") else where
    return ("file://", *Path(local).resolve().parts)


def areas_of(run_dir: str, checkpoint_dir: str | None) -> list[Area]:
    """The areas a job with this run_dir and spec checkpoint.dir writes to (the default checkpoint
    directory lies inside the run directory)."""
    out: list[Area] = [("run_dir", area_of(run_dir))]
    if checkpoint_dir:
        out.append(("checkpoint.dir", area_of(checkpoint_dir)))
    return out


def within(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether area `a` is `b` or lies inside it."""
    return len(a) >= len(b) and a[:len(b)] == b


def _nested(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def overlap(mine: list[Area], others: Iterable[tuple[str, list[Area]]]) -> tuple[str, str, str, str] | None:
    """The first (my field, other job id, its field, how) where one of `mine` is, contains or lies in
    an area of another job, or None."""
    for job_id, theirs in others:
        for field, a in mine:
            for their_field, b in theirs:
                if _nested(a, b):
                    how = "is" if a == b else "lies inside" if len(a) > len(b) else "contains"
                    return field, job_id, their_field, how
    return None
