"""Carrying out a reconfiguration: the next group formed from where `choose_source` says its state comes.

`Reconfigure.carry_out` takes a policy decision (Resize or Wait) and the workers the job holds (a sound
group with its plan, or what a failure left: survivors, warm processes), asks
`service.control.source.choose_source` for the source and acts on it in one place: `Release` lets every
worker go (the job waits), `Restore` forms the group from the last committed checkpoint, `Live`, `Heal`
and `Memory` move the shards between workers (`Group.reshard`). A group that fails meanwhile is handed
to recovery (service.control.recovery); a plan that cannot be made fails the job. Every formed group is
recorded the same way (`formed`: its reconfiguration record and `resize` event) and returned as the
`Running` that carries it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from parallel.layout import Layout
from parallel.planner import Plan, PlanError
from service.control.events import Cause, EventKind
from service.control.failure import During
from service.control.journal import Journal
from service.control.policy import Resize, Wait
from service.control.progress import Progress
from service.control.reconfiguration import FromStorage, InPlace, Live, Reconfig, Transfer, TransferPath
from service.control.recovery import Recovery
from service.control.source import Heal, Memory, Release, Restore, Survivors, choose_source
from service.control.state import JobState
from service.control.states import Ended, Running, State, Waiting
from service.pool.cluster import ClusterSnapshot, ClusterWatcher
from service.pool.group import CarriedOn, Group, WorkerFailure
from workers.config import JobConfig


class Reconfigure:
    """`plan_for(workers)`: the plan for that many workers; `assign(plan, snap, prefer)`: the node of each
    of its ranks, keeping the workers of `prefer` ({node: members}) where they are (both the
    coordinator's, which knows the model, the grant and the usable nodes); `new_group()`: an empty group."""

    def __init__(self, *, cfg: JobConfig, journal: Journal, progress: Progress, watcher: ClusterWatcher,
                 recovery: Recovery, new_group: Callable[[], Group], plan_for: Callable[[int], Plan],
                 assign: Callable[[Plan, ClusterSnapshot, Counter | None], list[str]]):
        self.cfg, self.journal, self.progress, self.watcher = cfg, journal, progress, watcher
        self.recovery, self.new_group = recovery, new_group
        self.plan_for, self.assign = plan_for, assign

    def carry_out(self, d: Resize | Wait, snap: ClusterSnapshot, *, group: Group | None, sound: Plan | None,
                  survivors: Survivors | None, cause: Cause, detected: float, record: Reconfig | None,
                  old: Plan | None = None) -> State:
        """Act on a decision to change the job's `group`, from where `choose_source` says its state comes.
        `sound`: the plan `group` runs, when every rank holds its state (a planned change); `survivors`:
        a failed group's, when they can form the next; `old`: the plan of the last group, if known;
        `record`: the reconfiguration under way, if any. Returns `Running` (formed), `Waiting`
        (released: the caller says for whom it waits), `Recovering` (a failure meanwhile) or `Ended` (no
        plan for the decided size)."""
        source = choose_source(decision=d, sound=sound, survivors=survivors, reshard=self.cfg.parallel.reshard)
        if isinstance(source, (Restore, Release)) and source.flush:
            try:
                self.progress.committed_step = group.checkpoint()
                self.journal.note(EventKind.CHECKPOINT, reason=f"flushed at step {self.progress.committed_step} "
                                                               "before resize",
                                  step=self.progress.committed_step, cause=cause)
            except WorkerFailure as e:  # e.g. the draining node died before the save finished: fall back
                return self.recovery.recover(e, group, sound)
        snap = self.watcher.latest or snap
        if isinstance(source, Release):
            return self.release(d, group, healing=survivors is not None, record=record)
        try:
            p = self.plan_for(d.workers)
            nodes = self.assign(p, snap, group.nodes() if group is not None else None)
        except (PlanError, ValueError) as e:
            if group is not None:
                group.shutdown()
            return Ended(final=JobState.FAILED, reason=f"cannot plan {d.workers} workers: {e}")
        old = sound or old
        if isinstance(source, Restore):
            return self.restore(p, nodes, group, old=old, cause=cause, reason=d.reason, detected=detected,
                                record=record)
        if isinstance(source, Memory):
            return self.move_live(source.old, p, nodes, group, survivors=sorted({s for _, s in source.serve}),
                                  memory=source, cause=cause, reason=d.reason, detected=detected, record=record)
        return self.move_live(source.old, p, nodes, group,
                              survivors=list(source.ranks) if isinstance(source, Heal) else None,
                              cause=cause, reason=d.reason, detected=detected, record=record)

    def release(self, d: Wait, group: Group | None, *, healing: bool, record: Reconfig | None) -> Waiting:
        """Hold no worker while the job waits (`healing`: survivors that could have healed are let go)."""
        if healing:
            self.journal.note(EventKind.FALLBACK, reason=f"{d.reason}: the surviving workers are released; the job "
                                                         f"will resume from the last committed checkpoint (step "
                                                         f"{self.progress.committed_step})",
                              step=self.progress.step_done, cause=Cause.FAILURE)
        if group is not None:
            group.shutdown()
        return Waiting(reason=d.reason, record=record)

    def move_live(self, old: Plan, p: Plan, nodes: list[str], group: Group, *, survivors: list[int] | None,
                  cause: Cause, reason: str, detected: float, record: Reconfig | None,
                  memory: Memory | None = None) -> State:
        """Reshard `group` live from `old` (all its ranks, or after a failure the `survivors` a salvage kept,
        or their peer snapshots: `memory`) to `p` on `nodes`; a durable checkpoint of the new layout
        follows its first step. A transfer that fails midway is a failure like any other: the recovery
        decides what the survivors still offer (their peer snapshots outlive the transfer)."""
        try:
            if memory is not None:
                moved = group.reshard(old, p, nodes, survivors=survivors, serve=dict(memory.serve),
                                      snapshot_step=memory.step)
            else:
                moved = group.reshard(old, p, nodes, survivors=survivors)
        except WorkerFailure as e:
            return self.recovery.recover(e, group, old, tried=nodes, during=During.TRANSFER)
        mib = moved.bytes_moved / 2**20
        how, path = (("moved live", TransferPath.LIVE) if survivors is None else
                     (f"healed from surviving ranks {survivors}", TransferPath.PEERS) if memory is None else
                     (f"formed from the peer snapshots of step {memory.step} that ranks {survivors} hold",
                      TransferPath.MEMORY))
        running = self.formed(group, p, old.layout, moved.step, moved.started, moved.stopped, cause=cause,
                              detected=detected, record=record,
                              reason=f"{reason}; {mib:.0f} MiB of state {how} in {moved.transfer_s:.2f}s",
                              transfer=Live(path=path, moved=moved,
                                            snapshot_step=memory.step if memory is not None else None))
        return replace(running, durable_due=True)

    def restore(self, p: Plan, nodes: list[str], group: Group | None, *, old: Plan | None, cause: Cause, reason: str,
                detected: float, record: Reconfig | None) -> State:
        """Form the group for plan `p` on `nodes` from the last committed checkpoint, reusing the
        processes `group` holds."""
        group = group if group is not None else self.new_group()
        try:
            if group.size:
                group.leave()
            t_start = time.perf_counter()
            start = group.scale_to(nodes)
            start_s = time.perf_counter() - t_start
            formed = group.form(p)
        except WorkerFailure as e:
            # the members hold nothing the checkpoint does not: those that answer at once stay warm, those
            # stuck (a rendezvous with a rank on a dead node waits out its timeout) are not waited for
            return self.recovery.recover(e, group, p, tried=nodes, during=During.RESTORE)
        return self.formed(group, p, old.layout if old else None, formed.step, start.started, start.stopped,
                           cause=cause, reason=reason, detected=detected, record=record,
                           transfer=FromStorage(start_s=start_s, standby=start.from_standby, form_s=formed.form_s,
                                                snapshot_bytes=formed.snapshot_bytes))

    def carried_on(self, group: Group, p: Plan, kept: CarriedOn, record: Reconfig | None) -> Running:
        """The group a lost coordinator formed for `p` trains on from the step its workers are at (the
        metrics of steps they finished after that coordinator died came back with `kept`)."""
        self.progress.recovered(kept.rows, at=self.progress.step_done, committed=kept.committed_step)
        if record is not None:
            record = replace(record, step_before=kept.step)
        return self.formed(group, p, p.layout, kept.step, 0, 0, cause=Cause.FAILURE, detected=time.time(),
                           reason="the workers the previous coordinator left training train on as they are",
                           record=record, transfer=InPlace())

    def formed(self, group: Group, p: Plan, old: Layout | None, resumed: int, started: int, stopped: int, *,
               cause: Cause, reason: str, detected: float, record: Reconfig | None, transfer: Transfer) -> Running:
        """Record `group` formed for plan `p`; it runs next."""
        rc = record if record is not None else Reconfig(cause=cause, detected=detected,
                                                        step_before=self.progress.step_done, old_layout=old)
        rc = rc.formed(new_layout=p.layout, resumed_step=resumed, started=started, stopped=stopped,
                       world_size=p.world_size, transfer=transfer)
        cause = rc.cause  # a recovery re-forms through a "planned" start: the event says why it happened
        with self.progress.lock:
            self.progress.step_done = resumed
        self.journal.resized(rc, plan=p, reason=f"{reason}; layout {p.layout} on {p.world_size} workers "
                                                f"({started} started, {stopped} stopped, resumed at step {resumed})")
        return Running(reason=f"running {p.layout}", cause=cause, group=group, plan=p, record=rc)
