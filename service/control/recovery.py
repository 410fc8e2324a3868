"""Recovery after a failure: what a failed group's survivors still hold, and what is left of the group.

`Recovery.recover` is the one way a failure reaches the coordinator's state: the failure policy
(service.control.failure.respond) says, from the failure's kind and what the group was doing, whether
to ask the survivors for their state; while they answer (`Group.salvage`), the nodes of the group are
probed (`NodeHealth.probe`), so one wait covers both. `salvage` judges the answers (their live state
heals the next group, else their peer snapshots form it: `service.control.source.from_survivors`), and
`recover` returns `Recovering` carrying that source (None: the next group loads the last committed
checkpoint), having recorded the failure, counted under its kind (`classify`), in the retry ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from parallel.peers import cover
from service.control.context import Context
from service.control.failure import During, Facts, Response, classify, live_gap, respond
from service.control.policy import FINAL_KINDS, Failure
from service.control.reconfiguration import Reconfig
from service.control.source import Memory, Survivors, from_survivors
from service.control.states import Recovering
from service.pool.group import FailureKind, WorkerFailure


class Recovery:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    def facts(self, kind: FailureKind, during: During) -> Facts:
        """What the failure policy (service.control.failure.respond) decides from, besides the kind."""
        c = self.ctx
        g = c.group
        return Facts(kind=kind, during=during, live_reshard=c.cfg.parallel.reshard == "live",
                     holds_group=g is not None and c.plan is not None and g.size > 0,
                     snapshots=c.cfg.checkpoint.peer_interval > 0)

    def recover(self, err: WorkerFailure, *, tried: list[str] = (), during: During = During.TRAINING) -> Recovering:
        """The group failed: record it, keep the survivors' state if they can heal the next group, and
        go RECOVERING. `tried`: the nodes a failed re-form was placing workers on (not members yet, but
        just as likely to be the dead ones: e.g. a node killed right after the probe of the previous
        failure). `during`: what the group was doing; with the failure's kind, the failure policy
        says whether to salvage and how long to wait."""
        c = self.ctx
        t0 = time.time()
        response = respond(self.facts(err.kind, during))
        nodes = sorted(set(c.group.nodes() if c.group is not None else ()) | set(tried))
        c.health.suspect(err.nodes)  # the group's probe found them dead: they stay out of the next plan
        c.health.sweep(c.watcher.latest)  # and nodes dead before, which a restarted coordinator did not see
        # known dead (the watcher, or that probe): neither waited for nor probed again
        gone = c.health.gone(c.watcher.latest, nodes) | err.nodes
        # The probe (up to probe_timeout_s on a dead node; milliseconds where its raylet is gone) runs
        # while the survivors salvage (up to their grace for a silent peer): one wait instead of two, and
        # the salvage stops waiting for the members on the nodes the probe finds dead.
        survivors, kept = None, False
        with ThreadPoolExecutor(1, thread_name_prefix="probe") as pool:
            probing = pool.submit(c.health.probe, [n for n in nodes if n not in gone])

            def found_dead() -> set[str]:
                return probing.result() if probing.done() and probing.exception() is None else set()

            if response.salvage:
                survivors, kept = self.salvage(gone, response, dead=found_dead)
            dead = gone | probing.result()
        kind = classify(err.kind, on_dead_node=bool(dead))
        with c.lock:
            c.failures.append(Failure(time=t0, kind=kind, error=str(err)))
            # Only the failures within the policy's window count (and a final one, which ends the job):
            # the list stays as long as the restart budget, not as long as the job.
            window = c.opts.restart_window_s
            c.failures[:] = [f for f in c.failures if f.time > t0 - window or f.kind in FINAL_KINDS]
        if not kept:
            self.drop_members(dead)
        # waited_s: since the failure was noticed, in the salvage and the probe
        c.sm.note("failure", reason=str(err), step=c.progress.step_done, cause="failure",
                  details={"kind": kind, "unresponsive_nodes": sorted(dead),
                           "waited_s": round(time.time() - t0, 3)})
        record = Reconfig(cause="failure", detected=t0, step_before=c.progress.step_done,
                          old_layout=c.plan.layout.to_dict() if c.plan else None)
        return Recovering(reason=str(err), cause="failure", survivors=survivors, record=record)

    def salvage(self, gone: set[str], response: Response, *,
                dead: Callable[[], set[str]] = set) -> tuple[Survivors | None, bool]:
        """After a failure without notice: keep the surviving workers and their state when, between them,
        they hold every shard at one step (data-parallel replicas), so the group heals from peers; else
        when their peer snapshots hold every shard of one snapshot step (`parallel.peers.cover`), so the
        group is formed from those (`from_survivors` judges); else say why: the job falls back to the
        last committed checkpoint, and the survivors stay in the group as warm processes for that
        re-form to reuse (each has left the failed group and dropped its trainer; one whose save was
        still running is stopped instead). Returns (the survivors to heal from or None, whether any
        worker is kept). `gone`: nodes the watcher lists as dead (their workers are not asked);
        `response`: the failure policy's answer (whether to salvage, abort first, how long to wait,
        which of the survivors' offers count); `dead`: see `Group.salvage`."""
        c = self.ctx
        g, p, progress = c.group, c.plan, c.progress
        if not response.salvage or g is None or p is None or not g.size:
            return None, False
        salvage = g.salvage(gone=gone, dead=dead, abort=response.abort, timeout_s=response.patience_s)
        infos = {r: i for r, i in salvage.kept.items() if i.held}  # live shards (the others: snapshots only)
        steps = {i.step for i in infos.values()}
        rows = max((i.rows for i in infos.values()), key=len, default=())
        why = (live_gap(p.layout, salvage.kept, last_step=progress.step_done) if response.heal else
               "the live state went with the transfer that failed")
        copies = {r: i.snapshots for r, i in salvage.kept.items() if i.snapshots}
        memory = cover(p.layout, copies) if copies or response.memory else None
        source = from_survivors(p, live=None if why else tuple(sorted(infos)), memory=memory)
        stopped = {"stopped": list(salvage.stopped_why)} if salvage.stopped_why else {}
        if isinstance(source, str):
            c.sm.note("fallback", reason=f"cannot heal from the surviving workers: {why}; {source}; resuming "
                                         f"from the last committed checkpoint (step {progress.committed_step})",
                      step=progress.step_done, cause="failure",
                      details={"warm_workers": g.size + salvage.idle, "snapshots": {str(r): list(s) for r, s in
                                                                                    copies.items()}, **stopped})
            return None, g.size + salvage.idle > 0
        if isinstance(source, Memory):
            progress.recovered(rows, at=max([progress.step_done, *steps, *(r.step for r in rows)]))
            c.sm.note("info", reason=f"cannot heal from the live state: {why}; forming the next group from the "
                                     f"peer snapshots of step {source.step} that the survivors hold",
                      step=progress.step_done, cause="failure",
                      details={"snapshot_step": source.step, "serve": {str(r): s for r, s in source.serve},
                               **stopped})
            return source, True
        if stopped or salvage.idle:
            said = ([f"kept {salvage.idle} idle (no state to heal from)"] if salvage.idle else []) + \
                   ([f"stopped {len(salvage.stopped_why)}: {'; '.join(salvage.stopped_why)}"]
                    if salvage.stopped_why else [])
            c.sm.note("info", reason=f"healing from {len(infos)} surviving worker(s); {'; '.join(said)}",
                      step=progress.step_done, details={"idle": salvage.idle, **stopped})
        progress.recovered(rows, at=steps.pop())
        return source, True

    def drop_members(self, dead: set[str]) -> None:
        """After a failure that kept no worker: stop every member, but keep the group's standbys, and
        its spares off the `dead` nodes, for the re-form to claim (a shutdown would stop them too, and
        every worker would start afresh)."""
        if self.ctx.group is not None:
            self.ctx.group.stop_members(dead=dead)
