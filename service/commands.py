"""What a user can ask of a running job, as values: the coordinator queues them from any thread and
applies them at the start of its next iteration (`Coordinator._apply`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class SetWorkers:
    """Run within a new worker range, acting at once (a user's request needs no settle time)."""

    min_workers: int
    max_workers: int


@dataclass(frozen=True, slots=True)
class Pause:
    """Checkpoint, release the workers, wait in PAUSED until Resume."""


@dataclass(frozen=True, slots=True)
class Resume:
    """Start again from the last checkpoint (PAUSED only)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Checkpoint, release the workers, end in STOPPED."""


Command = SetWorkers | Pause | Resume | Stop
