"""A job's journal: every move between lifecycle states and every note, in order, as events into a sink.

The lifecycle state itself is not kept here: it is the coordinator's state value, whose JobState the
journal reads (`current`) to stamp each note with the state it happened in. `moved` checks a move
against the one table of legal moves (service.control.state.TRANSITIONS) before it is made. What the
journal keeps is what the events need and the state value does not carry: the layout of the last group
(an event's old and new layout), the last step, and when the current state was entered. A sink that
raises is logged and does not undo the move: the lifecycle must not wedge because the event file could
not be written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from parallel.layout import Layout
from parallel.planner import Plan
from service.control.events import Cause, Event, EventKind
from service.control.reconfiguration import Reconfig
from service.control.state import IllegalTransition, JobState, TRANSITIONS

logger = logging.getLogger(__name__)

Sink = Callable[[Event], object]


class Journal:
    """`sink` receives every event (an `EventLog` is a sink); `clock` gives unix seconds, injectable so
    tests get exact times; `current` says the job's state now."""

    def __init__(self, job_id: str, *, current: Callable[[], JobState], sink: Sink | None = None,
                 clock: Callable[[], float] = time.time):
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"job_id must be a non-empty string, got {job_id!r}")
        self.job_id = job_id
        self._current = current
        self._sink = sink
        self._clock = clock
        self._lock = threading.RLock()  # re-entrant: a sink may read the journal
        self.layout: Layout | None = None
        """Layout of the current (or last) worker group."""
        self.step: int | None = None
        """Last step an event named."""
        self.since: float = clock()
        """When the current state was entered (unix seconds)."""

    def moved(self, to: JobState, *, reason: str, cause: Cause | None = None, layout: Layout | None = None,
              step: int | None = None) -> Event:
        """Record the move from the current state to `to` (raising IllegalTransition if the table forbids
        it), about to be made: a "transition" event carrying the old and new layout."""
        self._check(reason, step, cause)
        with self._lock:
            frm = self._current()
            if to not in TRANSITIONS[frm]:
                raise IllegalTransition(self.job_id, frm, to)
            old_layout = self.layout
            self.since = self._clock()
            if layout is not None:
                self.layout = layout
            if step is not None:
                self.step = step
            event = self._event(EventKind.TRANSITION, frm, to, reason, old_layout, cause, None, self.since)
            self._emit(event)  # under the lock so that the log order is the order of the moves
        return event

    def note(self, kind: EventKind, *, reason: str, step: int | None = None, cause: Cause | None = None,
             details: dict | None = None) -> Event:
        """Record a non-transition event (preemption notice, failure, checkpoint, ...) in the current
        state; from_state == to_state == the current state."""
        self._check(reason, step, cause)
        kind = EventKind(kind)
        if kind is EventKind.TRANSITION:
            raise ValueError("a move is recorded with moved(), not note(TRANSITION)")
        with self._lock:
            if step is not None:
                self.step = step
            now = self._current()
            event = self._event(kind, now, now, reason, self.layout, cause, details, self._clock())
            self._emit(event)
        return event

    def resized(self, record: Reconfig, *, plan: Plan, reason: str) -> Event:
        """Record a group formed for `plan`: a "resize" event built from its reconfiguration `record`,
        whose layouts, cause and resumed step it carries, the whole record (and the plan) in its details."""
        if record.new_layout is None or record.resumed_step is None:
            raise ValueError("a resize event needs a record of a formed group (Reconfig.formed)")
        self._check(reason, record.resumed_step, record.cause)
        with self._lock:
            self.step = record.resumed_step
            now = self._current()
            event = Event(time=self._clock(), job_id=self.job_id, kind=str(EventKind.RESIZE), from_state=str(now),
                          to_state=str(now), reason=reason,
                          old_layout=None if record.old_layout is None else record.old_layout.to_dict(),
                          new_layout=record.new_layout.to_dict(), step=record.resumed_step, cause=str(record.cause),
                          details={"plan": plan.to_dict(), **record.to_dict()})
            self._emit(event)
        return event

    @staticmethod
    def _check(reason: str, step: int | None, cause: Cause | None) -> None:
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"a reason is required (a non-empty string), got {reason!r}")
        if cause is not None and cause not in set(Cause):
            raise ValueError(f"cause must be one of {[str(c) for c in Cause]} or None, got {cause!r}")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be an integer >= 0 or None, got {step!r}")

    def _event(self, kind: EventKind, from_state: JobState, to_state: JobState, reason: str,
               old_layout: Layout | None, cause: Cause | None, details: dict | None, at: float) -> Event:
        return Event(time=at, job_id=self.job_id, kind=str(kind), from_state=str(from_state), to_state=str(to_state),
                     reason=reason, old_layout=None if old_layout is None else old_layout.to_dict(),
                     new_layout=None if self.layout is None else self.layout.to_dict(), step=self.step,
                     cause=None if cause is None else str(cause), details=dict(details or {}))

    def _emit(self, event: Event) -> None:
        if self._sink is None:
            return
        try:
            self._sink(event)
        except Exception:
            logger.warning("job %s: could not record event %s %s -> %s; the state change stands. "
                           "Check that the run directory is writable.", self.job_id, event.kind,
                           event.from_state, event.to_state, exc_info=True)
