"""The job lifecycle as an explicit state machine: which states exist, which moves are legal, and an
event for every move.

Keeping the legal moves in one table (rather than in `if` chains across the coordinator) means an
impossible sequence such as PAUSED -> RUNNING fails loudly at the point it is attempted, and the table
itself documents the lifecycle. The coordinator decides *when* to move; this module only checks and
records. Data flows one way: `transition()` updates the state and emits an `Event` into the sink.

Lifecycle (who moves it):
  PENDING -> STARTING               coordinator picks up the job
  STARTING -> RUNNING               worker group formed, first step taken
  RUNNING -> RESIZING               policy says Resize (grow, or shrink ahead of a drain deadline)
  RUNNING/STARTING/RESIZING -> RECOVERING   a worker or node died; restart from the last checkpoint
  * -> WAITING_FOR_CAPACITY         fewer usable workers than min_workers; no workers held
  * -> QUEUED                       on a shared cluster, the scheduler grants fewer than min_workers
  RUNNING -> PAUSED                 user pause (after a checkpoint); PAUSED -> STARTING on resume
  SUCCEEDED / FAILED / STOPPED      terminal: no way out

Changes from the issue's sketch, and why:
  - PENDING -> STOPPED | FAILED: a queued job can be cancelled, or rejected before it starts (e.g. no
    valid layout for its spec) without pretending to start.
  - WAITING_FOR_CAPACITY -> PAUSED: a user can pause a job that is waiting for nodes; otherwise the
    only way to park it would be STOPPED, which is terminal.
  - QUEUED (issue 16), entered where WAITING_FOR_CAPACITY is when the shared-cluster scheduler, not the
    cluster, is why the job cannot start; left the same ways, and to WAITING_FOR_CAPACITY when it is
    granted workers the cluster then lacks.
  - PENDING -> PAUSED: a job paused before it starts, or a restarted coordinator replaying the user's
    pause (service.server.command_log), stays parked without forming a worker group first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from enum import StrEnum

from parallel.layout import Layout
from service.control.events import CAUSES, Event

logger = logging.getLogger(__name__)


class JobState(StrEnum):
    PENDING = "PENDING"
    """Accepted, not yet started."""
    STARTING = "STARTING"
    """Planning a layout and bringing up the worker group (possibly from a checkpoint)."""
    RUNNING = "RUNNING"
    """Training steps are being taken."""
    RESIZING = "RESIZING"
    """Checkpointing and re-forming the worker group at a new size (a planned change)."""
    RECOVERING = "RECOVERING"
    """Restarting after an unplanned loss (worker crash, node death) from the last checkpoint."""
    WAITING_FOR_CAPACITY = "WAITING_FOR_CAPACITY"
    """Fewer usable workers than min_workers; holds no workers until capacity returns."""
    QUEUED = "QUEUED"
    """On a shared cluster: waiting for the scheduler to grant min_workers (its place and why: the status)."""
    PAUSED = "PAUSED"
    """Stopped by the user after a checkpoint; can be resumed."""
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    """Stopped by the user for good."""

    @property
    def is_terminal(self) -> bool:
        """No transition leaves this state; the job's workers are gone for good."""
        return self in TERMINAL

    @property
    def is_active(self) -> bool:
        """The job holds, or is bringing up, a worker group (so it is using cluster resources)."""
        return self in _ACTIVE


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED})
"""The final states, the only definition of them (a StrEnum: `"FAILED" in TERMINAL` holds too)."""
_ACTIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.RESIZING, JobState.RECOVERING})
WAITING = frozenset({JobState.WAITING_FOR_CAPACITY, JobState.QUEUED, JobState.PAUSED})
"""Holding no workers until something outside the job changes (the cluster, the scheduler, the user):
the status's reason says what it waits for."""

