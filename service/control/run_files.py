"""What a job's run directory tells the job manager when it cannot ask the coordinator: the events of
events.jsonl (`JobStatus.finalized` turns them into the final state), the metrics from metrics.jsonl,
and the checkpoints directory's entries. Read-only."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from parallel.layout import Layout
from service.control.events import Event, EventLog, read_events

logger = logging.getLogger(__name__)


def read_job_events(path: Path, job_id: str) -> list[dict]:
    """The job's events from events.jsonl ([] when missing or unreadable: its final state is unknown)."""
    if not path.exists():
        return []
    try:
        return [e.to_dict() for e in read_events(path) if e.job_id == job_id]
    except (OSError, ValueError):
        logger.warning("job %s: cannot read %s; its final state is unknown", job_id, path, exc_info=True)
        return []


def job_events(path: Path, job_id: str) -> EventLog:
    """The job's event log, continuing this job's events already in `path` (a restarted coordinator)
    and ignoring those of other jobs that ran in the same directory before."""
    return EventLog.load(path, job_id=job_id)


def last_logged_step(run_dir: Path) -> int:
    """The step of the last complete line of RUN_DIR/metrics.jsonl (rank 0 writes one per step), or 0.
    Reads the file from its end, a block at a time: a million-step log costs one block, not the file."""
    path = run_dir / "metrics.jsonl"
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, 2)
        tail = b""
        while end > 0:
            start = max(0, end - _BLOCK)
            f.seek(start)
            tail = f.read(end - start) + tail
            end = start
            lines = tail.split(b"\n")
            for line in reversed(lines[1:] if start else lines):  # lines[0] may be cut short
                if (m := _metric(line)) is not None:
                    return m["step"]
            tail = lines[0] if start else b""
            if len(tail) > _MAX_LINE:
                return 0  # no line ends within a sane length: not a metrics log
    return 0


_BLOCK = 1 << 16
_MAX_LINE = 1 << 20


def _metric(line: bytes | str) -> dict | None:
    try:
        m = json.loads(line)
    except ValueError:
        return None
    return m if isinstance(m, dict) and isinstance(m.get("step"), int) and not isinstance(m["step"], bool) else None


def where_it_stopped(prior: list[Event], run_dir: Path) -> tuple[int, str | None, Layout | None]:
    """Where a lost coordinator of the job left it, from its events and metrics: the last step any of
    them names, the last state it entered and the last layout it ran."""
    last_step = max([e.step for e in prior if e.step is not None] + [last_logged_step(run_dir)])
    last_state = next((e.to_state for e in reversed(prior) if e.kind == "transition"), None)
    layout = next((e.new_layout for e in reversed(prior) if e.new_layout), None)
    return last_step, last_state, None if layout is None else Layout.from_dict(layout)


def last_plan(prior: list[Event]) -> dict | None:
    """The plan (Plan.to_dict()) of the last group a lost coordinator of the job formed, if any: its
    last resize event's."""
    return next((e.details["plan"] for e in reversed(prior) if e.kind == "resize" and e.details.get("plan")), None)


def iter_metrics(path: Path, *, after: int, before: int | None = None) -> Iterator[dict]:
    """Rows of metrics.jsonl with after < step (< before), streamed line by line (a torn last line is
    skipped): memory stays bounded whatever the file's length."""
    try:
        f = path.open("r", errors="replace")
    except FileNotFoundError:
        return
    with f:
        for line in f:
            m = _metric(line)
            if m is not None and m["step"] > after and (before is None or m["step"] < before):
                yield m


def read_metrics(path: Path, *, after: int) -> list[dict]:
    """Rows of metrics.jsonl after step `after`, as a list (see iter_metrics)."""
    return list(iter_metrics(path, after=after))


MAX_LATEST_BYTES = 256
"""The most of the `latest` pointer file read (it names one checkpoint: a few bytes)."""
MAX_LISTED = 1000
"""The most entries of a checkpoints directory listed (retention keeps far fewer)."""
MAX_WALKED = 100_000
"""The most files whose sizes are summed per listing (the rest is not counted in `bytes`)."""


def list_checkpoints(ck: str | None, run_dir: str) -> dict:
    """The checkpoints directory's entries (a remote checkpoint.dir is not listed). Entries that vanish
    while they are listed (retention deletes old checkpoints as new ones commit) are left out. Symbolic
    links are not followed (the directory itself being one lists nothing; one inside is left out), the
    `latest` pointer is read up to MAX_LATEST_BYTES, at most MAX_LISTED entries are listed and at most
    MAX_WALKED files sized: what a run directory holds cannot make a listing read outside it or without
    bound."""
    if ck and "://" in ck and not ck.lower().startswith("file://"):
        return {"dir": ck, "latest": None, "entries": [], "note": "remote checkpoint dirs are not listed"}
    d = Path(ck[len("file://"):] if ck and "://" in ck else ck) if ck else Path(run_dir) / "checkpoints"
    entries = []
    latest = None
    budget = [MAX_WALKED]
    try:
        children = _scan(d) if not d.is_symlink() else []
    except OSError:
        children = []
    for e in children:
        try:
            if e.is_symlink():
                continue
            if e.name == "latest" and e.is_file(follow_symlinks=False):
                with open(e.path, "rb") as f:
                    latest = f.read(MAX_LATEST_BYTES).decode("utf-8", "replace").strip() or None
                continue
            if len(entries) < MAX_LISTED:
                entries.append(_entry(Path(e.path), e, budget))
        except OSError:  # deleted (or replaced) between the listing and the look: not there any more
            continue
    return {"dir": str(d), "latest": latest, "entries": entries}


def _scan(d: Path) -> list:
    """`d`'s entries (os.DirEntry, sortable by name); none if it is not a directory."""
    try:
        with os.scandir(d) as it:
            return sorted(it, key=lambda e: e.name)
    except (NotADirectoryError, FileNotFoundError):
        return []


def _entry(p: Path, e: os.DirEntry, budget: list[int]) -> dict:
    m = re.fullmatch(r"step-(\d+)", p.name)
    is_dir = e.is_dir(follow_symlinks=False)
    st = e.stat(follow_symlinks=False)
    size = _size(p, budget) if is_dir else st.st_size
    manifest = p / "manifest.json"
    return {"name": p.name, "step": int(m.group(1)) if m else None, "is_dir": is_dir,
            "committed": is_dir and manifest.is_file() and not manifest.is_symlink(), "bytes": size,
            "modified": st.st_mtime}


def _size(d: Path, budget: list[int]) -> int:
    """The bytes of the regular files under `d`, symbolic links not followed, `budget[0]` files at most
    (shared by one listing's entries, and used up here)."""
    size, stack = 0, [d]
    while stack and budget[0] > 0:
        try:
            with os.scandir(stack.pop()) as it:
                for f in it:
                    if budget[0] <= 0:
                        break
                    budget[0] -= 1
                    if f.is_dir(follow_symlinks=False):
                        stack.append(Path(f.path))
                    elif f.is_file(follow_symlinks=False):
                        size += f.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return size
