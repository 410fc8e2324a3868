"""Carrying out a reconfiguration: the next group formed from where `choose_source` says its state comes.

`Reconfigure.carry_out` takes a policy decision (Resize or Wait) and what the group holds (a sound plan,
or a failed group's survivors), asks `service.control.source.choose_source` for the source and acts on
it in one place: `Release` lets every worker go (the job waits), `Restore` forms the group from the
last committed checkpoint, `Live`, `Heal` and `Memory` move the shards between workers
(`Group.reshard`). A group that fails meanwhile is handed to recovery (service.control.recovery); a plan
that cannot be made fails the job. Every formed group is recorded the same way (`formed`: the plan it
runs, the step it resumed at, its reconfiguration record and `resize` event) and returned as `Running`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from parallel.planner import Plan, PlanError
from service.control.context import Context
from service.control.failure import During, respond
from service.control.policy import Resize, Wait
from service.control.reconfiguration import Reconfig
from service.control.recovery import Recovery
from service.control.source import Heal, Memory, Release, Restore, Survivors, choose_source
from service.control.state import JobState
from service.control.states import Ended, Running, State, Waiting
from service.pool.cluster import ClusterSnapshot
from service.pool.group import CarriedOn, WorkerFailure


class Reconfigure:
    """`plan_for(workers)`: the plan for that many workers; `assign(plan, snap)`: the node of each of its
    ranks (both the coordinator's, which knows the model, the grant and the usable nodes)."""

    def __init__(self, ctx: Context, recovery: Recovery, *, plan_for: Callable[[int], Plan],
                 assign: Callable[[Plan, ClusterSnapshot], list[str]]):
        self.ctx, self.recovery = ctx, recovery
        self.plan_for, self.assign = plan_for, assign

    def carry_out(self, d: Resize | Wait, snap: ClusterSnapshot, *, sound: Plan | None, survivors: Survivors | None,
                  cause: str, detected: float, record: Reconfig | None) -> State:
        """Act on a decision to change the group, from where `choose_source` says its state comes.
        `sound`: the plan of a running group that holds all its state (a planned change); `survivors`:
        a failed group's, when they can heal it; `record`: the reconfiguration under way, if any.
        Returns `Running` (formed), `Waiting` (released: the caller says for whom it waits),
        `Recovering` (a failure meanwhile) or `Ended` (no plan for the decided size)."""
        c = self.ctx
        source = choose_source(decision=d, sound=sound, survivors=survivors, reshard=c.cfg.parallel.reshard)
        if isinstance(source, (Restore, Release)) and source.flush:
            try:
                c.progress.committed_step = c.group.checkpoint()
                c.sm.note("checkpoint", reason=f"flushed at step {c.progress.committed_step} before resize",
                          step=c.progress.committed_step, cause=cause)
            except WorkerFailure as e:  # e.g. the draining node died before the save finished: fall back
                return self.recovery.recover(e)
        snap = c.watcher.latest or snap
        if isinstance(source, Release):
            return self.release(d, healing=survivors is not None, record=record)
        try:
            p = self.plan_for(d.workers)
            nodes = self.assign(p, snap)
        except (PlanError, ValueError) as e:
            c.shutdown_group()
            return Ended(final=JobState.FAILED, reason=f"cannot plan {d.workers} workers: {e}")
        if isinstance(source, Restore):
            return self.restore(p, nodes, cause=cause, reason=d.reason, detected=detected, record=record)
        if isinstance(source, Memory):
            return self.move_live(source.old, p, nodes, survivors=sorted({s for _, s in source.serve}),
                                  memory=source, cause=cause, reason=d.reason, detected=detected, record=record)
        return self.move_live(source.old, p, nodes, survivors=list(source.ranks) if isinstance(source, Heal) else None,
                              cause=cause, reason=d.reason, detected=detected, record=record)

    def release(self, d: Wait, *, healing: bool, record: Reconfig | None) -> Waiting:
        """Hold no worker while the job waits (`healing`: survivors that could have healed are let go)."""
        c = self.ctx
        if healing:
            c.sm.note("fallback", reason=f"{d.reason}: the surviving workers are released; the job will resume "
                                         f"from the last committed checkpoint (step {c.progress.committed_step})",
                      step=c.progress.step_done, cause="failure")
        c.shutdown_group()
        return Waiting(reason=d.reason, record=record)

    def move_live(self, old: Plan, p: Plan, nodes: list[str], *, survivors: list[int] | None, cause: str,
                  reason: str, detected: float, record: Reconfig | None, memory: Memory | None = None) -> State:
        """Reshard live from `old` (all its ranks, or after a failure the `survivors` a salvage kept, or
        their peer snapshots: `memory`) to `p` on `nodes`; a durable checkpoint of the new layout
        follows its first step. A transfer that fails midway asks the survivors for the old group's
        peer snapshots (they outlive the transfer: recovery salvages), or, with snapshots off, falls
        back to the last committed checkpoint; the events say which."""
        c = self.ctx
        try:
            if memory is not None:
                moved = c.group.reshard(old, p, nodes, survivors=survivors, serve=dict(memory.serve),
                                        snapshot_step=memory.step)
            else:
                moved = c.group.reshard(old, p, nodes, survivors=survivors)
        except WorkerFailure as e:
            if respond(self.recovery.facts(e.kind, During.TRANSFER)).salvage:  # peer snapshots outlive it
                c.sm.note("failure", reason=f"the state transfer failed ({e}); asking the survivors for "
                                            f"the peer snapshots they hold", step=c.progress.step_done, cause=cause,
                          details={"kind": e.kind})
            else:
                c.sm.note("fallback", reason=f"live state transfer failed ({e}); falling back to the last "
                                             f"committed checkpoint (step {c.progress.committed_step})",
                          step=c.progress.step_done, cause=cause, details={"kind": e.kind})
            return self.recovery.recover(e, tried=nodes, during=During.TRANSFER)
        mib = moved.bytes_moved / 2**20
        how, path = (("moved live", "live") if survivors is None else
                     (f"healed from surviving ranks {survivors}", "peers") if memory is None else
                     (f"formed from the peer snapshots of step {memory.step} that ranks {survivors} hold", "memory"))
        extra = {"snapshot_step": memory.step} if memory is not None else {}
        running = self.formed(p, old.layout.to_dict(), moved.step, moved.started, moved.stopped, cause=cause,
                              detected=detected, record=record,
                              reason=f"{reason}; {mib:.0f} MiB of state {how} in {moved.transfer_s:.2f}s",
                              transfer={"path": path, **extra, **moved.record()})
        return replace(running, durable_due=True)

    def restore(self, p: Plan, nodes: list[str], *, cause: str, reason: str, detected: float,
                record: Reconfig | None) -> State:
        """Form the group for plan `p` on `nodes` from the last committed checkpoint, reusing the
        processes that are there."""
        c = self.ctx
        old = c.plan.layout.to_dict() if c.plan else None
        if c.group is None:
            c.group = c.new_group()
        try:
            if c.group.size:
                c.group.leave()
            t_start = time.perf_counter()
            start = c.group.scale_to(nodes)
            start_s = time.perf_counter() - t_start
            formed = c.group.form(p)
        except WorkerFailure as e:
            # the members hold nothing the checkpoint does not: those that answer at once stay warm, those
            # stuck (a rendezvous with a rank on a dead node waits out its timeout) are not waited for
            return self.recovery.recover(e, tried=nodes, during=During.RESTORE)
        return self.formed(p, old, formed.step, start.started, start.stopped, cause=cause, reason=reason,
                           detected=detected, record=record,
                           transfer={"path": "storage", "start_s": start_s, "standby": start.from_standby,
                                     "form_s": formed.form_s, "snapshot_bytes": formed.snapshot_bytes})

    def carried_on(self, p: Plan, kept: CarriedOn, record: Reconfig | None) -> Running:
        """The group a lost coordinator formed for `p` trains on from the step its workers are at (the
        metrics of steps they finished after that coordinator died came back with `kept`)."""
        c = self.ctx
        c.progress.recovered(kept.rows, at=c.progress.step_done, committed=kept.committed_step)
        if record is not None:
            record.step_before = kept.step
        return self.formed(p, p.layout.to_dict(), kept.step, 0, 0, cause="failure", detected=time.time(),
                           reason="the workers the previous coordinator left training train on as they are",
                           record=record, transfer={"path": "in place"})

    def formed(self, p: Plan, old: dict | None, resumed: int, started: int, stopped: int, *, cause: str,
               reason: str, detected: float, record: Reconfig | None, transfer: dict) -> Running:
        """Record a group formed for plan `p`; it runs next."""
        c = self.ctx
        with c.lock:
            c.plan = p
            rc = record if record is not None else Reconfig(cause=cause, detected=detected,
                                                            step_before=c.progress.step_done, old_layout=old)
            cause = rc.cause  # a recovery re-forms through a "planned" start: the event says why it happened
            rc.formed(new_layout=p.layout.to_dict(), resumed_step=resumed, started=started, stopped=stopped,
                      world_size=p.world_size, transfer=transfer)
            c.progress.step_done = resumed
        c.sm.note("resize", reason=f"{reason}; layout {p.layout} on {p.world_size} workers "
                                   f"({started} started, {stopped} stopped, resumed at step {resumed})",
                  step=resumed, cause=cause, details={"plan": p.to_dict(), **rc.to_dict()})
        return Running(reason=f"running {p.layout}", cause=cause, record=rc)
