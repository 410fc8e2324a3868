"""What the scheduler (service.sharing.scheduler) takes and gives: job requests, quotas and decisions.

Frozen and typed, so that a schedule can be compared, logged and turned into events as it is. The
decisions carry their reason in words ("shrunk 4→2 to admit job h (priority 10)") for the events of the
affected jobs, and the ledger after them, from which each job's grant is read.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from service.sharing.ledger import Ledger, WorkerShape


class Phase(enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    """Paused by the scheduler (it holds nothing and wants its capacity back)."""
    QUEUED = "queued"


def _is_int(v: object, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


@dataclass(frozen=True, kw_only=True, slots=True)
class JobRequest:
    """One job that holds or wants capacity, as the policy reads it; the one record of what a job asks of
    the scheduler (the service's `JobView` carries one beside the job's status)."""

    job_id: str
    owner: str = ""
    """Who pays: the quota key (a user or an API token's name)."""
    priority: int = 0
    """Higher goes first."""
    min_workers: int = 1
    max_workers: int | None = None
    """None: as many as it can get."""
    weight: float = 1.0
    """Share of the extra workers among jobs of equal priority."""
    submitted: float = 0.0
    """Unix seconds; earlier goes first among equals."""
    phase: Phase = Phase.QUEUED
    """Where the job stands for the policy. A round (service.sharing.rounds) sets it from the job's status
    (`JobView.phase`) on the request it hands the policy."""
    shape: WorkerShape = field(default_factory=WorkerShape)

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ValueError(f"job_id must be a non-empty string, got {self.job_id!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"job {self.job_id}: priority must be an integer, got {self.priority!r}")
        if not _is_int(self.min_workers, 1):
            raise ValueError(f"job {self.job_id}: min_workers must be an integer >= 1, got {self.min_workers!r}")
        if self.max_workers is not None and not (_is_int(self.max_workers, 1) and self.max_workers >= self.min_workers):
            raise ValueError(f"job {self.job_id}: max_workers={self.max_workers!r} must be an integer >= "
                             f"min_workers={self.min_workers}, or None")
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or not self.weight > 0 \
                or not math.isfinite(self.weight):
            raise ValueError(f"job {self.job_id}: weight must be a number > 0, got {self.weight!r}")
        if not isinstance(self.phase, Phase):
            raise ValueError(f"job {self.job_id}: phase must be a Phase, got {self.phase!r}")

    @property
    def cap(self) -> int | float:
        return math.inf if self.max_workers is None else self.max_workers


@dataclass(frozen=True, kw_only=True, slots=True)
class Quota:
    max_workers: int | None = None
    """Most workers the owner's jobs may hold together; None: no limit."""
    max_jobs: int | None = None
    """Most of the owner's jobs holding workers at once; None: no limit."""
    max_priority: int | None = 0
    """Highest `scheduling.priority` the owner's jobs may ask for (the service refuses a higher one);
    None: no ceiling. A user the operator lists nowhere may ask for 0 at most."""

    def __post_init__(self) -> None:
        if self.max_priority is not None and not (isinstance(self.max_priority, int)
                                                  and not isinstance(self.max_priority, bool)):
            raise ValueError(f"quota max_priority must be an integer or None, got {self.max_priority!r}")
        for name in ("max_workers", "max_jobs"):
            v = getattr(self, name)
            if v is not None and not _is_int(v, 0):
                raise ValueError(f"quota {name} must be an integer >= 0 or None, got {v!r}")


# -- decisions ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Start:
    """Start a queued job on these workers."""
    job_id: str
    workers: int
    nodes: tuple[tuple[str, int], ...]
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """A running (or paused) job's workers go from `before` to `after`, on `nodes` ({node: workers} pairs)."""
    job_id: str
    before: int
    after: int
    nodes: tuple[tuple[str, int], ...]
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Shrink(Change):
    """Shrink a running job through the planned-resize path (0 steps redone)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Preempt:
    """Pause a running job, checkpoint first, to admit others; it is given back capacity later (a `Grow`
    from 0)."""
    job_id: str
    before: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Grow(Change):
    """Give capacity back: grow a running job, or resume a paused one (before == 0)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Queued:
    """A job that gets nothing yet: its place in the queue (1 = next) and why."""
    job_id: str
    position: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    grants: tuple[Start, ...] = ()
    resizes: tuple[Shrink, ...] = ()
    pauses: tuple[Preempt, ...] = ()
    returns: tuple[Grow, ...] = ()
    """In priority order."""
    queued: tuple[Queued, ...] = ()
    """In queue order."""
    ledger: Ledger = field(default_factory=Ledger)
    """The ledger once every decision is carried out: the grant of each job is its holding here."""

    def decision(self, job_id: str) -> Start | Shrink | Preempt | Grow | Queued | None:
        """What happens to one job (None: it keeps what it holds)."""
        for d in (*self.grants, *self.resizes, *self.pauses, *self.returns, *self.queued):
            if d.job_id == job_id:
                return d
        return None

    def grant(self, job_id: str) -> dict[str, int]:
        """{node_id: workers} the job may run on after this schedule (empty: none)."""
        h = self.ledger.held(job_id)
        return h.as_dict() if h else {}
