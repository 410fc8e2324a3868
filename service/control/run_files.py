"""What a job's run directory tells the job manager when it cannot ask the coordinator: the events of
events.jsonl (`JobStatus.finalized` turns them into the final state), the metrics from metrics.jsonl,
and the checkpoints directory's entries. Read-only."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

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


def where_it_stopped(prior: list[Event], run_dir: Path) -> tuple[int, str | None, dict | None]:
    """Where a lost coordinator of the job left it, from its events and metrics: the last step any of
    them names, the last state it entered and the last layout it ran."""
    last_step = max([e.step for e in prior if e.step is not None] + [last_logged_step(run_dir)])
    last_state = next((e.to_state for e in reversed(prior) if e.kind == "transition"), None)
    layout = next((e.new_layout for e in reversed(prior) if e.new_layout), None)
    return last_step, last_state, layout


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


def list_checkpoints(ck: str | None, run_dir: str) -> dict:
    """The checkpoints directory's entries (a remote checkpoint.dir is not listed). Entries that vanish
    while they are listed (retention deletes old checkpoints as new ones commit) are left out."""
    if ck and "://" in ck and not ck.lower().startswith("file://"):
        return {"dir": ck, "latest": None, "entries": [], "note": "remote checkpoint dirs are not listed"}
    d = Path(ck[len("file://"):] if ck and "://" in ck else ck) if ck else Path(run_dir) / "checkpoints"
    entries = []
    latest = None
    try:
        children = sorted(d.iterdir()) if d.is_dir() else []
    except OSError:
        children = []
    for p in children:
        try:
            if p.name == "latest" and p.is_file():
                latest = p.read_text(errors="replace").strip() or None
                continue
            entries.append(_entry(p))
        except OSError:  # deleted (or replaced) between the listing and the look: not there any more
            continue
    return {"dir": str(d), "latest": latest, "entries": entries}


def _entry(p: Path) -> dict:
    m = re.fullmatch(r"step-(\d+)", p.name)
    is_dir = p.is_dir()
    size = 0
    if is_dir:
        for f in p.rglob("*"):
            try:
                size += f.stat().st_size if f.is_file() else 0
            except OSError:
                pass
    else:
        size = p.stat().st_size
    return {"name": p.name, "step": int(m.group(1)) if m else None, "is_dir": is_dir,
            "committed": is_dir and (p / "manifest.json").is_file(), "bytes": size, "modified": p.stat().st_mtime}
