"""Carrying a recovery out: the failure recorded, the survivors asked, the answers acted on.

Every decision is the pure recovery module's (service.control.failure): `respond` says whether to ask the
survivors and how, `fate` what the group does with each of them, `judge` what their answers can form
the next group from, `classify` and `within_window` what the failure ledger keeps. `Recovery.recover`
is the one way a failure reaches the coordinator's state: it asks `respond`, salvages while the group's
nodes are probed (`NodeHealth.probe`; one wait covers both), records the failure in the `Ledger` and
writes its one `failure` event, and returns `Recovering` carrying what it kept and the source `judge`
found (None: the next group loads the last committed checkpoint, and a `fallback` event says why).
`Recovery.salvage` is the part a restarted coordinator's takeover shares (service.control.takeover).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor

from parallel.planner import Plan
from service.control.events import Cause, EventKind
from service.control.failure import (During, Facts, Failure, Response, Verdict, classify, fate, judge, respond,
                                     within_window)
from service.control.journal import Journal
from service.control.progress import Progress
from service.control.reconfiguration import Reconfig
from service.control.source import ReshardMode
from service.control.states import Recovering
from service.pool.cluster import ClusterWatcher
from service.pool.group import Group, WorkerFailure
from service.pool.node_health import NodeHealth
from workers.config import JobConfig


class Ledger:
    """The failures the restart budget counts (service.control.failure.give_up reads them): one owner,
    one rule for what is kept (`failure.within_window`). Thread-safe."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._lock = threading.Lock()
        self._failures: list[Failure] = []

    def record(self, *failures: Failure) -> None:
        if not failures:
            return
        with self._lock:
            now = max(f.time for f in failures)
            self._failures = within_window([*self._failures, *failures], now=now, window_s=self.window_s)

    @property
    def failures(self) -> tuple[Failure, ...]:
        with self._lock:
            return tuple(self._failures)


