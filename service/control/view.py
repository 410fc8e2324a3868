"""What a coordinator shows of its job: the `JobStatus` (service.control.status) assembled from its parts.

One function, `job_status`, reads the state value (the lifecycle state, its reason and cause, the
workers held and the plan they run), the journal (when that state was entered, the last layout), the
progress (step, committed step, last metrics, reconfigurations), the policy's range and the scheduler's
word (grant, queue place). The caller holds the lock the progress's writers take, so the status never
shows a step whose metrics are not in yet.
"""

from __future__ import annotations

from pathlib import Path

from service.control.journal import Journal
from service.control.policy import PolicyConfig
from service.control.progress import Progress
from service.control.state import JobState
from service.control.states import Resizing, Running, State, held
from service.control.status import JobStatus


def job_status(*, job_id: str, state: State, journal: Journal, progress: Progress, policy: PolicyConfig,
               grant: dict[str, int] | None, queue: tuple[int | None, str], total_steps: int, priority: int,
               run_dir: Path, events: int) -> JobStatus:
    last = progress.metrics.get(progress.step_done)
    # Layout and world size from the one plan the group runs, carried by the state with the group (never
    # a new layout with the old size, or the size of a group half re-formed).
    p = state.plan if isinstance(state, (Running, Resizing)) else None
    group = held(state)
    causes, lost = progress.reconfigs.totals()
    queued = state.name is JobState.QUEUED
    layout = p.layout if p is not None else journal.layout
    return JobStatus(
        job_id=job_id, state=str(state.name), reason=(queued and queue[1]) or state.reason,
        cause=None if state.cause is None else str(state.cause), since=journal.since, priority=priority,
        held=dict(group.nodes()) if group is not None else {}, grant=None if grant is None else dict(grant),
        standby=group.standbys() if group is not None else 0,
        queue_position=queue[0] if queued else None, layout=None if layout is None else layout.to_dict(),
        step=progress.step_done, total_steps=total_steps, world_size=p.world_size if p is not None else 0,
        loss=last.loss if last else None, val_loss=progress.metrics.val_loss,
        tokens_per_s=last.tokens_per_s if last else None,
        committed_step=progress.committed_step, min_workers=policy.min_workers, max_workers=policy.max_workers,
        run_dir=str(run_dir), reconfigurations=causes, steps_lost=lost, events=events)
