"""Taking over after a coordinator restart: the job's events are in its run directory already.

An earlier coordinator of the same job died (its actor was restarted by Ray, or the job was started
again by hand). `Takeover.restarted` records that as a failure and says where the new coordinator
starts: `Adopting` when its workers were started detached (they outlive it), else `Pending` (the next
group resumes from the last committed checkpoint). `Takeover.adopt` carries `Adopting` out: the workers
found (`Group.adopt`) train on as they are if they still are the lost plan's group (`Group.carry_on`),
else recovery salvages them (service.control.recovery) for the next group to heal from, else they stay
as warm processes for the resume from storage. The pool's side of this (finding the detached workers by
name) is service.pool.takeover.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from parallel.planner import Plan
from service.control.context import Context
from service.control.events import Event
from service.control.failure import During, respond
from service.control.policy import Failure
from service.control.reconfiguration import Reconfig
from service.control.reconfigure import Reconfigure
from service.control.recovery import Recovery
from service.control.run_files import last_plan, where_it_stopped
from service.control.states import Adopting, Pending, Running
from service.pool.cluster import ClusterSnapshot
from service.pool.group import FailureKind

RESTARTS = (FailureKind.COORDINATOR_RESTARTED, "coordinator_restart")
"""How an earlier coordinator's restart is named in the job's events (the second: before FailureKind)."""


class Takeover:
    """`run_dir`: the job's run directory (where the lost coordinator's group logged its steps)."""

    def __init__(self, ctx: Context, recovery: Recovery, reconfigure: Reconfigure, *, run_dir: Path):
        self.ctx, self.recovery, self.reconfigure = ctx, recovery, reconfigure
        self.run_dir = run_dir

    def restarted(self, prior: list[Event]) -> Adopting | Pending:
        """Where a coordinator starts whose job already has the events `prior`. Workers its predecessor
        started detached (`opts.owner`) outlive it: the first step takes them over (`Adopting`); else,
        or for what cannot heal, the next group resumes from the last committed checkpoint. This
        reconfiguration is recorded as a failure whose steps lost run from the last step the old group
        logged."""
        c = self.ctx
        last_step, last_state, layout = where_it_stopped(prior, self.run_dir)
        adopt = c.opts.owner is not None
        how = ("taking over the workers it left running, else resuming from the last committed checkpoint"
               if adopt else "resuming from the last committed checkpoint")
        why = (f"the coordinator restarted (its previous process was lost in state {last_state} at step "
               f"{last_step}); {how}")
        # The earlier restarts count too (Ray restarts the actor any number of times; the policy's budget,
        # max_restarts within restart_window_s as for every failure kind, is what ends a crash loop).
        c.failures.extend(Failure(time=e.time, kind=FailureKind.COORDINATOR_RESTARTED, error=e.reason or "")
                          for e in prior if e.kind == "failure" and (e.details or {}).get("kind") in RESTARTS)
        c.failures.append(Failure(time=time.time(), kind=FailureKind.COORDINATOR_RESTARTED, error=why))
        c.sm.note("failure", reason=why, step=last_step, cause="failure",
                  details={"kind": FailureKind.COORDINATOR_RESTARTED, "previous_events": len(prior)})
        record = Reconfig(cause="failure", detected=time.time(), step_before=last_step, old_layout=layout)
        if adopt:
            return Adopting(reason=why, lost=Plan.from_dict(d) if (d := last_plan(prior)) else None, record=record)
        return Pending(reason=why, record=record)

    def adopt(self, state: Adopting, snap: ClusterSnapshot) -> Pending | Running:
        """The workers the lost coordinator left running (`Group.adopt`) become this one's group. If they
        still are the training group of its last plan, every rank sound and at one step, that group
        trains on as it is (`Group.carry_on`: nothing re-formed, no state moved). Else, if between them
        they hold every shard of that plan at one step, the next group heals from them (`Pending` with
        survivors); else they stay as warm processes for the resume from storage (so do those of a job
        that reshards through storage, and those started before the lost coordinator formed any group)."""
        c = self.ctx
        c.health.sweep(snap)  # nodes that died with (or before) the lost coordinator: not planned onto
        pending = Pending(reason=state.reason, cause=state.cause, record=state.record)
        group = c.new_group()
        found = group.adopt()
        if not found:
            return pending
        c.group = group
        record = state.record
        c.progress.step_done = max(c.progress.step_done, record.step_before if record is not None else 0)
        c.sm.note("info", reason=f"took over {found} worker(s) the previous coordinator left running",
                  step=c.progress.step_done, details={"adopted": found, "nodes": dict(group.nodes())})
        if state.lost is None:
            return pending
        gone = c.health.gone(snap, sorted(group.nodes()))
        if not gone:
            standing = group.carry_on(state.lost)
            if standing.step is not None:
                return self.reconfigure.carried_on(state.lost, standing, record)
            c.sm.note("info", reason=f"the workers taken over cannot train on as they are: {standing.why}",
                      step=c.progress.step_done)
        c.plan = state.lost  # what the salvage checks their shards against
        response = respond(self.recovery.facts(FailureKind.COORDINATOR_RESTARTED, During.TAKEOVER))
        if not response.salvage:
            c.plan = None
            return pending
        survivors, kept = self.recovery.salvage(gone, response)
        c.plan = None  # no layout runs until the next group forms
        if survivors is not None and record is not None:
            # the workers may have finished a step the lost coordinator never recorded (their metrics
            # came back with the salvage): the heal moves from there, not from its last recorded step
            record.step_before = c.progress.step_done
        if not kept:
            self.recovery.drop_members(gone)
        return replace(pending, survivors=survivors)
