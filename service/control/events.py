"""Job events: what happened to a job, in order, as one JSON line each in RUN_DIR/events.jsonl.

The event log is the job's history for the API and for post-mortems ("why did it shrink at step 1200?"),
so every state transition, resize, preemption notice, failure and checkpoint is an `Event`. The file is
append-only and flushed per line, so a crash loses at most the line being written; `read_events` skips
such a truncated last line, and `EventLog.load` also cuts it off so later appends start on a clean line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

class EventKind(StrEnum):
    """What an event records; one spelling each."""

    TRANSITION = "transition"
    """A move between lifecycle states."""
    RESIZE = "resize"
    """A group formed: its plan and its reconfiguration record."""
    PREEMPTION = "preemption"
    """A drain notice acted on."""
    FAILURE = "failure"
    """One failure (exactly one event per failure), or a command that could not be carried out."""
    FALLBACK = "fallback"
    """The job resumes from the last committed checkpoint where it hoped not to, and why."""
    CHECKPOINT = "checkpoint"
    CAPACITY = "capacity"
    SCHEDULE = "schedule"
    INFO = "info"


class Cause(StrEnum):
    """Why a job changed size or state; None where no cause applies."""

    PLANNED = "planned"
    """A start, or a shrink to the scheduler's grant."""
    GROW = "grow"
    PREEMPTION = "preemption"
    FAILURE = "failure"
    USER = "user"
    SCHEDULER = "scheduler"
    """The shared-cluster scheduler paused the job to give its workers to a job of higher priority."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """One thing that happened to a job. States and layouts are plain strings / dicts so that the log
    can be read without importing the coordinator."""

    time: float
    """Unix seconds."""
    job_id: str
    kind: str
    """An EventKind (a plain string here, so that a log a newer writer extended still loads)."""
    from_state: str | None = None
    """State before (for a transition); the current state for other kinds."""
    to_state: str | None = None
    """State after (for a transition); the current state for other kinds."""
    reason: str = ""
    """Human-readable why, with numbers."""
    old_layout: dict | None = None
    """Layout.to_dict() before the event, if there was one."""
    new_layout: dict | None = None
    """Layout.to_dict() after the event, if there is one."""
    step: int | None = None
    """Training step at the event, when known."""
    cause: str | None = None
    """A Cause, or None (checked by the writers, not here, so a newer log still loads)."""
    details: dict = field(default_factory=dict)
    """Anything else worth keeping (node ids, deadlines, error text); must be JSON-serialisable."""

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ValueError(f"event job_id must be a non-empty string, got {self.job_id!r}")
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"event kind must be a non-empty string, got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # StrEnum states serialise as their value; str() keeps a plain str unchanged.
        d["from_state"] = None if self.from_state is None else str(self.from_state)
        d["to_state"] = None if self.to_state is None else str(self.to_state)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Event":
        """Inverse of to_dict. Unknown keys are ignored so that an older reader can load a newer log."""
        if not isinstance(d, dict):
            raise ValueError(f"an event must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        missing = sorted({"time", "job_id", "kind"} - d.keys())
        if missing:
            raise ValueError(f"event is missing {missing}: {d!r}")
        return cls(**{k: v for k, v in d.items() if k in known})


def read_events(path: str | os.PathLike) -> list[Event]:
    """Events in the file at `path`. A last line that is cut off or not valid JSON is skipped with a
    warning (a crash mid-write); a bad line anywhere else raises ValueError naming the line."""
    events, _ = _read(Path(path))
    return events


def _read(path: Path) -> tuple[list[Event], int]:
    """(events, byte offset just after the last good line)."""
    data = path.read_bytes()
    events: list[Event] = []
    good_end = 0
    pos = 0
    lines = data.split(b"\n")
    for i, raw in enumerate(lines):
        last = i == len(lines) - 1
        end = pos + len(raw) + (0 if last else 1)
        if raw.strip():
            try:
                events.append(Event.from_dict(json.loads(raw)))
            except (ValueError, TypeError) as e:
                # Only the final line can be a torn write; a bad line before it is real corruption.
                if last or (i == len(lines) - 2 and not lines[-1]):
                    logger.warning("%s: skipping truncated last line %d (%d bytes): %s", path, i + 1, len(raw), e)
                    break
                raise ValueError(f"{path}: line {i + 1} is not a valid event: {e}") from e
        good_end = end
        pos = end
    return events, good_end


KEEP = 1000
"""Events an `EventLog` with a file keeps in memory: the newest, which the API asks for; older ones are
read back from the file when asked for, so a job that runs for days holds a bounded number."""


class EventLog:
    """Events kept in memory (for the API: `since(index)`) and, when `path` is given, appended to a
    JSON-lines file. Appending is the sink a `Journal` (service.control.journal) emits into. Thread-safe.

    With a file, only the newest `keep` events stay in memory; `since` and `events` read older ones
    back from the file (those of `job_id` only, when given: a run directory may hold an earlier job's).
    Without one, every event stays in memory. The constructor touches nothing on disk; the parent
    directory is created on the first append."""

    def __init__(self, path: str | os.PathLike | None = None, events: list[Event] | None = None, *,
                 keep: int = KEEP, job_id: str | None = None):
        if keep < 1:
            raise ValueError(f"EventLog keep must be >= 1, got {keep}")
        self.path = None if path is None else Path(path)
        self.keep = keep
        self.job_id = job_id
        events = list(events or [])
        self._events: list[Event] = events[-keep:] if self.path is not None else events
        self._first = len(events) - len(self._events)
        """Index of the first event kept in memory."""
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike, *, job_id: str | None = None) -> "EventLog":
        """Resume the log at `path` (an empty log if there is no file), keeping `job_id`'s events only
        when given. A truncated last line is dropped from the file as well, so the next append does not
        glue onto it."""
        path = Path(path)
        if not path.exists():
            return cls(path, job_id=job_id)
        events, good_end = _read(path)
        size = path.stat().st_size
        if good_end < size:
            logger.warning("%s: cutting %d bytes of a truncated last line", path, size - good_end)
            with open(path, "r+b") as f:
                f.truncate(good_end)
        elif size and not path.read_bytes().endswith(b"\n"):
            with open(path, "ab") as f:  # a complete last line whose newline was lost
                f.write(b"\n")
        if job_id is not None:
            events = [e for e in events if e.job_id == job_id]
        return cls(path, events, job_id=job_id)

    def append(self, event: Event) -> int:
        """Record `event`; returns its index. The line is written and flushed before this returns.
        If the write fails the event is still kept in memory and the OSError is raised."""
        if not isinstance(event, Event):
            raise ValueError(f"EventLog.append needs an Event, got {type(event).__name__}")
        line = event.to_json() + "\n"
        with self._lock:
            self._events.append(event)
            index = self._first + len(self._events) - 1
            if self.path is not None:
                if len(self._events) > self.keep:
                    drop = len(self._events) - self.keep
                    del self._events[:drop]
                    self._first += drop
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
                    f.flush()
        return index

    __call__ = append  # so an EventLog can be passed directly as a sink

    def since(self, index: int = 0) -> list[Event]:
        """Events from `index` on (a client remembers len() and asks for what is new)."""
        if index < 0:
            raise ValueError(f"since() index must be >= 0, got {index}")
        with self._lock:
            if index >= self._first:
                return self._events[index - self._first:]
            return self._from_file()[index:]

    def _from_file(self) -> list[Event]:
        """Every event of the log, older ones read back from the file (under the lock)."""
        on_disk = read_events(self.path)
        if self.job_id is not None:
            on_disk = [e for e in on_disk if e.job_id == self.job_id]
        return on_disk[:self._first] + self._events

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events) if self._first == 0 else self._from_file()

    def __len__(self) -> int:
        with self._lock:
            return self._first + len(self._events)
