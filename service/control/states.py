"""What a job is doing, as values: one small frozen class per state, carrying everything that state acts on.

The coordinator holds exactly one of these (`Coordinator.state`); each `step()` runs the handler of its
class, which returns the next value. The lifecycle state the API and the event log show is derived
from the value (`name`, a service.control.state.JobState); two values of the same name (a `Running`
before and after a chunk of steps) are one state to the outside. The workers the job holds travel in
the values too: `Running` and `Resizing` carry the formed group and the plan it runs, the states
without a formed group (`Unformed`) whatever workers are kept for the next one (a failed group's
survivors, warm processes, workers taken over) and what it may form from. `Paused` and `Ended` hold none.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.planner import Plan
from service.control.events import Cause
from service.control.policy import Resize, Wait
from service.control.reconfiguration import Reconfig
from service.control.source import Survivors
from service.control.state import JobState
from service.pool.group import Group


@dataclass(frozen=True, kw_only=True, slots=True)
class Adopting:
    """A restarted coordinator's first step: take over the workers the lost one left running. Commands
    wait until it is done (a replayed pause must release them too).

    Its lifecycle name is PENDING, on purpose: the job's state says what this coordinator has done for
    it, and it has started nothing yet, as after a restart without detached workers (`Pending`). The
    step lasts one controller iteration (`Takeover.adopt` asks the workers where they stand) and ends
    in RUNNING (the old group trains on) or in a start or recovery; what it is doing meanwhile is in
    the status's reason and in the `failure` event of kind `coordinator_restarted` before it."""

    reason: str
    cause: Cause | None = Cause.FAILURE
    lost: Plan | None = None
    """The plan the lost coordinator's group ran; None if it formed none."""
    record: Reconfig | None = None
    name = JobState.PENDING


@dataclass(frozen=True, kw_only=True, slots=True)
class Unformed:
    """What every state without a formed group carries: why it is in it, the workers kept for the next
    group, and what that group may form from."""

    reason: str
    cause: Cause | None = None
    group: Group | None = None
    """Workers kept without a formed group (a failed group's survivors, warm spares and standbys, the
    workers a restarted coordinator took over), for the next start to reuse; None: none."""
    survivors: Survivors | None = None
    """What the kept workers can form the next group from (None: the last committed checkpoint)."""
    record: Reconfig | None = None
    """The reconfiguration under way (a failure's), closed by the next group's first step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pending(Unformed):
    """Accepted, not started."""

    name = JobState.PENDING


@dataclass(frozen=True, kw_only=True, slots=True)
class Starting(Unformed):
    """Start a group as soon as the policy allows."""

    name = JobState.STARTING


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovering(Unformed):
    """The group failed running `failed_plan`; `group` holds what the recovery kept of it."""

    failed_plan: Plan | None = None
    name = JobState.RECOVERING


@dataclass(frozen=True, kw_only=True, slots=True)
class Waiting(Unformed):
    """Until the cluster (or, `by_scheduler`, the shared-cluster scheduler) offers enough. Holds no worker,
    except after a restart queued before its first start (taken over, kept until it can start)."""

    by_scheduler: bool = False

    @property
    def name(self) -> JobState:
        return JobState.QUEUED if self.by_scheduler else JobState.WAITING_FOR_CAPACITY


@dataclass(frozen=True, kw_only=True, slots=True)
class Running:
    """`group` trains, formed for `plan`. `record`: the reconfiguration that formed it, open until its
    first step; `durable_due`: it was formed from live state, so a durable checkpoint follows that first
    step; `resize_requested`: the user changed the worker range, and the policy acts on it at once;
    `drains_noted`: the draining nodes the group trains on with, their hold already in the journal."""

    reason: str
    cause: Cause | None = None
    group: Group
    plan: Plan
    record: Reconfig | None = None
    durable_due: bool = False
    resize_requested: bool = False
    drains_noted: frozenset[str] = frozenset()
    name = JobState.RUNNING


@dataclass(frozen=True, kw_only=True, slots=True)
class Resizing:
    """The sound `group` (running `plan`) changes size: `decision` (Resize, or Wait: release everything)
    taken at `detected` for `cause`; where the state comes from is `choose_source`'s answer when it is
    acted on."""

    reason: str
    cause: Cause
    group: Group
    plan: Plan
    decision: Resize | Wait
    detected: float
    record: Reconfig | None = None
    name = JobState.RESIZING


@dataclass(frozen=True, kw_only=True, slots=True)
class Paused:
    """Parked by the user or the scheduler after a checkpoint, holding nothing."""

    reason: str
    cause: Cause | None = None
    name = JobState.PAUSED


@dataclass(frozen=True, kw_only=True, slots=True)
class Ended:
    """SUCCEEDED, FAILED or STOPPED: no way out, nothing held."""

    final: JobState
    reason: str
    cause: Cause | None = None

    def __post_init__(self) -> None:
        if not self.final.is_terminal:
            raise ValueError(f"Ended needs a final state, got {self.final}")

    @property
    def name(self) -> JobState:
        return self.final


State = Adopting | Pending | Starting | Recovering | Waiting | Running | Resizing | Paused | Ended
"""Every value `Coordinator.state` can hold."""


def held(state: State) -> Group | None:
    """The workers `state` holds (None: none)."""
    return getattr(state, "group", None)
