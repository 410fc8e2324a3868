"""What a job's run directory tells the job manager when it cannot ask the coordinator: the events of
events.jsonl (`JobStatus.finalized` turns them into the final state), the metrics from metrics.jsonl,
and the checkpoints directory's entries. Read-only."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from service.events import Event, EventLog, read_events

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
    log = EventLog.load(path)
    mine = [e for e in log.events if e.job_id == job_id]
    return log if len(mine) == len(log) else EventLog(path, mine)


def last_logged_step(run_dir: Path) -> int:
    """The step of the last complete line of RUN_DIR/metrics.jsonl (rank 0 writes one per step), or 0."""
    rows = read_metrics(run_dir / "metrics.jsonl", after=0)
    return rows[-1]["step"] if rows else 0


def where_it_stopped(prior: list[Event], run_dir: Path) -> tuple[int, str | None, dict | None]:
    """Where a lost coordinator of the job left it, from its events and metrics: the last step any of
    them names, the last state it entered and the last layout it ran."""
    last_step = max([e.step for e in prior if e.step is not None] + [last_logged_step(run_dir)])
    last_state = next((e.to_state for e in reversed(prior) if e.kind == "transition"), None)
    layout = next((e.new_layout for e in reversed(prior) if e.new_layout), None)
    return last_step, last_state, layout


def read_metrics(path: Path, *, after: int) -> list[dict]:
    """Rows of metrics.jsonl after step `after` (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if isinstance(m, dict) and isinstance(m.get("step"), int) and m["step"] > after:
            out.append(m)
    return out


def list_checkpoints(ck: str | None, run_dir: str) -> dict:
    """The checkpoints directory's entries (a remote checkpoint.dir is not listed)."""
    if ck and "://" in ck and not ck.lower().startswith("file://"):
        return {"dir": ck, "latest": None, "entries": [], "note": "remote checkpoint dirs are not listed"}
    d = Path(ck[len("file://"):] if ck and "://" in ck else ck) if ck else Path(run_dir) / "checkpoints"
    entries = []
    latest = None
    if d.is_dir():
        for p in sorted(d.iterdir()):
            if p.name == "latest" and p.is_file():
                latest = p.read_text(errors="replace").strip() or None
                continue
            m = re.fullmatch(r"step-(\d+)", p.name)
            entries.append({
                "name": p.name, "step": int(m.group(1)) if m else None, "is_dir": p.is_dir(),
                "committed": p.is_dir() and (p / "manifest.json").is_file(),
                "bytes": sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size,
                "modified": p.stat().st_mtime,
            })
    return {"dir": str(d), "latest": latest, "entries": entries}
