"""What the coordinator knows of a worker group, with no Ray in it: the `Group` protocol (service.pool.worker_group's
`WorkerGroup` over Ray actors is one, the fakes in tests/fakes.py are others), what its calls return, and
`WorkerFailure`, which they raise."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from parallel.planner import Plan
from workers.report import Salvaged, Seconds, StepMetrics, Trained


class FailureKind(StrEnum):
    """What went wrong, one spelling per kind: the retry budget counts failures by it, and the failure
    policy (service.control.failure) answers by it. A node's loss is NODE_LOST whoever notices it first
    (the watcher, a probe beside a wait, a worker's death on that node once a probe finds it dead)."""

    NODE_LOST = "node_lost"
    """A node hosting workers is gone or does not answer a probe."""
    WORKER_DIED = "worker_died"
    """A worker process died (its actor is gone) on a node not known to be dead."""
    TIMED_OUT = "timed_out"
    """A call on the workers did not end in time (a collective hung, a start never answered)."""
    WORKER_RAISED = "worker_raised"
    """A worker raised an exception."""
    CONFIG_REJECTED = "config_rejected"
    """A worker found the job's configuration unusable (ConfigError): no restart mends it."""
    START_FAILED = "start_failed"
    """Workers could not be placed in time."""
    OUT_OF_STEP = "out_of_step"
    """The ranks resumed or handed over at different steps."""
    COORDINATOR_RESTARTED = "coordinator_restarted"
    """The job's coordinator process was lost and started again."""


class WorkerFailure(RuntimeError):
    """A worker died or raised. `kind` groups repeated failures of the same sort for the retry budget;
    `nodes`: nodes the group's own probe found unresponsive (NODE_LOST), which the recovery neither
    waits for nor probes again."""

    def __init__(self, kind: FailureKind, message: str, *, nodes: Collection[str] = ()):
        super().__init__(message)
        self.kind = FailureKind(kind)
        self.nodes = frozenset(nodes)


class Fate(StrEnum):
    """What a group does with a member once it has answered a salvage (the recovery decides it:
    service.control.failure.fate)."""

    KEEP = "keep"
    """It holds live shards or peer snapshots: it stays a member, to form the next group from."""
    IDLE = "idle"
    """It holds nothing, but is sound and idle: kept as a warm process for the next start."""
    STOP = "stop"
    """Dead, stuck, silent, or a save of it still running: stopped."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Formed:
    """A process group formed over the members (`Group.form`)."""

    step: int
    """The step every rank resumed at."""
    form_s: float = 0.0
    """Seconds from the call until every rank had joined."""
    form_parts: Seconds = Seconds()
    """The slowest rank's seconds per part of its join (`Worker.join`: the process group, the trainer's
    build and its parts, the adoption of moved state)."""
    snapshot_bytes: int = 0
    """Host memory the peer snapshots take on the rank that needs most (0: snapshots off)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Started:
    """The members a `Group.scale_to` arranged: how many processes came up and how many went."""

    started: int
    """Workers that became members by starting (a new process, or a standby claimed for the slot)."""
    stopped: int
    """Members stopped because the new size has no place for them."""
    from_standby: int = 0
    """Of `started`, the standbys claimed instead of new processes."""
    rejoined: int = 0
    """Members a salvage kept idle that came back: kept, not started."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Salvage:
    """What a `Group.salvage` kept of a failed group."""

    kept: dict[int, Salvaged] = field(default_factory=dict)
    """Each member that vouches for its shards, by its old rank (in rank order): the survivors to heal from."""
    idle: int = 0
    """Members kept as idle processes for the next start: sound, but with no state to heal from."""
    stopped_why: tuple[str, ...] = ()
    """Why each member that was stopped was stopped (its own reason, or that it did not answer or was on
    a dead node), in member order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CarriedOn:
    """Whether the workers a lost coordinator left training still form its group, sound, at one step
    (`Group.carry_on`): then the group goes on as it is, nothing re-formed or moved."""

    step: int | None = None
    """The step they are at; None if they do not (`why` says why)."""
    why: str | None = None
    committed_step: int = 0
    rows: tuple[StepMetrics, ...] = ()
    """Rank 0's metrics rows of the last call the lost coordinator sent (it never read them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Moved:
    """A live reshard done (`Group.reshard`): the group formed on the new layout, and how it got there."""

    step: int
    """The step the new layout resumed at (the old layout's, carried over)."""
    started: int
    """Workers started for the new layout."""
    stopped: int
    """Workers of the old layout stopped."""
    bytes_moved: int
    """Bytes the new ranks received from other workers (a survivor's own pieces are not counted)."""
    handover_s: float = 0.0
    """Seconds for the old layout's workers to hand their shards over and leave their group, and for the
    joiners to start (`start_s` of it)."""
    start_s: float = 0.0
    """Of `handover_s`: seconds to arrange the new layout's members (start new workers, claim standbys)."""
    from_standby: int = 0
    """Of the workers started, the standbys claimed instead of new processes."""
    transfer_s: float = 0.0
    """Seconds of the transfer call: the transfer group's rendezvous, the plan, the send/recv."""
    form_s: float = 0.0
    """Seconds to form the new training group on the received state."""
    form_parts: Seconds = Seconds()
    """The slowest rank's seconds per part of that form (`Formed.form_parts`)."""
    snapshot_bytes: int = 0
    """Host memory the new group's peer snapshots take on the rank that needs most (0: off)."""
    transfer_parts: Seconds = Seconds()
    """The slowest worker's seconds per phase of the transfer call (`Resharded.timings`)."""

    def to_dict(self) -> dict:
        """The transfer's fields as JSON (events, API): all but the worker counts, which the
        reconfiguration record keeps in fields of its own."""
        return {"step": self.step, "bytes_moved": self.bytes_moved, "handover_s": self.handover_s,
                "transfer_s": self.transfer_s, "form_s": self.form_s, "form_parts": self.form_parts.to_dict(),
                "snapshot_bytes": self.snapshot_bytes, "transfer_parts": self.transfer_parts.to_dict()}


@runtime_checkable
class Group(Protocol):
    """What the coordinator needs of a worker group: `WorkerGroup` (Ray actors) is one, the fakes in
    tests/fakes.py are others. Collective calls raise WorkerFailure when a rank dies or raises."""

    @property
    def size(self) -> int: ...
    def nodes(self) -> Counter:
        """Members per node id."""
    def standbys(self) -> int:
        """Standby workers started (idle, reserving nothing; `keep_standby`)."""
    def scale_to(self, nodes: list[str]) -> Started:
        """One member per entry of `nodes`, survivors kept."""
    def prewarm(self, nodes: list[str]) -> int:
        """Start workers on `nodes` ahead of a growth, warming up, without making them members; returns
        how many."""
    def warm(self, nodes: list[str]) -> bool:
        """Whether a worker `prewarm` started has come up and warmed up on each entry of `nodes`."""
    def stop_members(self, *, dead: Collection[str] = ()) -> None:
        """Stop every member (after a failure that kept none); standbys, and spares off the `dead`
        nodes, stay for the next start."""
    def keep_standby(self, free: Mapping[str, int] | None = None, cap: int | None = None) -> int:
        """Keep idle workers started beside the members (the job's `resources.standby_per_node`), to
        replace a member that crashes without a process start, and a node's worth on one node of `free`
        ({node: worker slots} the job may use) that hosts none, to replace a node lost without notice;
        at most `cap` in all (None: no cap); returns how many it started now."""
    def form(self, plan: Plan, *, adopt: bool = False) -> Formed:
        """(Re-)form the process group for `plan`. `adopt`: take the state a `reshard` transfer
        delivered instead of loading the last checkpoint."""
    def reshard(self, old: Plan, new: Plan, nodes: list[str], *, survivors: list[int] | None = None,
                serve: dict[int, int] | None = None, snapshot_step: int | None = None) -> Moved:
        """Move the live state from `old` to `new` on `nodes` over the network (no storage) and form
        the new group. `survivors`: the members' old ranks after a `salvage()` (a heal from peers);
        `serve`, `snapshot_step`: from the survivors' peer snapshots of that step instead, old rank r's
        sent by the survivor of old rank `serve[r]`."""
    def salvage(self, *, fate: Callable[[Salvaged | None], Fate], gone: Collection[str] = (),
                dead: Callable[[], Collection[str]] = tuple, timeout_s: float = 15.0, abort: bool = True) -> Salvage:
        """After a failure ask every member for its state and keep, idle or stop each as `fate` decides
        from its answer (None: it gave none).
        Members on `gone` nodes (known dead) are lost without being asked, those on nodes `dead()` names
        while the salvage waits (a probe beside it) without being waited for; none is waited for longer
        than `timeout_s` (or 2 s after the first answer). `abort`: first abort their
        process groups (a peer died: calls stuck in a collective must raise); not when only their
        coordinator died."""
    def adopt(self) -> int:
        """Make the workers a lost coordinator of this job left running (detached ones) members, as
        they are; returns how many."""
    def carry_on(self, plan: Plan) -> CarriedOn:
        """After `adopt`: whether the members are still `plan`'s training group, every rank sound and at
        one step, so it trains on as it is (members put in rank order); else why not, changing nothing."""
    def run(self, *, until_step: int, steps: int, should_abort: Callable[[], bool] = ...) -> Trained:
        """Train `steps` steps on every rank; what rank 0 trained (its rows, the committed step)."""
    def checkpoint(self, *, blocking: bool = True) -> int:
        """Save at the current step (blocking: wait for the commit); returns the step."""
    def leave(self) -> None:
        """Drop the process group, keep the processes."""
    def shutdown(self) -> None:
        """Stop every worker (and spare)."""
