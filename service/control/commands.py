"""What a user or the shared-cluster scheduler can ask of a job, as values from edge to edge.

A command is built once where it enters (the REST route, the scheduler's round) and checked by its own
constructor; the job manager sends it whole to the job's driver, the command log persists it
(`to_json`) and replays it (`from_json`) into a restarted coordinator, and the coordinator queues it
and applies it at the start of its next step (`Inbox.apply_all`, service.control.inbox).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from service.control.events import Cause

PAUSERS = (Cause.USER, Cause.SCHEDULER)
"""Who may pause and resume a job."""
_PAUSERS = ", ".join(PAUSERS)


class CommandError(ValueError):
    """A command that cannot be applied; `field` is the request field it is about (None: the whole)."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # crosses Ray (job actor -> API) whole, field included
        return CommandError, (self.field, str(self))


def _count(name: str, v: object) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise CommandError(name, f"{name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SetWorkers:
    """Run within a new worker range, acting at once (a user's request needs no settle time): `workers`
    (at most that many), or `min_workers` and/or `max_workers`. Holds what the user gave, not a whole
    range: it is applied to the range current when it is applied (`bounds`), so two quick resizes
    compose instead of the second undoing the first."""

    kind: ClassVar[str] = "resize"
    workers: int | None = None
    min_workers: int | None = None
    max_workers: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            _count(f.name, getattr(self, f.name))
        if self.workers is None and self.min_workers is None and self.max_workers is None:
            raise CommandError(None, "give workers, or min_workers and/or max_workers")
        if self.workers is not None and (self.min_workers is not None or self.max_workers is not None):
            raise CommandError("workers", "give workers, or min_workers/max_workers, not both")
        if self.min_workers is not None and self.max_workers is not None and self.min_workers > self.max_workers:
            raise CommandError("max_workers", f"max_workers={self.max_workers} is less than "
                                              f"min_workers={self.min_workers}")

    def bounds(self, lo: int, hi: int | None) -> tuple[int, int | None]:
        """The range (lo, hi) becomes; CommandError when it would be empty."""
        lo = self.min_workers if self.min_workers is not None else lo
        hi = self.max_workers if self.max_workers is not None else hi
        if self.workers is not None:
            lo, hi = min(lo, self.workers), self.workers
        if hi is not None and hi < lo:
            raise CommandError("min_workers" if self.min_workers is not None else "max_workers",
                               f"max_workers={hi} is less than min_workers={lo}")
        return lo, hi


@dataclass(frozen=True, kw_only=True, slots=True)
class Pause:
    """Checkpoint, release the workers, wait in PAUSED until Resume. `by`: "user", or "scheduler" when
    the shared-cluster scheduler gives the workers to a job of higher priority (`reason` says which)."""

    kind: ClassVar[str] = "pause"
    by: str = "user"
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.by not in PAUSERS:
            raise CommandError("by", f"pause by must be one of {_PAUSERS}, got {self.by!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Resume:
    """Start again from the last checkpoint (PAUSED only); `by` "user" or "scheduler"."""

    kind: ClassVar[str] = "resume"
    by: str = "user"

    def __post_init__(self) -> None:
        if self.by not in PAUSERS:
            raise CommandError("by", f"resume by must be one of {_PAUSERS}, got {self.by!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Stop:
    """Checkpoint, release the workers, end in STOPPED."""

    kind: ClassVar[str] = "stop"


@dataclass(frozen=True, kw_only=True, slots=True)
class Grant:
    """The shared-cluster scheduler's grant: plan onto these workers only ({node_id: workers}; {} none).
    `reason` is the decision in words; a job granted too few to start is QUEUED at `queue_position`.
    `standby`: the most standby workers the job may keep besides (what its owner's worker quota leaves
    after the members: standbys count against it); None: as many as its spec asks."""

    kind: ClassVar[str] = "set_grant"
    nodes: dict[str, int]
    reason: str
    queue_position: int | None = None
    standby: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
                for k, v in self.nodes.items()):
            raise CommandError("nodes", f"a grant is {{node_id: workers >= 1}}, got {self.nodes!r}")
        if not isinstance(self.reason, str) or not self.reason:
            raise CommandError("reason", "a grant needs its reason (a non-empty string)")
        if self.standby is not None and not (isinstance(self.standby, int) and not isinstance(self.standby, bool)
                                             and self.standby >= 0):
            raise CommandError("standby", f"a grant's standby is a whole number >= 0 or None, got {self.standby!r}")


Command = SetWorkers | Pause | Resume | Stop | Grant

_KINDS: dict[str, type] = {c.kind: c for c in (SetWorkers, Pause, Resume, Stop, Grant)}


def to_json(cmd: Command) -> dict[str, Any]:
    """{"command": kind, "args": {field: value}} (fields left at None omitted): what the command log keeps."""
    return {"command": cmd.kind,
            "args": {f.name: getattr(cmd, f.name) for f in fields(cmd) if getattr(cmd, f.name) is not None}}


def from_json(d: Mapping[str, Any]) -> Command:
    """The command `to_json` gave; CommandError for anything else."""
    cls = _KINDS.get(d.get("command")) if isinstance(d, Mapping) else None
    args = d.get("args", {}) if isinstance(d, Mapping) else None
    if cls is None or not isinstance(args, Mapping):
        raise CommandError(None, f"not a command: {d!r}")
    try:
        return cls(**args)
    except TypeError as e:  # an unknown or missing field
        raise CommandError(None, f"{d.get('command')}: {e}") from None
