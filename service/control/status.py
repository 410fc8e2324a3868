"""A job's status: one typed record, built in one place.

The coordinator builds it (`Coordinator.status()`); the job actor adds what only it knows (whether the
loop still runs, a crash, its pid) with `running()` / `crashed()`; the job manager adds the MFU of the
last stored step and stores `to_dict()`; when the coordinator is gone, `finalized()` takes the last
state from the events it wrote. The API's response models (api.schemas.JobSummary/JobDetail) wrap
these fields. Which states are final is `service.control.state.TERMINAL`, nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from service.control.state import TERMINAL


def degrees(layout: Mapping | None) -> dict[str, int] | None:
    """dp/tp/pp of a Layout.to_dict() (dp = dp_replicate * dp_shard)."""
    if not layout:
        return None
    return {"dp": layout.get("dp_replicate", 1) * layout.get("dp_shard", 1), "tp": layout.get("tp", 1),
            "pp": layout.get("pp", 1)}


def layout_short(layout: Mapping | None) -> str:
    """A Layout.to_dict() as short text (Layout.short()), "-" for none."""
    if not layout:
        return "-"
    from parallel.layout import Layout

    return Layout.from_dict(dict(layout)).short()


@dataclass(kw_only=True, slots=True, frozen=True)
class JobStatus:
    state: str
    """PENDING, STARTING, RUNNING, RESIZING, RECOVERING, WAITING_FOR_CAPACITY, QUEUED, PAUSED, SUCCEEDED,
    FAILED or STOPPED (service.control.state.JobState)."""
    reason: str = ""
    """Why the job is in its state."""
    since: float | None = None
    """When the current state was entered (unix seconds)."""
    job_id: str | None = None
    cause: str | None = None
    """Cause of the last transition (service.control.events.Cause) or None."""
    step: int | None = 0
    """Last step trained."""
    total_steps: int | None = None
    world_size: int = 0
    """Workers of the group that runs now (0 while none does)."""
    layout: dict | None = None
    """Layout.to_dict() of the group that runs now (or of the last one)."""
    loss: float | None = None
    val_loss: float | None = None
    """Loss on the held-out split at the last evaluation (train.eval_interval); None before one."""
    tokens_per_s: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation at the last step (0..1); None where the device's peak is unknown."""
    committed_step: int | None = None
    """Step of the last committed checkpoint."""
    min_workers: int | None = None
    max_workers: int | None = None
    run_dir: str | None = None
    reconfigurations: dict[str, int] = dataclasses.field(default_factory=dict)
    """Reconfigurations by cause."""
    steps_lost: int = 0
    events: int = 0
    """Events the coordinator has written."""
    running: bool | None = None
    """Whether the coordinator's loop is alive."""
    error: str | None = None
    """Why the coordinator's loop crashed, if it did."""
    pid: int | None = None
    """Process of the coordinator."""
    priority: int = 0
    """scheduling.priority: on a shared cluster, higher goes first."""
    held: dict[str, int] = dataclasses.field(default_factory=dict)
    """{node_id: workers} the group runs on now."""
    grant: dict[str, int] | None = None
    """{node_id: workers} the shared-cluster scheduler grants the job; None: no scheduler."""
    queue_position: int | None = None
    """While QUEUED: its place in the scheduler's queue (1 = next)."""
    standby: int = 0
    """Standby workers the group keeps started (idle, reserving no CPU; resources.standby_per_node). On a
    shared cluster they count against the owner's worker quota."""

    @property
    def degrees(self) -> dict[str, int] | None:
        return degrees(self.layout)

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL

    # -- the few ways a status is made, besides Coordinator.status() ------------------------------------------
    @classmethod
    def submitted(cls, *, total_steps: int, now: float) -> JobStatus:
        return cls(state="PENDING", reason="submitted", step=0, total_steps=total_steps, since=now)

    @classmethod
    def not_started(cls, error: Exception, *, total_steps: int, now: float) -> JobStatus:
        return cls(state="FAILED", reason=f"could not start the coordinator: {error}", step=0,
                   total_steps=total_steps, since=now)

    def with_runner(self, *, running: bool, error: str | None, pid: int) -> JobStatus:
        """What the job actor knows: whether the loop runs, why it crashed. A crashed loop's state will
        never change again, so a status that is not final yet is reported FAILED."""
        st = replace(self, running=running, error=error, pid=pid)
        return replace(st, state="FAILED", reason=error) if error and not self.is_terminal else st

    def finalized(self, events: list[dict], *, why: str, now: float) -> JobStatus:
        """The job's last status given the events its coordinator wrote before it went away. A job whose
        events do not end in a finished state is FAILED, with `why` the coordinator is gone."""
        st = self
        last = next((e for e in reversed(events) if e["kind"] == "transition"), None)
        if last is not None:
            st = replace(st, state=last["to_state"], reason=last["reason"], cause=last["cause"],
                         since=last["time"], layout=last["new_layout"])
        if events and events[-1]["step"] is not None:
            st = replace(st, step=events[-1]["step"])
        if not st.is_terminal:
            st = replace(st, state="FAILED", since=now,
                         reason=f"the coordinator is gone ({why}); last recorded state {st.state} at step "
                                f"{st.step or 0}")
        return replace(st, world_size=0, running=False)

    # -- JSON ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["state"] = str(self.state)
        d["degrees"] = self.degrees
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobStatus:
        """A stored status (keys this version does not know, e.g. `degrees`, are dropped)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
