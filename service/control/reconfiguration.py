"""A record of one reconfiguration, from detection to the first step at the new layout."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum

from parallel.layout import Layout
from service.control.events import Cause
from service.pool.group import Moved
from workers.report import StepMetrics


class TransferPath(StrEnum):
    """How the next group got its state."""

    LIVE = "live"
    """A sound group's shards sent straight to the new layout's workers."""
    PEERS = "peers"
    """A failed group's survivors' live state (a heal)."""
    MEMORY = "memory"
    """The survivors' peer snapshots."""
    STORAGE = "storage"
    """The last committed checkpoint."""
    IN_PLACE = "in place"
    """Nothing moved: a restarted coordinator's predecessor's group trains on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Live:
    """The state moved worker to worker: a sound group's shards (`LIVE`), a failed group's survivors'
    (`PEERS`) or their peer snapshots of `snapshot_step` (`MEMORY`); `moved` says what it took."""

    path: TransferPath
    moved: Moved
    snapshot_step: int | None = None
    """The step of the peer snapshots it was formed from (`MEMORY` only)."""

    def __post_init__(self) -> None:
        if self.path not in (TransferPath.LIVE, TransferPath.PEERS, TransferPath.MEMORY):
            raise ValueError(f"a live transfer's path is live, peers or memory, not {self.path!r}")

    def to_dict(self) -> dict:
        step = {} if self.snapshot_step is None else {"snapshot_step": self.snapshot_step}
        return {"path": self.path, **step, **self.moved.to_dict()}


@dataclass(frozen=True, kw_only=True, slots=True)
class FromStorage:
    """The group formed from the last committed checkpoint (`STORAGE`)."""

    start_s: float
    """Seconds to stop the leavers and start the missing workers."""
    standby: int
    """Of the workers started, those that were standbys claimed instead of new processes."""
    form_s: float
    """Seconds for every rank to join, build and load."""
    snapshot_bytes: int = 0
    """Host memory the new group's peer snapshots take on the rank that needs most (0: off)."""
    path: TransferPath = TransferPath.STORAGE

    def to_dict(self) -> dict:
        return {"path": self.path, "start_s": self.start_s, "standby": self.standby, "form_s": self.form_s,
                "snapshot_bytes": self.snapshot_bytes}


@dataclass(frozen=True, kw_only=True, slots=True)
class InPlace:
    """Nothing moved: a restarted coordinator's predecessor's group trains on (`IN_PLACE`)."""

    path: TransferPath = TransferPath.IN_PLACE

    def to_dict(self) -> dict:
        return {"path": self.path}


Transfer = Live | FromStorage | InPlace
"""How a reconfiguration's group got its state; `path` names which."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reconfig:
    """Changed only by `replace` (its steps: `formed`, `first_step`, a new `step_before`)."""

    cause: Cause
    detected: float
    """Unix time the coordinator acted on the event."""
    step_before: int
    """Last step completed before the event."""
    old_layout: Layout | None = None
    new_layout: Layout | None = None
    world_size: int = 0
    resumed_step: int | None = None
    """Step the new group resumed from (its checkpoint's step)."""
    started: int = 0
    """Workers started (survivors are reused on planned resizes)."""
    stopped: int = 0
    transfer: Transfer | None = None
    """How the state moved (None: no group formed yet)."""
    first_step_time: float | None = None
    """Unix time the first step at the new layout finished."""
    loss_before: float | None = None
    loss_after: float | None = None

    def formed(self, *, new_layout: Layout, resumed_step: int, started: int, stopped: int, world_size: int,
               transfer: Transfer | None = None) -> Reconfig:
        """This record once a group has formed."""
        return replace(self, new_layout=new_layout, resumed_step=resumed_step, transfer=transfer, started=started,
                       stopped=stopped, world_size=world_size)

    def first_step(self, row: StepMetrics, before: StepMetrics | None) -> Reconfig:
        """This record once the first step at the new layout has run (its row `row`; `before`: the row of
        the step before the event, if kept)."""
        return replace(self, first_step_time=row.time, loss_after=row.loss,
                       loss_before=before.loss if before else None)

    @property
    def seconds(self) -> float | None:
        """Detection to first step at the new layout."""
        return None if self.first_step_time is None else self.first_step_time - self.detected

    @property
    def steps_lost(self) -> int:
        """Steps that had been done and must be done again (0 for a planned resize)."""
        return 0 if self.resumed_step is None else max(0, self.step_before - self.resumed_step)

    def to_dict(self) -> dict:
        """The record as JSON-ready fields (events, API): layouts as `Layout.to_dict`, the transfer
        flat with its "path"."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("old_layout", "new_layout", "transfer"):
            if out[k] is not None:
                out[k] = out[k].to_dict()
        return {**out, "seconds": self.seconds, "steps_lost": self.steps_lost}


KEEP = 512
"""Reconfiguration records a coordinator keeps in memory: days of spot events. The event log
(RUN_DIR/events.jsonl, one `resize` event per reconfiguration) keeps every one."""


class Reconfigs(list):
    """The job's reconfiguration records, newest last: a list that forgets its oldest beyond `keep`,
    keeping their counts by cause and their steps lost in `totals`, so a job that lives through
    thousands of reconfigurations holds a bounded number and still reports them all."""

    def __init__(self, keep: int = KEEP):
        super().__init__()
        self.keep = keep
        self._dropped_causes: dict[str, int] = {}
        self._dropped_lost = 0

    def append(self, record: Reconfig) -> None:
        super().append(record)
        while len(self) > self.keep:
            old = self.pop(0)
            self._dropped_causes[old.cause] = self._dropped_causes.get(old.cause, 0) + 1
            self._dropped_lost += old.steps_lost

    def totals(self) -> tuple[dict[str, int], int]:
        """(reconfigurations by cause, steps lost), over every record appended, forgotten ones included."""
        causes = dict(self._dropped_causes)
        for r in list(self):
            causes[r.cause] = causes.get(r.cause, 0) + 1
        return causes, self._dropped_lost + sum(r.steps_lost for r in list(self))