_S = JobState
TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    _S.PENDING: frozenset({_S.STARTING, _S.QUEUED, _S.STOPPED, _S.FAILED, _S.PAUSED}),
    _S.STARTING: frozenset({_S.RUNNING, _S.WAITING_FOR_CAPACITY, _S.QUEUED, _S.FAILED, _S.RECOVERING, _S.STOPPED}),
    _S.RUNNING: frozenset({_S.RESIZING, _S.RECOVERING, _S.PAUSED, _S.SUCCEEDED, _S.FAILED, _S.STOPPED}),
    _S.RESIZING: frozenset({_S.RUNNING, _S.RECOVERING, _S.WAITING_FOR_CAPACITY, _S.FAILED, _S.STOPPED}),
    _S.RECOVERING: frozenset({_S.RUNNING, _S.WAITING_FOR_CAPACITY, _S.QUEUED, _S.FAILED, _S.STOPPED}),
    _S.WAITING_FOR_CAPACITY: frozenset({_S.STARTING, _S.RECOVERING, _S.QUEUED, _S.PAUSED, _S.STOPPED, _S.FAILED}),
    _S.QUEUED: frozenset({_S.STARTING, _S.RECOVERING, _S.WAITING_FOR_CAPACITY, _S.PAUSED, _S.STOPPED, _S.FAILED}),
    _S.PAUSED: frozenset({_S.STARTING, _S.STOPPED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.STOPPED: frozenset(),
}
"""Allowed moves: TRANSITIONS[from] is the set of legal `to` states."""
del _S


class IllegalTransition(RuntimeError):
    """A move the lifecycle does not allow; the message names both states and the legal ones."""

    def __init__(self, job_id: str, from_state: JobState, to_state: JobState):
        self.from_state, self.to_state = from_state, to_state
        legal = ", ".join(sorted(TRANSITIONS[from_state])) or "none: it is terminal"
        super().__init__(f"job {job_id}: illegal transition {from_state} -> {to_state} "
                         f"(allowed from {from_state}: {legal})")


def can_transition(from_state: JobState | str, to_state: JobState | str) -> bool:
    return JobState(to_state) in TRANSITIONS[JobState(from_state)]


Sink = Callable[[Event], object]


def _as_layout(layout: Layout | Mapping | None) -> Layout | None:
    if layout is None or isinstance(layout, Layout):
        return layout
    if isinstance(layout, Mapping):
        return Layout.from_dict(dict(layout))
    raise ValueError(f"layout must be a Layout, a dict or None, got {type(layout).__name__}")


class StateMachine:
    """One job's current state and its data (layout, step, reason, when it was entered).

    `sink` receives every event (an `EventLog` is a sink); `clock` gives unix seconds, injectable so
    tests get exact times. A sink that raises is logged and does not undo the move: the lifecycle must
    not wedge because the event file could not be written.
    """

    def __init__(self, job_id: str, *, sink: Sink | None = None, clock: Callable[[], float] = time.time,
                 state: JobState = JobState.PENDING):
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"job_id must be a non-empty string, got {job_id!r}")
        self.job_id = job_id
        self._sink = sink
        self._clock = clock
        self._lock = threading.RLock()  # re-entrant: a sink may read snapshot()
        self.state = JobState(state)
        self.layout: Layout | None = None
        """Layout of the current (or last) worker group."""
        self.step: int | None = None
        """Last known training step."""
        self.reason = "submitted" if self.state is JobState.PENDING else ""
        """Why the job is in its current state."""
        self.cause: str | None = None
        """Cause of the last transition, one of CAUSES or None."""
        self.since: float = clock()
        """When the current state was entered (unix seconds)."""

    def can(self, to: JobState | str) -> bool:
        return can_transition(self.state, to)

    def transition(self, to: JobState | str, *, reason: str, layout: Layout | Mapping | None = None,
                   step: int | None = None, cause: str | None = None, details: dict | None = None) -> Event:
        """Move to `to` (raising IllegalTransition if the table forbids it), update layout/step when
        given, and emit a "transition" event carrying the old and new layout."""
        to = JobState(to)
        self._check(reason, step, cause)
        new_layout = _as_layout(layout)
        with self._lock:
            if to not in TRANSITIONS[self.state]:
                raise IllegalTransition(self.job_id, self.state, to)
            old_state, old_layout = self.state, self.layout
            self.state, self.reason, self.cause, self.since = to, reason, cause, self._clock()
            if new_layout is not None:
                self.layout = new_layout
            if step is not None:
                self.step = step
            event = self._event("transition", old_state, to, reason, old_layout, cause, details)
            self._emit(event)  # under the lock so that the log order is the order of the moves
        return event

    def note(self, kind: str, *, reason: str, step: int | None = None, cause: str | None = None,
             details: dict | None = None) -> Event:
        """Emit a non-transition event (preemption notice, failure, checkpoint, ...) in the current
        state; from_state == to_state == the current state."""
        self._check(reason, step, cause)
        if kind == "transition":
            raise ValueError("use transition() for state changes, not note('transition')")
        with self._lock:
            if step is not None:
                self.step = step
            event = self._event(kind, self.state, self.state, reason, self.layout, cause, details)
            self._emit(event)
        return event

    def snapshot(self) -> dict:
        """The current state and data as JSON-ready values (for the API)."""
        with self._lock:
            return {"job_id": self.job_id, "state": str(self.state), "reason": self.reason, "cause": self.cause,
                    "since": self.since, "step": self.step,
                    "layout": None if self.layout is None else self.layout.to_dict()}

    # -- internals ---------------------------------------------------------------------------------
    @staticmethod
    def _check(reason: str, step: int | None, cause: str | None) -> None:
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"a reason is required (a non-empty string), got {reason!r}")
        if cause is not None and cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES} or None, got {cause!r}")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be an integer >= 0 or None, got {step!r}")

    def _event(self, kind: str, from_state: JobState, to_state: JobState, reason: str,
               old_layout: Layout | None, cause: str | None, details: dict | None) -> Event:
        return Event(time=self.since if kind == "transition" else self._clock(), job_id=self.job_id,
                     kind=kind, from_state=str(from_state), to_state=str(to_state), reason=reason,
                     old_layout=None if old_layout is None else old_layout.to_dict(),
                     new_layout=None if self.layout is None else self.layout.to_dict(),
                     step=self.step, cause=cause, details=dict(details or {}))

    def _emit(self, event: Event) -> None:
        if self._sink is None:
            return
        try:
            self._sink(event)
        except Exception:
            logger.warning("job %s: could not record event %s %s -> %s; the state change stands. "
                           "Check that the run directory is writable.", self.job_id, event.kind,
                           event.from_state, event.to_state, exc_info=True)
