"""Taking over after a coordinator restart: the job's events are in its run directory already.

An earlier coordinator of the same job died (its actor was restarted by Ray, or the job was started
again by hand). `Takeover.restarted` records that as a failure and says where the new coordinator
starts: `Adopting` when its workers were started detached (they outlive it), else `Pending` (the next
group resumes from the last committed checkpoint). `Takeover.adopt` carries `Adopting` out: the workers
found (`Group.adopt`) are asked whether they still stand as the lost plan's group (`Group.carry_on`), and
the recovery's decision (service.control.failure.respond) says what comes of them: they train on as they
are, or recovery salvages them (service.control.recovery) for the next group to form from, or they stay
as warm processes for the resume from storage. The pool's side of this (finding the detached workers by
name) is service.pool.takeover.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from parallel.planner import Plan
from service.control.events import Cause, Event, EventKind
from service.control.failure import During, Failure, respond
from service.control.journal import Journal
from service.control.progress import Progress
from service.control.reconfiguration import Reconfig
from service.control.reconfigure import Reconfigure
from service.control.recovery import Recovery
from service.control.run_files import last_plan, where_it_stopped
from service.control.states import Adopting, Pending, Running
from service.pool.cluster import ClusterSnapshot
from service.pool.group import FailureKind, Group
from service.pool.node_health import NodeHealth

RESTARTS = (FailureKind.COORDINATOR_RESTARTED, "coordinator_restart")
"""How an earlier coordinator's restart is named in the job's events (the second: logs written before
FailureKind existed)."""


class Takeover:
    """`run_dir`: the job's run directory (where the lost coordinator's group logged its steps);
    `detached`: the job's workers are started detached (they outlive their coordinator)."""

    def __init__(self, *, journal: Journal, progress: Progress, health: NodeHealth, recovery: Recovery,
                 reconfigure: Reconfigure, new_group: Callable[[], Group], run_dir: Path, detached: bool):
        self.journal, self.progress, self.health = journal, progress, health
        self.recovery, self.reconfigure, self.new_group = recovery, reconfigure, new_group
        self.run_dir, self.detached = run_dir, detached

    def restarted(self, prior: list[Event]) -> Adopting | Pending:
        """Where a coordinator starts whose job already has the events `prior`. Workers its predecessor
        started detached outlive it: the first step takes them over (`Adopting`); else, or for what
        cannot heal, the next group resumes from the last committed checkpoint. This reconfiguration is
        recorded as a failure whose steps lost run from the last step the old group logged."""
        last_step, last_state, layout = where_it_stopped(prior, self.run_dir)
        how = ("taking over the workers it left running, else resuming from the last committed checkpoint"
               if self.detached else "resuming from the last committed checkpoint")
        why = (f"the coordinator restarted (its previous process was lost in state {last_state} at step "
               f"{last_step}); {how}")
        # The earlier restarts count too (Ray restarts the actor any number of times; the restart budget,
        # max_restarts within restart_window_s as for every failure kind, is what ends a crash loop).
        self.recovery.ledger.record(
            *(Failure(time=e.time, kind=FailureKind.COORDINATOR_RESTARTED, error=e.reason or "")
              for e in prior if e.kind == EventKind.FAILURE and (e.details or {}).get("kind") in RESTARTS),
            Failure(time=time.time(), kind=FailureKind.COORDINATOR_RESTARTED, error=why))
        self.journal.note(EventKind.FAILURE, reason=why, step=last_step, cause=Cause.FAILURE,
                          details={"kind": FailureKind.COORDINATOR_RESTARTED, "previous_events": len(prior)})
        record = Reconfig(cause=Cause.FAILURE, detected=time.time(), step_before=last_step, old_layout=layout)
        if self.detached:
            return Adopting(reason=why, lost=Plan.from_dict(d) if (d := last_plan(prior)) else None, record=record)
        return Pending(reason=why, record=record)

    def adopt(self, state: Adopting, snap: ClusterSnapshot) -> Pending | Running:
        """The workers the lost coordinator left running (`Group.adopt`) become this one's group. If they
        still are the training group of its last plan, every rank sound and at one step, that group
        trains on as it is (nothing re-formed, no state moved). Else, if between them they hold every
        shard of that plan at one step, the next group forms from them (`Pending` with survivors); else
        they stay as warm processes for the resume from storage (so do those of a job that reshards
        through storage, and those started before the lost coordinator formed any group)."""
        self.health.sweep(snap)  # nodes that died with (or before) the lost coordinator: not planned onto
        pending = Pending(reason=state.reason, cause=state.cause, record=state.record)
        group = self.new_group()
        found = group.adopt()
        if not found:
            return pending
        pending = replace(pending, group=group)
        record = state.record
        self.progress.step_done = max(self.progress.step_done, record.step_before if record is not None else 0)
        self.journal.note(EventKind.INFO, reason=f"took over {found} worker(s) the previous coordinator left running",
                          step=self.progress.step_done, details={"adopted": found, "nodes": dict(group.nodes())})
        if state.lost is None:
            return pending
        gone = self.health.gone(snap, sorted(group.nodes()))
        standing = None if gone else group.carry_on(state.lost)
        facts = self.recovery.facts(FailureKind.COORDINATOR_RESTARTED, During.TAKEOVER, group, state.lost,
                                    standing=standing is not None and standing.step is not None)
        response = respond(facts)
        if response.carry_on:
            return self.reconfigure.carried_on(group, state.lost, standing, record)
        if standing is not None:
            self.journal.note(EventKind.INFO, reason=f"the workers taken over cannot train on as they are: "
                                                     f"{standing.why}", step=self.progress.step_done)
        if not response.salvage:
            return pending
        verdict, kept = self.recovery.salvage(group, state.lost, response, gone)
        if verdict.source is not None and record is not None:
            # the workers may have finished a step the lost coordinator never recorded (their metrics
            # came back with the salvage): the move goes from there, not from its last recorded step
            record = replace(record, step_before=self.progress.step_done)
        if not kept:
            group.stop_members(dead=gone)
        return replace(pending, survivors=verdict.source, record=record)
