"""What a job is doing, as values: one small frozen class per state, carrying the data that state acts on.

The coordinator holds exactly one of these (`Coordinator.state`); each `step()` runs the handler of its
class, which returns the next value. `name` is the lifecycle state the API and the event log show
(service.control.state.JobState); two values of the same name (a `Running` before and after a chunk of
steps) are one state to the outside. The resources the job holds across states (its worker group and
the plan that group runs) are in the context the coordinator shares with its parts
(service.control.context): what is decided lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.planner import Plan
from service.control.policy import Resize, Wait
from service.control.reconfiguration import Reconfig
from service.control.source import Survivors
from service.control.state import JobState


@dataclass(frozen=True, kw_only=True, slots=True)
class Adopting:
    """A restarted coordinator's first step: take over the workers the lost one left running. Commands
    wait until it is done (a replayed pause must release them too)."""

    reason: str
    cause: str | None = "failure"
    lost: Plan | None = None
    """The plan the lost coordinator's group ran; None if it formed none."""
    record: Reconfig | None = None
    name = JobState.PENDING


@dataclass(frozen=True, kw_only=True, slots=True)
class Pending:
    """Accepted, not started. After a restart: `survivors` taken over that can heal the next group."""

    reason: str = "submitted"
    cause: str | None = None
    survivors: Survivors | None = None
    record: Reconfig | None = None
    name = JobState.PENDING


@dataclass(frozen=True, kw_only=True, slots=True)
class Starting:
    """No group yet: start one as soon as the policy allows."""

    reason: str
    cause: str | None = None
    survivors: Survivors | None = None
    record: Reconfig | None = None
    name = JobState.STARTING


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovering:
    """The group failed. `survivors`: the workers that hold every shard between them, to heal from (None:
    the next group loads the last committed checkpoint); `record`: the reconfiguration under way."""

    reason: str
    cause: str | None = "failure"
    survivors: Survivors | None = None
    record: Reconfig | None = None
    name = JobState.RECOVERING


@dataclass(frozen=True, kw_only=True, slots=True)
class Waiting:
    """Holding no worker until the cluster (or, `by_scheduler`, the shared-cluster scheduler) offers enough.
    `record`: a failure's reconfiguration, closed once the job runs again."""

    reason: str
    cause: str | None = None
    by_scheduler: bool = False
    survivors: Survivors | None = None
    """Only after a restart queued before its first start: taken over, kept until it can start."""
    record: Reconfig | None = None

    @property
    def name(self) -> JobState:
        return JobState.QUEUED if self.by_scheduler else JobState.WAITING_FOR_CAPACITY


@dataclass(frozen=True, kw_only=True, slots=True)
class Running:
    """The group trains. `record`: the reconfiguration that formed it, open until its first step;
    `durable_due`: it was formed from live state, so a durable checkpoint follows that first step;
    `resize_requested`: the user changed the worker range, and the policy acts on it at once."""

    reason: str
    cause: str | None = None
    record: Reconfig | None = None
    durable_due: bool = False
    resize_requested: bool = False
    name = JobState.RUNNING


@dataclass(frozen=True, kw_only=True, slots=True)
class Resizing:
    """A sound group changes size: `decision` (Resize, or Wait: release everything) taken at `detected`
    for `cause`; where the state comes from is `choose_source`'s answer when it is acted on."""

    reason: str
    cause: str
    decision: Resize | Wait
    detected: float
    record: Reconfig | None = None
    name = JobState.RESIZING


@dataclass(frozen=True, kw_only=True, slots=True)
class Paused:
    """Parked by the user or the scheduler after a checkpoint, holding nothing."""

    reason: str
    cause: str | None = None
    name = JobState.PAUSED


@dataclass(frozen=True, kw_only=True, slots=True)
class Ended:
    """SUCCEEDED, FAILED or STOPPED: no way out."""

    final: JobState
    reason: str
    cause: str | None = None

    def __post_init__(self) -> None:
        if not self.final.is_terminal:
            raise ValueError(f"Ended needs a final state, got {self.final}")

    @property
    def name(self) -> JobState:
        return self.final


State = Adopting | Pending | Starting | Recovering | Waiting | Running | Resizing | Paused | Ended
"""Every value `Coordinator.state` can hold."""
