"""A job's worker group: one Ray actor per rank, each in its own placement group on a chosen node.

The coordinator decides how many workers go on which node (`service.placement.assign_nodes`); ranks
are numbered node by node, so the ranks of a TP group (adjacent ranks: TP is the innermost mesh axis)
share a node. On a planned resize, surviving actors are kept and only re-join (process-group re-form,
~0.03 s); only missing ranks are started and only extra ones stopped. After an unplanned failure the
survivors may be stuck in a collective with a dead peer: `salvage` aborts their group, and those that
answer leave it and are kept (to heal from, or as warm processes for a resume from storage). While it
waits on workers (a start, a form, a transfer) the group probes their nodes (`service.placement.
probe_nodes`), so a node that dies meanwhile fails the wait within seconds. A group with an `owner` (a
coordinator in a named actor, which Ray restarts when its process dies) starts its workers as detached
actors in detached placement groups: they outlive the coordinator's process, the restarted coordinator
takes them over (`adopt`), and each ends itself once its owner is gone for good (`workers.actor.watch_owner`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup

from parallel.planner import Plan
from service.group_types import Formed, Moved, WorkerFailure
from service.worker_start import CONTROL, Member, WorkerStarts, probe_gaps
from workers.config import JobConfig
from workers.report import Salvaged

__all__ = ["CONTROL", "Member", "WorkerGroup"]

logger = logging.getLogger(__name__)


class WorkerGroup(WorkerStarts):
    def __init__(self, cfg: JobConfig, run_dir: str, *, cpus_per_worker: float, gpus_per_worker: float,
                 job_id: str, start_timeout_s: float = 30.0, start_probe_s: float = 3.0,
                 probe_timeout_s: float = 2.0, owner: str | None = None, namespace: str = "elastron"):
        """`owner`: the named actor (in `namespace`) the coordinator runs in, whose restart the workers
        outlive (None: they end with the process that started them). `start_probe_s`: how long a start
        waits for its workers before it probes the nodes they are still starting on (and again as
        often); one that does not answer within `probe_timeout_s` fails the start at once. A node killed
        just as the group starts on it (the second failure of a double fault) leaves its actor pending
        until Ray's health checks declare the node dead, ~15 s."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.cpus = cpus_per_worker
        self.gpus = gpus_per_worker
        self.job_id = job_id
        self.start_timeout_s = start_timeout_s
        self.start_probe_s, self.probe_timeout_s = start_probe_s, probe_timeout_s
        self.owner, self.namespace = owner, namespace
        self.members: list[Member] = []
        self.spares: list[tuple[str, Any, PlacementGroup, Any]] = []
        """Actors started ahead of a growth (node, actor, pg, info ref), not yet members."""
        self.standby: list[tuple[str, Any, Any]] = []
        """Idle actors kept started on the members' nodes, reserving nothing (node, actor, ref of its
        last ping): `keep_standby`."""
        self.standby_used = 0
        """How many of the last start's workers were standbys claimed instead of new processes."""
        self.salvage_lost: list[str] = []
        """Why each member the last `salvage` stopped was stopped."""
        self.salvage_idle = 0
        """How many members the last `salvage` kept as spares: they hold no state to heal from, but their
        processes are idle and sound (`Salvaged.reusable`), so the next start takes them (`_take_spares`)."""
        self._idle_members: dict[int, Any] = {}
        """Those spares' actor handles by id (held, so an id is not reused): taken by a start, they count
        as members kept, not as workers started (`_rejoined`)."""
        self._rejoined = 0
        self._unread: list[Any] = []
        """Refs of calls the group stopped waiting for (the other ranks' `run` once one rank failed, say):
        read when they have ended (`_settle`), so that their errors, expected after a failure, go to this
        logger at debug level instead of being printed by Ray as "Unhandled error" tracebacks when the refs
        are dropped."""

    # -- membership ------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.members)

    def nodes(self) -> Counter:
        return Counter(m.node_id for m in self.members)

    def scale_to(self, nodes: list[str]) -> tuple[int, int]:
        """Make the group have one member per entry of `nodes`. Keeps members already on those nodes,
        stops the rest, starts the missing. Members end up ordered node by node (rank order), in the
        order nodes first appear in `nodes`. Returns (started, stopped)."""
        members, leavers, started = self._arrange(nodes, stop_leavers_first=True)
        self.members = members
        return len(started) - self._rejoined, len(leavers)

    def _arrange(self, nodes: list[str], *, stop_leavers_first: bool) -> tuple[list[Member], list[Member], list[Member]]:
        """(members in rank order for `nodes`, leavers, started): survivors kept on their nodes, the
        missing started (pre-started spares first, then standbys). Leavers are stopped before the start
        when `stop_leavers_first` (their slots may be needed), else left running for the caller."""
        want = Counter(nodes)
        pool: dict[str, list[Member]] = defaultdict(list)
        leavers: list[Member] = []
        for m in self.members:
            (pool[m.node_id].append(m) if len(pool[m.node_id]) < want[m.node_id] else leavers.append(m))
        if stop_leavers_first:
            self._stop(leavers)
        missing = [nid for nid in want for _ in range(want[nid] - len(pool[nid]))]
        warm = self._take_spares(missing)
        for nid, *_ in warm:
            missing.remove(nid)
        # salvaged members kept idle rejoin: not started here, as warm survivors kept as members are not
        self._rejoined = sum(self._idle_members.pop(id(a), None) is not None for _, a, *_ in warm)
        warm += (claimed := self._take_standby(missing))
        for nid, *_ in claimed:
            missing.remove(nid)
        self.standby_used = len(claimed)
        kept = sorted({m.node_id for ms in pool.values() for m in ms})  # a kept member's node can die meanwhile
        started = self._start(warm + self._launch(missing), watch=kept) if warm or missing else []
        for m in started:  # placement targets a node softly: group by where the actor really runs
            pool[m.node_id].append(m)
        order = list(dict.fromkeys(nodes)) + [nid for nid in pool if nid not in want]
        return [m for nid in order for m in pool.get(nid, [])], leavers, started

    def _await_probing(self, refs: list, what: str, *, timeout_s: float) -> list:
        """`_get(refs)`, probing the members' nodes (`probe_gaps`) while some have not answered."""
        deadline = time.monotonic() + timeout_s
        pending, gaps = list(refs), probe_gaps(self.start_probe_s)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._unread += refs
                raise WorkerFailure("timeout", f"workers did not finish {what} within {timeout_s:.0f}s")
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, next(gaps)))
            for ref in done:
                self._get([ref], what, timeout=0, also=refs)  # a failed rank raises at once
            if pending:
                self._probe_or_fail(sorted({m.node_id for m in self.members}), f"during {what}")
        return self._get(refs, what, timeout=0)

    def shutdown(self) -> None:
        self.stop_members()
        self._stop_standby()

    def stop_members(self) -> None:
        """Stop every member and spare; standbys stay (`shutdown` stops them too)."""
        self._settle()
        self._stop(self.members + [Member(a, pg, nid, "") for nid, a, pg, _ in self.spares])
        self.members, self.spares, self._idle_members = [], [], {}

    # -- collective operations ---------------------------------------------------------------------------
    def form(self, plan: Plan, *, adopt: bool = False) -> Formed:
        """(Re-)form the process group over the current members for `plan`, which every rank gets whole
        (layout and micro batch); each builds its trainer and resumes from the latest committed
        checkpoint, or, with `adopt`, takes the state a `reshard` transfer gave it. Returns timings and
        the step."""
        t0 = time.perf_counter()
        head = self.members[0]
        port = self._await_probing([head.actor.free_port.remote()], "form", timeout_s=60)[0]
        refs = [m.actor.join.remote(rank=r, world_size=self.size, master_addr=head.ip, master_port=port,
                                    plan=plan.to_dict(), adopt=adopt) for r, m in enumerate(self.members)]
        res = self._await_probing(refs, "form", timeout_s=300)
        steps = {r["step"] for r in res}
        if len(steps) != 1:
            raise WorkerFailure("form", f"ranks resumed at different steps {sorted(steps)}")
        return Formed(step=steps.pop(), form_s=time.perf_counter() - t0)

    def reshard(self, old: Plan, new: Plan, nodes: list[str], *, survivors: list[int] | None = None) -> Moved:
        """Move the live state from `old` (the current members) to `new` on `nodes` over the network,
        no storage: every member hands its shards over and leaves its training group; joiners start
        (spares first); old members and joiners form one transfer group and run the exchange plan
        (workers.reshard); leavers stop; the new training group forms and adopts what it received.
        `survivors`: after a failure, the old ranks of the members, which `salvage()` already made hand
        over. Raises WorkerFailure if any part fails: the caller
        falls back to the last committed checkpoint (every member, joiners included, is in `members`
        then, so a shutdown releases them all)."""
        t0 = time.perf_counter()
        if survivors is None:
            steps = set(self._get([m.actor.hand_over.remote() for m in self.members], "hand over", timeout=600))
            if len(steps) != 1:
                raise WorkerFailure("hand over", f"ranks handed over different steps {sorted(steps)}")
        old_ranks = survivors if survivors is not None else list(range(self.size))
        old_members = list(self.members)
        members, leavers, started = self._arrange(nodes, stop_leavers_first=False)
        everyone = old_members + started  # the transfer group: old ranks first, in their order
        self.members = everyone
        slot = {id(m): i for i, m in enumerate(everyone)}
        new_to_group = {r: slot[id(m)] for r, m in enumerate(members)}
        group_to_new = {g: r for r, g in new_to_group.items()}
        t1 = time.perf_counter()
        port = self._await_probing([everyone[0].actor.free_port.remote()], "state transfer", timeout_s=60)[0]
        refs = [m.actor.reshard.remote(
            rank=g, world_size=len(everyone), master_addr=everyone[0].ip, master_port=port,
            old_plan=old.to_dict(), new_plan=new.to_dict(),
            old_rank=old_ranks[g] if g < len(old_members) else None, new_rank=group_to_new.get(g),
            old_to_group={r: g for g, r in enumerate(old_ranks)}, new_to_group=new_to_group,
            nodes={i: e.node_id for i, e in enumerate(everyone)}) for g, m in enumerate(everyone)]
        moved = self._await_probing(refs, "state transfer", timeout_s=600)
        t2 = time.perf_counter()
        self._stop(leavers)
        self.members = members
        formed = self.form(new, adopt=True)
        return Moved(step=formed.step, started=len(started) - self._rejoined, stopped=len(leavers),
                     bytes_moved=sum(r["bytes_received"] for r in moved), handover_s=t1 - t0, transfer_s=t2 - t1,
                     form_s=formed.form_s,
                     transfer_parts={k: max(r["timings"].get(k, 0.0) for r in moved) for k in moved[0]["timings"]})

    def run(self, *, until_step: int, steps: int, should_abort=lambda: False) -> list[dict]:
        """`steps` training steps on every rank (the same count everywhere); rank 0's metrics. Polls
        `should_abort` while waiting so a dead node is acted on at once, not after a collective timeout."""
        self._settle()
        refs = [m.actor.run.remote(until_step=until_step, steps=steps) for m in self.members]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            for ref in done:
                self._get([ref], "run", also=refs)  # raises WorkerFailure if that rank failed
            if pending and should_abort():
                self._unread += refs
                raise WorkerFailure("node", "a node hosting workers died during a step")
        return self._get([refs[0]], "run")[0]

    def salvage(self, *, gone: Collection[str] = (), dead: Callable[[], Collection[str]] = tuple,
                timeout_s: float = 15.0, abort: bool = True) -> dict[int, Salvaged]:
        """After a failure: every member that answers within `timeout_s` with shards it can vouch for
        (Worker.salvage) stays, in old-rank order; one that answers with none, but idle and sound
        (`Salvaged.reusable`: no trainer, or its state untrusted and dropped), becomes a spare for the
        next start; the others (dead, stuck in a collective, a save left running) are stopped, and
        `salvage_lost` says why. Members on `gone` nodes, which the cluster watcher already lists
        as dead, are not asked: their silence would only be waited out (the grace below); nor are those on
        nodes `dead()` names while the salvage waits (a probe running beside it). `abort`: abort
        their process groups first, so calls stuck in a collective with a dead peer raise (not for
        workers whose coordinator died, not a peer: their calls end by themselves, unless the coordinator
        died between sending a call to one member and to the next). Returns each survivor's report by
        its old rank."""
        asked = [m for m in self.members if m.node_id not in gone]

        def on_dead_nodes(calls: dict) -> Callable[[], set]:
            def skip() -> set:
                found = set(dead())
                return {calls[id(m)] for m in asked if m.node_id in found and id(m) in calls}
            return skip

        aborts = {id(m): m.actor.abort.options(concurrency_group=CONTROL).remote() for m in asked} if abort else {}
        # stuck collectives raise; then salvage runs
        self._replies(list(aborts.values()), timeout_s=2.0, grace_s=0.5, skip=on_dead_nodes(aborts))
        refs = {id(m): m.actor.salvage.remote() for m in asked}
        ready = self._replies(list(refs.values()), timeout_s=timeout_s, grace_s=2.0, skip=on_dead_nodes(refs))
        kept: dict[int, tuple[Member, Salvaged]] = {}
        lost: list[Member] = []
        idle: list[tuple[str, Any, PlacementGroup, Any]] = []
        self.salvage_lost = []
        for m in self.members:
            info, ref = None, refs.get(id(m))
            if ref is None:
                why = "its node is dead"
            elif ref not in ready:
                why = "it did not answer"
            else:
                try:
                    info = ray.get(ref)
                    why = info.why
                except RayError as e:
                    why = f"its salvage failed: {type(e).__name__}"
            if info is not None and info.held:
                kept[info.old_rank] = (m, info)
            elif info is not None and info.reusable:  # idle, holding its slot: a spare for the next start
                idle.append((m.node_id, m.actor, m.pg, m.actor.info.options(concurrency_group=CONTROL).remote()))
            else:
                lost.append(m)
                self.salvage_lost.append(why or "no reason given")
        self._stop(lost)
        self.spares += idle
        self._idle_members.update((id(a), a) for _, a, *_ in idle)
        self.salvage_idle = len(idle)
        self.members = [kept[r][0] for r in sorted(kept)]
        self._unread += list(aborts.values()) + list(refs.values())
        self._settle()  # the survivors' interrupted calls have ended: their salvage ran after them
        return {r: kept[r][1] for r in sorted(kept)}

    @staticmethod
    def _replies(refs: list, *, timeout_s: float, grace_s: float, skip: Callable[[], set] = set) -> set:
        """The refs that finish within `timeout_s`, waiting at most `grace_s` more once the first has: a
        member on a node that vanished may take Ray many seconds to declare dead, and its peers answer
        in well under a second. Refs in `skip()` (asked again every 0.1 s) are not waited for."""
        deadline = time.monotonic() + timeout_s
        ready: set = set()
        while (waiting := [r for r in refs if r not in ready and r not in skip()]) \
                and (left := deadline - time.monotonic()) > 0:
            done, _ = ray.wait(waiting, num_returns=1, timeout=min(0.1, left))
            if not ready and done:
                deadline = min(deadline, time.monotonic() + grace_s)
            ready.update(done)
        return ready

    def checkpoint(self, *, blocking: bool = True) -> int:
        """Save at the current step; blocking waits for the commit, else returns once the save is under
        way (it stages during the next step and commits in the background)."""
        steps = set(self._get([m.actor.checkpoint.remote(blocking=blocking) for m in self.members],
                              "checkpoint", timeout=600))
        return max(steps)

    def leave(self) -> None:
        """Every member drops its trainer and process group (probing their nodes: after a failure, a
        warm survivor's node may have died since it answered the salvage)."""
        self._await_probing([m.actor.leave.remote() for m in self.members], "leave", timeout_s=60)

    def _settle(self) -> None:
        """Read the calls the group stopped waiting for that have ended (`_unread`); keep the others."""
        if not self._unread:
            return
        refs = list(dict.fromkeys(self._unread))
        done, self._unread = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except RayError as e:
                logger.debug("a call the group no longer waited for ended in %s: %s", type(e).__name__,
                             (str(e).strip().splitlines() or [""])[-1])

    def _get(self, refs: list, what: str, timeout: float | None = None, *, also: list = ()) -> list:
        """`ray.get(refs)`, with a failure as WorkerFailure; then the refs not read (the others of a call
        on every rank, and `also`) go to `_unread`."""
        try:
            return ray.get(refs, timeout=timeout)
        except RayError as e:
            self._unread += [*refs, *also]
            raise self._failure(e, what, timeout) from e

    @staticmethod
    def _failure(e: RayError, what: str, timeout: float | None) -> WorkerFailure:
        if isinstance(e, RayActorError):
            return WorkerFailure("died", f"a worker died during {what}: {str(e).splitlines()[0]}")
        if isinstance(e, GetTimeoutError):
            return WorkerFailure("timeout", f"workers did not finish {what} within {timeout:.0f}s")
        cause = getattr(e, "cause", None)
        kind = f"error:{type(cause).__name__}" if cause is not None else "error"
        msg = str(cause) if cause is not None else str(e).splitlines()[-1]
        return WorkerFailure(kind, f"a worker raised during {what}: {msg}")