class Recovery:
    """`cfg`: the job's (how it reshards, whether peer snapshots are on); `journal`: where the failure and
    what came of it are written; `progress`: the job's step, moved to the state the survivors keep;
    `health` and `watcher`: which nodes are dead; `ledger`: the failures, which this recovery owns."""

    def __init__(self, *, cfg: JobConfig, journal: Journal, progress: Progress, health: NodeHealth,
                 watcher: ClusterWatcher, ledger: Ledger):
        self.cfg, self.journal, self.progress = cfg, journal, progress
        self.health, self.watcher, self.ledger = health, watcher, ledger

    def facts(self, kind, during: During, group: Group | None, plan: Plan | None, *, standing: bool = False) -> Facts:
        """What the failure policy (service.control.failure.respond) decides from."""
        return Facts(kind=kind, during=during, live_reshard=self.cfg.parallel.reshard == ReshardMode.LIVE,
                     holds_group=group is not None and plan is not None and group.size > 0,
                     snapshots=self.cfg.checkpoint.peer_interval > 0, standing=standing)

    def recover(self, err: WorkerFailure, group: Group | None, plan: Plan | None, *, tried: Collection[str] = (),
                during: During = During.TRAINING) -> Recovering:
        """`group`, formed for `plan` (None: none formed yet), failed with `err`: record it, keep the
        survivors' state if it can form the next group, and go RECOVERING. `tried`: the nodes a failed
        re-form was placing workers on (not members yet, but just as likely to be the dead ones: e.g. a
        node killed right after the probe of the previous failure). `during`: what the group was doing."""
        t0 = time.time()
        facts = self.facts(err.kind, during, group, plan)
        response = respond(facts)
        nodes = sorted(set(group.nodes() if group is not None else ()) | set(tried))
        self.health.suspect(err.nodes)  # the group's probe found them dead: they stay out of the next plan
        self.health.sweep(self.watcher.latest)  # and nodes dead before, which a restarted coordinator did not see
        # known dead (the watcher, or that probe): neither waited for nor probed again
        gone = self.health.gone(self.watcher.latest, nodes) | err.nodes
        # The probe (up to probe_timeout_s on a dead node; milliseconds where its raylet is gone) runs
        # while the survivors salvage (up to their grace for a silent peer): one wait instead of two, and
        # the salvage stops waiting for the members on the nodes the probe finds dead.
        verdict, kept = None, False
        with ThreadPoolExecutor(1, thread_name_prefix="probe") as pool:
            probing = pool.submit(self.health.probe, [n for n in nodes if n not in gone])

            def found_dead() -> set[str]:
                return probing.result() if probing.done() and probing.exception() is None else set()

            if response.salvage:
                verdict, kept = self.salvage(group, plan, response, gone, dead=found_dead)
            dead = gone | probing.result()
        kind = classify(err.kind, on_dead_node=bool(dead))
        self.ledger.record(Failure(time=t0, kind=kind, error=str(err)))
        if not kept and group is not None:
            group.stop_members(dead=dead)  # standbys, and spares off the dead nodes, stay for the re-form
        step = self.progress.step_done
        # waited_s: since the failure was noticed, in the salvage and the probe
        self.journal.note(EventKind.FAILURE, reason=str(err), step=step, cause=Cause.FAILURE,
                          details={"kind": kind, "during": during, "unresponsive_nodes": sorted(dead),
                                   "waited_s": round(time.time() - t0, 3)})
        if response.why_not and facts.live_reshard and facts.holds_group:  # it could have moved live: say why not
            self.journal.note(EventKind.FALLBACK, reason=f"{response.why_not}; falling back to the last committed "
                                                         f"checkpoint (step {self.progress.committed_step})",
                              step=step, cause=Cause.FAILURE, details={"kind": kind, "during": during})
        record = Reconfig(cause=Cause.FAILURE, detected=t0, step_before=step,
                          old_layout=plan.layout if plan else None)
        return Recovering(reason=str(err), cause=Cause.FAILURE, group=group, failed_plan=plan,
                          survivors=verdict.source if verdict else None, record=record)

    def salvage(self, group: Group, plan: Plan, response: Response, gone: set[str], *,
                dead: Callable[[], set[str]] = set) -> tuple[Verdict | None, bool]:
        """Ask the members of `group` (formed for `plan`) for their state as `response` says (`gone`: nodes
        the watcher lists as dead, whose members are not asked; `dead`: see `Group.salvage`); the group
        keeps, idles or stops each as `failure.fate` decides. Then act on `failure.judge`'s verdict: the
        job's step moves to the state kept, and the events say what the next group forms from, or why it
        falls back to the last committed checkpoint (the members that answered stay as warm processes for
        that re-form to reuse). Returns (the verdict, whether any worker is kept)."""
        progress = self.progress
        salvage = group.salvage(fate=fate, gone=gone, dead=dead, abort=response.abort, timeout_s=response.patience_s)
        verdict = judge(plan, response, salvage.kept, last_step=progress.step_done)
        stopped = {"stopped": list(salvage.stopped_why)} if salvage.stopped_why else {}
        if verdict.source is None:
            copies = {str(r): list(a.snapshots) for r, a in salvage.kept.items() if a.snapshots}
            self.journal.note(
                EventKind.FALLBACK, reason=f"cannot heal from the surviving workers: {verdict.why_not_live}; the "
                                           f"live state does not hold every shard, and {verdict.why_not_memory}; "
                                           f"resuming from the last committed checkpoint (step "
                                           f"{progress.committed_step})",
                step=progress.step_done, cause=Cause.FAILURE,
                details={"warm_workers": group.size + salvage.idle, "snapshots": copies, **stopped})
            return verdict, group.size + salvage.idle > 0
        progress.recovered(verdict.rows, at=verdict.step)
        if verdict.why_not_live:  # formed from the peer snapshots
            m = verdict.source
            self.journal.note(EventKind.INFO, reason=f"cannot heal from the live state: {verdict.why_not_live}; "
                                                     f"forming the next group from the peer snapshots of step "
                                                     f"{m.step} that the survivors hold",
                              step=progress.step_done, cause=Cause.FAILURE,
                              details={"snapshot_step": m.step, "serve": {str(r): s for r, s in m.serve}, **stopped})
        elif stopped or salvage.idle:
            said = ([f"kept {salvage.idle} idle (no state to heal from)"] if salvage.idle else []) + \
                   ([f"stopped {len(salvage.stopped_why)}: {'; '.join(salvage.stopped_why)}"]
                    if salvage.stopped_why else [])
            self.journal.note(EventKind.INFO, reason=f"healing from {len(verdict.source.ranks)} surviving worker(s); "
                                                     f"{'; '.join(said)}",
                              step=progress.step_done, details={"idle": salvage.idle, **stopped})
        return verdict, True
