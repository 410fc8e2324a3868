"""How a coordinator's worker group changes: a planned resize (checkpoint, then re-form), a recovery
(tear down, resume from the last committed checkpoint), a re-form onto a new plan, and the two ends
(SUCCEEDED after a final checkpoint, FAILED). Part of `service.coordinator.Coordinator`, kept apart so
that file is the state machine (which handler runs when) and this one is what the handlers do to the
group; every move is recorded through the coordinator's state machine (`self.sm`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parallel.exchange import survivors_hold_everything
from parallel.planner import Plan, PlanError
from service.cluster import ClusterSnapshot
from service.policy import Failure
from service.reconfig import Reconfig
from service.state import JobState as S
from service.group_types import Group, WorkerFailure

if TYPE_CHECKING:
    from service.coordinator import Coordinator


@dataclass(frozen=True, slots=True)
class Heal:
    """A failed group's survivors hold every shard of `old` between them: re-form by healing from them."""

    old: Plan
    ranks: tuple[int, ...]
    """Their ranks in `old`, which are also their order in the group."""


class GroupLifecycle:
    """Methods of Coordinator (a mixin: `self` is the coordinator)."""

    def _planned_resize(self: Coordinator, workers: int, snap: ClusterSnapshot, *, cause: str, reason: str) -> None:
        """Checkpoint at the current step, then re-form at `workers` (0: release everything and wait)."""
        t0 = time.time()
        if cause == "preemption":
            self.sm.note("preemption", reason=reason, step=self.step_done, cause=cause,
                         details={"draining": snap.draining()})
        self.sm.transition(S.RESIZING, reason=reason, step=self.step_done, cause=cause)
        if workers and self.cfg.parallel.reshard == "live" and self.plan is not None and self.group is not None \
                and self.group.size:
            self._reform(workers, self.watcher.latest or snap, cause=cause, reason=reason, t0=t0, live=True)
            return
        try:
            self.committed_step = self.group.checkpoint()
            self.sm.note("checkpoint", reason=f"flushed at step {self.committed_step} before resize",
                         step=self.committed_step, cause=cause)
        except WorkerFailure as e:  # e.g. the draining node died before the save finished: fall back
            self._recover(e)
            return
        if workers == 0:
            self._shutdown_group()
            self.sm.transition(S.WAITING_FOR_CAPACITY, reason=reason, step=self.step_done)
            return
        self._reform(workers, self.watcher.latest or snap, cause=cause, reason=reason, t0=t0)

    def _move_live(self: Coordinator, old: Plan, p: Plan, nodes: list[str], *, survivors: list[int] | None,
                   cause: str, reason: str, t0: float) -> None:
        """Reshard live from `old` (all its ranks, or after a failure the `survivors` a salvage kept) to
        `p` on `nodes`, then write a durable checkpoint of the new layout in the background while
        training goes on. A transfer that fails midway falls back to the last committed checkpoint, and
        the events say so."""
        try:
            moved = self.group.reshard(old, p, nodes, survivors=survivors)
        except WorkerFailure as e:
            self.sm.note("fallback", reason=f"live state transfer failed ({e}); falling back to the last "
                                            f"committed checkpoint (step {self.committed_step})",
                         step=self.step_done, cause=cause, details={"kind": e.kind})
            self._recover(e, tried=nodes, salvage=False)  # the workers handed their state over: nothing to keep
            return
        mib = moved.bytes_moved / 2**20
        how = "moved live" if survivors is None else f"healed from surviving ranks {survivors}"
        self._formed(p, old.layout.to_dict(), moved.step, moved.started, moved.stopped, cause=cause, t0=t0,
                     reason=f"{reason}; {mib:.0f} MiB of state {how} in {moved.transfer_s:.2f}s",
                     transfer={"path": "live" if survivors is None else "peers", **moved.record()})
        self._durable_due = True

    _durable_due = False
    """A layout was formed from live state and has no checkpoint yet: write one after its first step."""

    def _durable_checkpoint(self: Coordinator) -> None:
        """After the first step at a layout formed from live state: a durable checkpoint in the background
        (it stages during the next step and commits while training goes on), so a later failure has a
        fallback. Not before that first step, which on a busy worker it would slow down."""
        if not self._durable_due:
            return
        self._durable_due = False
        try:
            step = self.group.checkpoint(blocking=False)
        except WorkerFailure as e:
            self._recover(e)
            return
        self.sm.note("checkpoint", reason=f"durable checkpoint of step {step} under {self.plan.layout} writing "
                                          "in the background", step=step)

    def _new_group(self: Coordinator) -> Group:
        o, r = self.opts, self.cfg.resources
        return self.worker_group_cls(self.cfg, str(self.run_dir), cpus_per_worker=r.cpus_per_worker,
                                     gpus_per_worker=r.gpus_per_worker, job_id=self.job_id,
                                     start_timeout_s=o.start_timeout_s, start_probe_s=o.reprobe_interval_s,
                                     probe_timeout_s=o.probe_timeout_s, owner=o.owner, namespace=o.namespace)

    def _take_over(self: Coordinator, snap: ClusterSnapshot) -> None:
        """After a restart: the workers the lost coordinator left running (`Group.adopt`) become this
        one's group. If between them they hold every shard of its last plan at one step, the next group
        heals from them (no step redone, no process started); else they stay as warm processes for the
        resume from storage (so do those of a job that reshards through storage, and those started
        before the lost coordinator formed any group)."""
        self._take_over_due = False
        self.health.sweep(snap)  # nodes that died with (or before) the lost coordinator: not planned onto
        old = self._lost_plan
        group = self._new_group()
        found = group.adopt()
        if not found:
            return
        self.group = group
        self.step_done = max(self.step_done, self._open.step_before if self._open is not None else 0)
        self.sm.note("info", reason=f"took over {found} worker(s) the previous coordinator left running",
                     step=self.step_done, details={"adopted": found, "nodes": dict(group.nodes())})
        if self.cfg.parallel.reshard != "live" or old is None:
            return
        self.plan = old  # what `_salvage` checks their shards against; the heal keeps it
        kept = self._salvage(self.health.gone(snap, sorted(group.nodes())), abort=False)
        self.plan = None  # no layout runs until the next group forms
        if self._heal is not None and self._open is not None:
            # the workers may have finished a step the lost coordinator never recorded (their metrics
            # came back with the salvage): the heal moves from there, not from its last recorded step
            self._open.step_before = self.step_done
        if not kept:
            self._drop_members()

    def _salvage(self: Coordinator, gone: set[str], *, dead: Callable[[], set[str]] = set,
                 abort: bool = True, timeout_s: float = 15.0) -> bool:
        """After a failure without notice: keep the surviving workers and their state when, between them,
        they hold every shard at one step (data-parallel replicas), so the group heals from peers
        (`self._heal`); else say why: the job falls back to the last committed checkpoint, and the
        survivors stay in the group as warm processes for that re-form to reuse (each has left the
        failed group and dropped its trainer; one whose save was still running is stopped instead).
        Returns whether the group is kept. `gone`: nodes the watcher lists as dead (their workers are
        not asked); `dead`, `abort`, `timeout_s`: see `Group.salvage`."""
        g, p = self.group, self.plan
        if self.cfg.parallel.reshard != "live" or g is None or p is None or not g.size:
            return False
        infos = g.salvage(gone=gone, dead=dead, abort=abort, timeout_s=timeout_s)
        steps = {i.step for i in infos.values()}
        rows = max((i.rows for i in infos.values()), key=len, default=())
        last_row = rows[-1]["step"] if rows else self.step_done
        if not infos:
            why = "no worker answered with state it can vouch for"
        elif len(steps) != 1:
            why = f"the survivors stopped at different steps {sorted(steps)}"
        elif not survivors_hold_everything(p.layout, infos):
            why = f"ranks {sorted(infos)} of {p.layout} do not hold every shard between them"
        elif max(steps) != max(last_row, self.step_done):
            why = f"the metrics of step {max(steps)} were lost with the failed worker"
        else:
            why = None
        stopped = {"stopped": list(g.salvage_lost)} if g.salvage_lost else {}
        if why is not None:
            self.sm.note("fallback", reason=f"cannot heal from the surviving workers: {why}; resuming from the "
                                            f"last committed checkpoint (step {self.committed_step})",
                         step=self.step_done, cause="failure",
                         details={"warm_workers": g.size + g.salvage_idle, **stopped})
            return g.size + g.salvage_idle > 0
        if stopped or g.salvage_idle:
            said = ([f"kept {g.salvage_idle} idle (no state to heal from)"] if g.salvage_idle else []) + \
                   ([f"stopped {len(g.salvage_lost)}: {'; '.join(g.salvage_lost)}"] if g.salvage_lost else [])
            self.sm.note("info", reason=f"healing from {len(infos)} surviving worker(s); {'; '.join(said)}",
                         step=self.step_done, details={"idle": g.salvage_idle, **stopped})
        with self._lock:
            for r in rows:
                self.metrics.setdefault(r["step"], r)
            self.step_done = steps.pop()
        self._heal = Heal(old=p, ranks=tuple(sorted(infos)))
        return True

    def _drop_heal(self: Coordinator, why: str) -> None:
        self.sm.note("fallback", reason=f"{why}: the surviving workers are released; the job will resume from "
                                        f"the last committed checkpoint (step {self.committed_step})",
                     step=self.step_done, cause="failure")
        self._drop_members()

    def _recover(self: Coordinator, err: WorkerFailure, *, tried: list[str] = (), salvage: bool = True,
                 patience_s: float = 15.0) -> None:
        """`tried`: the nodes a failed re-form was placing workers on (not members yet, but just as
        likely to be the dead ones: e.g. a node killed right after the probe of the previous failure).
        `salvage`: try to keep the survivors' state to heal from (not after a failed transfer), waiting
        at most `patience_s` for them to answer."""
        t0 = time.time()
        with self._lock:
            self.failures.append(Failure(time=t0, kind=err.kind, error=str(err)))
        nodes = sorted(set(self.group.nodes() if self.group is not None else ()) | set(tried))
        self.health.suspect(err.nodes)  # the group's probe found them dead: they stay out of the next plan
        self.health.sweep(self.watcher.latest)  # and nodes dead before, which a restarted coordinator did not see
        # known dead (the watcher, or that probe): neither waited for nor probed again
        gone = self.health.gone(self.watcher.latest, nodes) | err.nodes
        # The probe (up to probe_timeout_s on a dead node; milliseconds where its raylet is gone) runs
        # while the survivors salvage (up to their grace for a silent peer): one wait instead of two, and
        # the salvage stops waiting for the members on the nodes the probe finds dead.
        with ThreadPoolExecutor(1, thread_name_prefix="probe") as pool:
            probing = pool.submit(self._probe, [n for n in nodes if n not in gone])

            def found_dead() -> set[str]:
                return probing.result() if probing.done() and probing.exception() is None else set()

            # a failed heal is not healed again, nor are its workers reused
            if not salvage or self._heal is not None or not self._salvage(gone, dead=found_dead,
                                                                          timeout_s=patience_s):
                self._drop_members()
            dead = gone | probing.result()
        # waited_s: since the failure was noticed, in the salvage and the probe
        self.sm.note("failure", reason=str(err), step=self.step_done, cause="failure",
                     details={"kind": err.kind, "unresponsive_nodes": sorted(dead),
                              "waited_s": round(time.time() - t0, 3)})
        if self.sm.can(S.RECOVERING):
            self.sm.transition(S.RECOVERING, reason=str(err), step=self.step_done, cause="failure")
        self._open = Reconfig(cause="failure", detected=t0, step_before=self.step_done,
                              old_layout=self.plan.layout.to_dict() if self.plan else None)

    def _reform(self: Coordinator, workers: int, snap: ClusterSnapshot, *, cause: str, reason: str,
                t0: float | None = None, live: bool = False) -> None:
        """Plan `workers` and form the group for it: from the live workers' state (`live`, or a pending
        heal from a failed group's survivors), else from the last committed checkpoint."""
        t0 = t0 or time.time()
        try:
            p = self._plan(workers)
            nodes = self._assign(p, snap)
        except (PlanError, ValueError) as e:
            self._fail(f"cannot plan {workers} workers: {e}")
            return
        if live or self._heal is not None:  # a heal: after a failure the survivors hold every shard
            heal, self._heal = self._heal, None
            old, survivors = (heal.old, list(heal.ranks)) if heal is not None else (self.plan, None)
            self._move_live(old, p, nodes, survivors=survivors, cause=cause, reason=reason, t0=t0)
            return
        old = self.plan.layout.to_dict() if self.plan else None
        if self.group is None:
            self.group = self._new_group()
        try:
            if self.group.size:
                self.group.leave()
            t_start = time.perf_counter()
            started, stopped = self.group.scale_to(nodes)
            start_s = time.perf_counter() - t_start
            formed = self.group.form(p)
        except WorkerFailure as e:
            # the members hold nothing the checkpoint does not: those that answer at once stay warm, those
            # stuck (a rendezvous with a rank on a dead node waits out its timeout) are not waited for
            self._recover(e, tried=nodes, patience_s=1.0)
            return
        self._formed(p, old, formed.step, started, stopped, cause=cause, reason=reason, t0=t0,
                     transfer={"path": "storage", "start_s": start_s, "standby": self.group.standby_used,
                               "form_s": formed.form_s})

    def _formed(self: Coordinator, p, old: dict | None, resumed: int, started: int, stopped: int, *, cause: str,
                reason: str, t0: float, transfer: dict) -> None:
        """Record a group formed for plan `p` and go RUNNING."""
        with self._lock:
            self.plan = p
            rc = self._open if self._open is not None else Reconfig(cause=cause, detected=t0, step_before=self.step_done,
                                                                    old_layout=old)
            cause = rc.cause  # a recovery re-forms through a "planned" start: the event says why it happened
            rc.formed(new_layout=p.layout.to_dict(), resumed_step=resumed, started=started, stopped=stopped,
                      world_size=p.world_size, transfer=transfer)
            self._open = rc
            self.step_done = resumed
        self.sm.note("resize", reason=f"{reason}; layout {p.layout} on {p.world_size} workers "
                                      f"({started} started, {stopped} stopped, resumed at step {resumed})",
                     step=resumed, cause=cause, details={"plan": p.to_dict(), **rc.to_dict()})
        self.sm.transition(S.RUNNING, reason=f"running {p.layout}", layout=p.layout, step=resumed, cause=cause)

    def _finish(self) -> None:
        if self._open is not None:  # re-formed at the last step: no step left to close its record with
            self.reconfigs.append(self._open)
            self._open = None
        try:
            self.committed_step = self.group.checkpoint()
        except WorkerFailure as e:
            self._recover(e)
            return
        self._shutdown_group()
        self.sm.transition(S.SUCCEEDED, reason=f"reached step {self.total_steps}", step=self.step_done)

    def _fail(self: Coordinator, reason: str) -> None:
        self._shutdown_group()
        self.sm.transition(S.FAILED, reason=reason, step=self.step_done)

    def _shutdown_group(self) -> None:
        self._heal, self._durable_due = None, False
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    def _drop_members(self) -> None:
        """After a failure that kept no worker: stop every member, but keep the group's standbys for the
        re-form to claim (a shutdown would stop them too, and every worker would start afresh)."""
        self._heal, self._durable_due = None, False
        if self.group is not None:
            self.group.stop_members()
