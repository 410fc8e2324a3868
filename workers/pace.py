"""When peer snapshots are taken: every `checkpoint.peer_interval` steps at the most, and less often
when what they cost exceeds `checkpoint.peer_budget` of the training time.

A snapshot costs the training thread its `take` (waiting for the previous round, the agreement), and it
slows the steps that run while its round copies, sends and receives in the background (the next step's
update waits for the copy: `PeerSnapshots.settle`; on a GPU box that work hardly shows, on a box whose
cores the steps already fill it can cost a third of a step). Both are measured here, from the steps themselves:

    pace = Pace(every=1, budget=0.1, start=step)
    busy = snaps.in_flight(); dt = <time one step>; pace.step_ended(dt, busy=busy)
    if pace.due(step):
        k = agree_max(pace.propose())          # every rank proposes, the largest wins (one collective)
        taken = <take the snapshot>; pace.taken(step, k, taken_seconds)

A step is *busy* when a round was in flight as it started, *clean* otherwise. One snapshot's cost is its
`take` plus, for each busy step after it, that step's time less the median clean step (signed: on a noisy
box a busy step as often runs faster than the median as slower, and only the difference of the medians
is the round's). The interval is
the smallest `k >= every` whose median cost stays within `budget` of `k` clean steps, at most `cap`.
While no clean step has been seen (every step ran beside a round) the interval grows by one step past
the busy ones, until one is; when the interval is `every` and rounds fill every step, one in
`PROBE_EVERY` snapshots leaves a step clean, so that the baseline follows the job.

`budget` 0: exactly every `every` steps, nothing measured (the steps redone after a kill are then at most
`every - 1`; with a budget the interval, and so the steps a kill redoes, follows the cost)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 8
"""Snapshot costs and clean steps remembered (the newest)."""
PROBE_EVERY = 16
"""At the shortest interval with no clean step: one snapshot in this many leaves a step clean."""


@dataclass(slots=True)
class Pace:
    every: int
    """The fewest steps between snapshots (`checkpoint.peer_interval`, > 0)."""
    budget: float
    """The share of training time snapshots may cost (`checkpoint.peer_budget`); 0: every `every` steps."""
    start: int = 0
    """The step training resumes from: the first snapshot follows the first multiple of `every` after it."""
    cap: int | None = None
    """The most steps between snapshots (None: no bound)."""
    interval: int = 0
    """The agreed steps between the last snapshot and the next (0: before the first)."""
    next_due: int = 0
    clean: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    """Seconds of the newest clean steps."""
    costs: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    """Seconds each of the newest measured snapshots cost."""
    _take_s: float | None = None
    """The `take` of the last snapshot, while its busy steps are being counted."""
    _busy: list = field(default_factory=list)
    """Seconds of the busy steps since the last snapshot."""
    _since_clean: int = 0
    """Snapshots since the last clean step."""

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ValueError(f"Pace.every must be > 0, got {self.every}")
        self.interval = self.every
        self.next_due = (self.start // self.every + 1) * self.every

    def due(self, step: int) -> bool:
        """Whether a snapshot follows step `step` (the same answer on every rank: it depends only on
        the agreed interval)."""
        return step >= self.next_due

    def step_ended(self, seconds: float, *, busy: bool) -> None:
        """One training step took `seconds`; `busy`: a round was in flight as it started."""
        if self.budget <= 0:
            return
        if busy:
            self._busy.append(seconds)
        else:
            self.clean.append(seconds)
            self._since_clean = 0

    def propose(self) -> int:
        """This rank's interval until the snapshot after the one about to be taken (the ranks agree on the
        largest)."""
        if self.budget <= 0:
            return self.every
        self._close()
        if not self.clean:  # every step so far ran beside a round: leave one clean
            k = max(self.every, len(self._busy) + 1)
        elif not self.costs:
            k = self.interval
        else:
            base = statistics.median(self.clean)
            cost = statistics.median(self.costs)  # below 0 (a round beside faster steps): `every`
            # (less a hair, so that a cost of exactly the budget keeps the interval despite rounding)
            k = max(self.every, math.ceil(cost / (self.budget * base) - 1e-9) if base > 0 else self.every)
            if k == self.every and self._since_clean >= PROBE_EVERY:
                k += 1
                self._since_clean = 0
        self._busy = []
        return k if self.cap is None else max(self.every, min(k, self.cap))

    def taken(self, step: int, interval: int, take_s: float) -> None:
        """The snapshot after step `step` was taken, costing the training thread `take_s`; the ranks
        agreed on `interval` steps until the next."""
        self.interval = interval
        self.next_due = step + interval
        self._take_s = take_s if self.budget > 0 else None
        self._since_clean += 1

    def _close(self) -> None:
        """The last snapshot's cost, now that the steps after it have run (measurable only against a
        clean baseline)."""
        if self._take_s is None or not self.clean:
            return
        base = statistics.median(self.clean)
        # signed: a busy step faster than the median clean one is noise that offsets a slower one; the
        # positive parts alone would count the box's noise as the snapshots' cost
        self.costs.append(self._take_s + sum(s - base for s in self._busy))
        self._take_s = None
