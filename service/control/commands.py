"""What a user can ask of a running job, as values: the coordinator queues them from any thread and
applies them at the start of its next iteration (`Coordinator._apply`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class SetWorkers:
    """Run within a new worker range, acting at once (a user's request needs no settle time). Holds what
    the user gave, not a whole range: it is applied to the range current when it is applied
    (`bounds`), so two quick resizes compose instead of the second undoing the first."""

    workers: int | None = None
    min_workers: int | None = None
    max_workers: int | None = None

    def bounds(self, lo: int, hi: int) -> tuple[int, int]:
        """The range (lo, hi) becomes."""
        lo = self.min_workers if self.min_workers is not None else lo
        hi = self.max_workers if self.max_workers is not None else hi
        if self.workers is not None:
            lo, hi = min(lo, self.workers), self.workers
        return lo, hi


@dataclass(frozen=True, kw_only=True, slots=True)
class Pause:
    """Checkpoint, release the workers, wait in PAUSED until Resume. `by`: "user", or "scheduler" when
    the shared-cluster scheduler gives the workers to a job of higher priority (`reason` says which)."""

    by: str = "user"
    reason: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Grant:
    """The shared-cluster scheduler's grant: plan onto these workers only ({node_id: workers}; {} none).
    `reason` is the decision in words; a job granted too few to start is QUEUED at `queue_position`."""

    nodes: dict[str, int]
    reason: str
    queue_position: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Resume:
    """Start again from the last checkpoint (PAUSED only); `by` "user" or "scheduler"."""

    by: str = "user"


@dataclass(frozen=True, slots=True)
class Stop:
    """Checkpoint, release the workers, end in STOPPED."""


Command = SetWorkers | Pause | Grant | Resume | Stop
