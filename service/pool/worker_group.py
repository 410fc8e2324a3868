"""A job's worker group: one Ray actor per rank, each in its own placement group on a chosen node.

The coordinator decides how many workers go on which node (`service.pool.placement.assign_nodes`); ranks
are numbered node by node, so the ranks of a TP group (adjacent ranks: TP is the innermost mesh axis)
share a node. On a planned resize, surviving actors are kept and only re-join their process group;
only missing ranks are started and only extra ones stopped. After an unplanned failure the
survivors may be stuck in a collective with a dead peer: `salvage` aborts their group, and those that
answer leave it and are kept (to heal from, or as warm processes for a resume from storage).

`WorkerGroup` runs the group's collective operations and composes the parts they share, one concept
each: who it holds (`service.pool.roster`: every actor one `WorkerHandle` with its role, a member, a
spare or a standby), waits on calls and the probes of their nodes beside them (`service.pool.calls`: a
node that dies during a start, a form, a hand-over, a transfer, a checkpoint or a step fails the wait
within seconds), slots (`service.pool.slots`), starting and stopping actors (`service.pool.launch`),
the spares and standbys a start takes first (`service.pool.reserve`), and the takeover of a previous
coordinator's workers (`service.pool.takeover`). A group with an `owner` (a coordinator in a named
actor, which Ray restarts when its process dies) starts its workers as detached actors in detached
placement groups: they outlive the coordinator's process, the restarted coordinator takes them over
(`adopt`), and each ends itself once its owner is gone for good (`workers.actor.watch_owner`).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Mapping

import ray
from ray.exceptions import RayError

from parallel.planner import Plan
from service.pool.calls import Calls, replies
from service.pool.group import CarriedOn, FailureKind, Fate, Formed, Moved, Salvage, Started, WorkerFailure
from service.pool.launch import CONTROL, WORKER_ENV, Launcher
from service.pool.reserve import Reserve
from service.pool.roster import Role, Roster, WorkerHandle
from service.pool.slots import Slots
from service.pool.takeover import Takeover
from workers.config import JobConfig
from workers.report import Salvaged, Seconds, Trained

__all__ = ["CONTROL", "WORKER_ENV", "Role", "WorkerGroup", "WorkerHandle", "transfer_calls"]


def transfer_calls(*, everyone: list[str], old_ranks: list[int], group_to_new: Mapping[int, int],
                   old_to_group: Mapping[int, int], new_to_group: Mapping[int, int], put: Callable) -> list[dict]:
    """The per-member arguments of a state transfer's `Worker.reshard` calls, member g of `everyone` (their
    node ids, old members first) at transfer rank g. The maps every member reads (old rank -> sender,
    new rank -> receiver, transfer rank -> node) have an entry per rank: each is `put` once and passed by
    reference (Ray resolves a top-level reference before the call), so a transfer serialises O(N) bytes
    rather than every map again in each of N calls."""
    shared = {"old_to_group": put(dict(old_to_group)), "new_to_group": put(dict(new_to_group)),
              "nodes": put(dict(enumerate(everyone)))}
    return [{"rank": g, "world_size": len(everyone), "old_rank": old_ranks[g] if g < len(old_ranks) else None,
             "new_rank": group_to_new.get(g), **shared} for g in range(len(everyone))]


class WorkerGroup:
    def __init__(self, cfg: JobConfig, run_dir: str, *, cpus_per_worker: float, gpus_per_worker: float,
                 job_id: str, start_timeout_s: float = 30.0, start_probe_s: float = 3.0,
                 probe_timeout_s: float = 2.0, owner: str | None = None, namespace: str = "elastron"):
        """`owner`: the named actor (in `namespace`) the coordinator runs in, whose restart the workers
        outlive (None: they end with the process that started them). `start_probe_s`: how long a wait on
        workers (a start, or any call) goes at most between two probes of the nodes it waits on
        (`service.pool.calls.probe_gaps`); one that does not answer within `probe_timeout_s` fails the wait
        at once, instead of leaving its actor pending until Ray's health checks declare the node dead."""
        self.cfg = cfg
        self.roster = Roster()
        self.calls = Calls(probe_cap_s=start_probe_s, probe_timeout_s=probe_timeout_s)
        self.slots = Slots(cpus=cpus_per_worker, gpus=gpus_per_worker, job_id=job_id, owner=owner)
        self.launcher = Launcher(cfg, run_dir, roster=self.roster, slots=self.slots, calls=self.calls,
                                 start_timeout_s=start_timeout_s, namespace=namespace)
        self.reserve = Reserve(roster=self.roster, slots=self.slots, launcher=self.launcher)
        self.takeover = Takeover(roster=self.roster, calls=self.calls, launcher=self.launcher, job_id=job_id,
                                 owner=owner, namespace=namespace)

    # -- membership ------------------------------------------------------------------------------------
    @property
    def workers(self) -> list[WorkerHandle]:
        """Every worker the group holds: the members first, in rank order, then spares and standbys."""
        return self.roster.workers

    @workers.setter
    def workers(self, handles: list[WorkerHandle]) -> None:
        self.roster.workers = handles

    @property
    def members(self) -> list[WorkerHandle]:
        """The ranks, in rank order."""
        return self.roster.members

    @property
    def spares(self) -> list[WorkerHandle]:
        return self.roster.spares

    @property
    def standby(self) -> list[WorkerHandle]:
        return self.roster.standby

    @property
    def size(self) -> int:
        return len(self.members)

    def nodes(self) -> Counter:
        return Counter(m.node_id for m in self.members)

    def scale_to(self, nodes: list[str]) -> Started:
        """Make the group have one member per entry of `nodes`. Keeps members already on those nodes,
        stops the rest, starts the missing. Members end up ordered node by node (rank order), in the
        order nodes first appear in `nodes`."""
        members, _, _, start = self._arrange(nodes, stop_leavers_first=True)
        self.roster.set_members(members)
        return start

    def _arrange(self, nodes: list[str], *, stop_leavers_first: bool
                 ) -> tuple[list[WorkerHandle], list[WorkerHandle], list[WorkerHandle], Started]:
        """(members in rank order for `nodes`, leavers, the members started, the counts): survivors kept on their nodes,
        the missing started (pre-started spares first, then standbys). Leavers are stopped before the
        start when `stop_leavers_first` (their slots may be needed), else left running for the caller."""
        want = Counter(nodes)
        pool: dict[str, list[WorkerHandle]] = defaultdict(list)
        leavers: list[WorkerHandle] = []
        for m in self.members:
            (pool[m.node_id].append(m) if len(pool[m.node_id]) < want[m.node_id] else leavers.append(m))
        if stop_leavers_first:
            self.launcher.stop(leavers)
        missing = [nid for nid in want for _ in range(want[nid] - len(pool[nid]))]
        try:
            warm = self.reserve.take_spares(missing)
            for w in warm:
                missing.remove(w.node_id)
            # salvaged members kept idle rejoin: not started here, as warm survivors kept as members are not
            rejoined = sum(w.rejoins for w in warm)
            warm += (claimed := self.reserve.take_standby(missing))
            for w in claimed:
                missing.remove(w.node_id)
            kept = sorted({m.node_id for ms in pool.values() for m in ms})  # a kept member's node can die meanwhile
            started = self.launcher.start(warm + self.launcher.launch(missing), watch=kept) if warm or missing else []
        finally:
            self.slots.release_vacant()
        for m in started:  # placement targets a node softly: group by where the actor really runs
            pool[m.node_id].append(m)
        order = list(dict.fromkeys(nodes)) + [nid for nid in pool if nid not in want]
        return [m for nid in order for m in pool.get(nid, [])], leavers, started, \
            Started(started=len(started) - rejoined, stopped=len(leavers), from_standby=len(claimed), rejoined=rejoined)

    def _await(self, refs: list, what: str, *, timeout_s: float) -> list:
        """The answers of `refs`, probing the members' nodes while some have not answered."""
        return self.calls.await_probing(refs, what, nodes=self.roster.member_nodes, timeout_s=timeout_s)

    def shutdown(self) -> None:
        self.calls.settle()
        self.launcher.stop(list(self.workers))
        self.slots.release_vacant()

    def stop_members(self, *, dead: Collection[str] = ()) -> None:
        """Stop every member, and the spares on `dead` nodes or whose start failed; the other spares and
        the standbys stay for the next start (`shutdown` stops them too). A member's slot on a node not
        `dead` stays placed (vacant) for that start, as a salvage leaves a lost member's: the standby or
        worker that replaces it there takes it at once, where a new placement group would wait for the
        old one's removal and, its target only soft where nodes share an IP, could land on the node
        another claim needs (the next start removes the slots it does not take)."""
        self.calls.settle()
        for m in self.members:
            if m.pg is not None and m.node_id not in dead:
                self.slots.leave_vacant(m.node_id, m.pg)
                m.pg = None
        self.launcher.stop(self.members + [w for w in self.spares if w.node_id in dead or not w.sound()])

    # -- collective operations ---------------------------------------------------------------------------
    def form(self, plan: Plan, *, adopt: bool = False) -> Formed:
        """(Re-)form the process group over the current members for `plan`, which every rank gets whole
        (layout and micro batch); each builds its trainer and resumes from the latest committed
        checkpoint, or, with `adopt`, takes the state a `reshard` transfer gave it. Returns timings and
        the step."""
        t0 = time.perf_counter()
        head = self.members[0]
        port = self._await([head.actor.open_store.remote()], "form", timeout_s=60)[0]
        refs = [m.actor.join.remote(rank=r, world_size=self.size, master_addr=head.ip, master_port=port,
                                    plan=plan, adopt=adopt) for r, m in enumerate(self.members)]
        res = self._await(refs, "form", timeout_s=300)
        steps = {r.step for r in res}
        if len(steps) != 1:
            raise WorkerFailure(FailureKind.OUT_OF_STEP, f"ranks resumed at different steps {sorted(steps)}")
        return Formed(step=steps.pop(), form_s=time.perf_counter() - t0,
                      form_parts=Seconds.slowest(r.parts for r in res),
                      snapshot_bytes=max(r.snapshot_bytes for r in res))

    def reshard(self, old: Plan, new: Plan, nodes: list[str], *, survivors: list[int] | None = None,
                serve: dict[int, int] | None = None, snapshot_step: int | None = None) -> Moved:
        """Move the live state from `old` (the current members) to `new` on `nodes` over the network,
        no storage: every member hands its shards over and leaves its training group; joiners start
        (spares first); old members and joiners form one transfer group and run the exchange plan
        (workers.reshard); leavers stop; the new training group forms and adopts what it received.
        `survivors`: after a failure, the old ranks of the members, which `salvage()` already made hand
        over. `serve` and `snapshot_step`: the state is the peer snapshots of that step, old rank r's
        sent by the survivor of old rank `serve[r]`. Raises WorkerFailure if any part fails: the caller
        falls back to the last committed checkpoint (every member, joiners included, is in `members`
        then, so a shutdown releases them all)."""
        t0 = time.perf_counter()
        if survivors is None:
            steps = set(self._await([m.actor.hand_over.remote() for m in self.members], "hand over",
                                    timeout_s=600))
            if len(steps) != 1:
                raise WorkerFailure(FailureKind.OUT_OF_STEP, f"ranks handed over different steps {sorted(steps)}")
        old_ranks = survivors if survivors is not None else list(range(self.size))
        old_members = list(self.members)
        t_start = time.perf_counter()
        members, leavers, started, start = self._arrange(nodes, stop_leavers_first=False)
        start_s = time.perf_counter() - t_start
        everyone = old_members + started  # the transfer group: old ranks first, in their order
        self.roster.set_members(everyone)
        slot = {id(m): i for i, m in enumerate(everyone)}
        new_to_group = {r: slot[id(m)] for r, m in enumerate(members)}
        group_to_new = {g: r for r, g in new_to_group.items()}
        t1 = time.perf_counter()
        old_to_group = {r: g for g, r in enumerate(old_ranks)}
        if serve is not None:
            old_to_group = {r: old_to_group[s] for r, s in serve.items()}
        port = self._await([everyone[0].actor.open_store.remote()], "state transfer", timeout_s=60)[0]
        calls = transfer_calls(everyone=[e.node_id for e in everyone], old_ranks=old_ranks[:len(old_members)],
                               group_to_new=group_to_new, old_to_group=old_to_group, new_to_group=new_to_group,
                               put=ray.put)
        refs = [m.actor.reshard.remote(master_addr=everyone[0].ip, master_port=port, old_plan=old, new_plan=new,
                                       snapshot_step=snapshot_step, **kw) for m, kw in zip(everyone, calls)]
        moved = self._await(refs, "state transfer", timeout_s=600)
        t2 = time.perf_counter()
        self.launcher.stop(leavers)
        self.roster.set_members(members)
        formed = self.form(new, adopt=True)
        return Moved(step=formed.step, started=start.started, stopped=start.stopped,
                     bytes_moved=sum(r.bytes_received for r in moved), handover_s=t1 - t0, transfer_s=t2 - t1,
                     start_s=start_s, from_standby=start.from_standby,
                     form_s=formed.form_s, form_parts=formed.form_parts, snapshot_bytes=formed.snapshot_bytes,
                     transfer_parts=Seconds.slowest(r.timings for r in moved))

    def run(self, *, until_step: int, steps: int, should_abort=lambda: False) -> Trained:
        """`steps` training steps on every rank (the same count everywhere); what rank 0 trained. Polls
        `should_abort` while waiting so a dead node is acted on at once, not after a collective timeout.
        Once some ranks have answered, the nodes of those that have not are probed (`calls.probe_gaps`): the
        ranks end a call together (their steps share collectives), so one missing may have died with its
        node after its last collective, which fails no peer, and Ray reports its call only once its
        health checks declare the node dead (seconds)."""
        self.calls.settle()
        node = {m.actor.run.remote(until_step=until_step, steps=steps): m.node_id for m in self.members}
        refs = list(node)
        pending, next_probe, gaps = list(refs), None, self.calls.gaps()
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.2)  # woken by each rank's answer
            for ref in done:
                self.calls.get([ref], "run", also=refs)  # raises WorkerFailure if that rank failed
            if pending and should_abort():
                self.calls.stop_waiting(refs)
                raise WorkerFailure(FailureKind.NODE_LOST, "a node hosting workers died during a step")
            if pending and len(pending) < len(refs):
                now = time.monotonic()
                next_probe = next_probe or now + next(gaps)
                if now >= next_probe:
                    try:
                        self.calls.probe_or_fail(sorted({node[r] for r in pending}), "during a step")
                    except WorkerFailure:
                        self.calls.stop_waiting(refs)
                        raise
                    next_probe = time.monotonic() + next(gaps)
        return self.calls.get([refs[0]], "run")[0]

    def salvage(self, *, fate: Callable[[Salvaged | None], Fate], gone: Collection[str] = (),
                dead: Callable[[], Collection[str]] = tuple, timeout_s: float = 15.0, abort: bool = True) -> Salvage:
        """After a failure: each member is asked (Worker.salvage) and dealt with as `fate` (the recovery's
        rule, service.control.failure.fate) decides from its answer: one that answers within `timeout_s` with shards it can vouch for
        stays, in old-rank order; one that answers with none, but idle and sound, becomes a spare for the
        next start; the others (dead, stuck in a collective, a save left running) are stopped, and the
        result says why. Members on `gone` nodes, which the cluster watcher already lists
        as dead, are not asked: their silence would only be waited out (the grace below); nor are those on
        nodes `dead()` names while the salvage waits (a probe running beside it). `abort`: abort
        their process groups first, so calls stuck in a collective with a dead peer raise (not for
        workers whose coordinator died, not a peer: their calls end by themselves, unless the coordinator
        died between sending a call to one member and to the next)."""
        asked = [m for m in self.members if m.node_id not in gone]

        def on_dead_nodes(calls: dict) -> Callable[[], set]:
            def skip() -> set:
                found = set(dead())
                return {calls[id(m)] for m in asked if m.node_id in found and id(m) in calls}
            return skip

        aborts = {id(m): m.actor.abort.options(concurrency_group=CONTROL).remote() for m in asked} if abort else {}
        # stuck collectives raise; then salvage runs
        replies(list(aborts.values()), timeout_s=2.0, grace_s=0.5, skip=on_dead_nodes(aborts))
        refs = {id(m): m.actor.salvage.remote() for m in asked}
        ready = replies(list(refs.values()), timeout_s=timeout_s, grace_s=2.0, skip=on_dead_nodes(refs))
        kept: dict[int, tuple[WorkerHandle, Salvaged]] = {}
        lost: list[WorkerHandle] = []
        idle: list[WorkerHandle] = []
        stopped_why: list[str] = []
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
            match fate(info):
                case Fate.KEEP:  # live shards, or peer snapshots
                    kept[info.old_rank] = (m, info)
                case Fate.IDLE:  # holding its slot: a spare for the next start
                    idle.append(m)
                case Fate.STOP:
                    lost.append(m)
                    stopped_why.append(why or "no reason given")
        dead_nodes = set(gone) | set(dead())
        for m in lost:
            if m.pg is not None and m.node_id not in dead_nodes:  # its slot, for the next start there
                self.slots.leave_vacant(m.node_id, m.pg)
                m.pg = None
        self.launcher.stop(lost)
        for m in idle:
            m.role, m.rejoins, m.ping = Role.SPARE, True, m.actor.info.options(concurrency_group=CONTROL).remote()
        self.roster.set_members([kept[r][0] for r in sorted(kept)])
        self.calls.stop_waiting(list(aborts.values()) + list(refs.values()))
        self.calls.settle()  # the survivors' interrupted calls have ended: their salvage ran after them
        return Salvage(kept={r: kept[r][1] for r in sorted(kept)}, idle=len(idle), stopped_why=tuple(stopped_why))

    def checkpoint(self, *, blocking: bool = True) -> int:
        """Save at the current step; blocking waits for the commit, else returns once the save is under
        way (it stages during the next step and commits in the background). Probes the members' nodes
        while it waits, as every wait on workers does: a node that dies during the save fails it within
        seconds (WorkerFailure NODE_LOST), not after Ray's own detection."""
        steps = set(self._await([m.actor.checkpoint.remote(blocking=blocking) for m in self.members],
                                "checkpoint", timeout_s=600))
        return max(steps)

    def leave(self) -> None:
        """Every member drops its trainer and process group (probing their nodes: after a failure, a
        warm survivor's node may have died since it answered the salvage)."""
        self._await([m.actor.leave.remote() for m in self.members], "leave", timeout_s=60)

    # -- the reserve and the takeover ---------------------------------------------------------------------
    def keep_standby(self, free: Mapping[str, int] | None = None, cap: int | None = None) -> int:
        """Keep `resources.standby_per_node` idle workers started on each node that hosts members, and a
        node's worth on one node of `free` ({node: worker slots} the job may use) that hosts none, for
        the loss of a whole node (`service.pool.reserve.standby_targets`); CPU workers only (a GPU is
        given to a process when it starts), without waiting for them (`Reserve.keep_standby`); at most
        `cap` in all (None: no cap). Returns how many were started."""
        return self.reserve.keep_standby(self.cfg.resources.standby_per_node if not self.slots.gpus else 0, free,
                                         cap=cap)

    def standbys(self) -> int:
        """Standby workers started (`keep_standby`)."""
        return len(self.roster.standby)

    def prewarm(self, nodes: list[str]) -> int:
        """Start spares on `nodes` in the background while the group keeps training (`Reserve.prewarm`).
        Returns how many were started."""
        return self.reserve.prewarm(nodes)

    def warm(self, nodes: list[str]) -> bool:
        """Whether a spare has started and warmed up on each entry of `nodes` (`Reserve.warm`)."""
        return self.reserve.warm(nodes)

    def adopt(self, *, timeout_s: float = 10.0) -> int:
        """Take over the workers a previous coordinator of this job left running (`Takeover.adopt`).
        Returns how many became members (0 for a group without an owner)."""
        return self.takeover.adopt(timeout_s=timeout_s)

    def carry_on(self, plan: Plan, *, timeout_s: float = 15.0, grace_s: float = 1.0) -> CarriedOn:
        """After `adopt`: whether the members are still `plan`'s sound ranks at one step, and if so they
        are the group, in rank order (`Takeover.carry_on`)."""
        return self.takeover.carry_on(plan, timeout_s=timeout_s, grace_s=grace_s)
