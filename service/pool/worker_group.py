"""A job's worker group: one Ray actor per rank, each in its own placement group on a chosen node.

The coordinator decides how many workers go on which node (`service.pool.placement.assign_nodes`); ranks
are numbered node by node, so the ranks of a TP group (adjacent ranks: TP is the innermost mesh axis)
share a node. On a planned resize, surviving actors are kept and only re-join their process group;
only missing ranks are started and only extra ones stopped. After an unplanned failure the
survivors may be stuck in a collective with a dead peer: `salvage` aborts their group, and those that
answer leave it and are kept (to heal from, or as warm processes for a resume from storage). While it
waits on workers (a start, a form, a hand-over, a transfer, a checkpoint) the group probes their nodes (`service.pool.placement.
probe_nodes`), so a node that dies meanwhile fails the wait within seconds. A group with an `owner` (a
coordinator in a named actor, which Ray restarts when its process dies) starts its workers as detached
actors in detached placement groups: they outlive the coordinator's process, the restarted coordinator
takes them over (`adopt`), and each ends itself once its owner is gone for good (`workers.actor.watch_owner`).
Every actor the group holds is one `WorkerHandle` in `workers`, with its role: a member (a rank), a spare
(started for a slot, taken by the next start) or a standby (idle, reserving nothing until claimed).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from parallel.planner import Plan
from service.pool.detached import find_workers, release_workers, standby_kind, standby_node, worker_prefix
from service.pool.group import CarriedOn, FailureKind, Formed, Moved, Salvage, Started, WorkerFailure
from service.pool.placement import on_node, probe_nodes
from workers.config import JobConfig
from workers.strict import ConfigError
from workers.report import Salvaged

__all__ = ["CONTROL", "Role", "WorkerGroup", "WorkerHandle"]

logger = logging.getLogger(__name__)

CONTROL = "control"
"""A worker actor's second lane (concurrency group): `abort` runs there while the default lane is busy."""


class Role(StrEnum):
    MEMBER = "member"
    """A rank of the group, in its placement group."""
    SPARE = "spare"
    """Started in a placement group of its own but not a rank: ahead of a growth (`prewarm`), or a member
    a salvage kept idle; the next start takes it."""
    STANDBY = "standby"
    """Idle on its node, reserving nothing until a start claims it with a placement group."""


@dataclass(eq=False, slots=True)
class WorkerHandle:
    """One worker actor of the group, whatever its role."""

    actor: Any
    node_id: str
    pg: PlacementGroup | None
    """Its placement group (None for a standby)."""
    role: Role
    ip: str = ""
    ping: Any = None
    """Ref of its last `info` call (a standby's ping, a starting worker's answer) or, claimed, its `claim`."""
    rejoins: bool = False
    """A member a salvage kept as a spare: taken back by a start, it counts as rejoined, not started."""


FIRST_PROBE_S = 0.5
"""A wait on workers probes their nodes first after this long: soon enough to catch a node that died
just before the call (a second fault right after a first), late enough that a quick call (a live
resize's form) never pays for a probe."""

WORKER_ENV = {"MALLOC_ARENA_MAX": "2"}
"""Environment a worker process starts with (Ray `runtime_env`; a value set in the coordinator's own
environment wins). glibc gives each thread that allocates an arena of its own, up to 8 per core, and
keeps the memory a step frees in the arena that held it; a Ray actor runs its calls on threads that
change over its life, so over tens of reconfigurations the step's transient peak came to be kept in many
arenas at once: +150 to +250 MB of free heap in a survivor (benchmarks/soak.py, `small`). Two arenas
bound that; no step-time cost measured (benchmarks/throughput.py, CPU seconds per step)."""


def probe_gaps(cap_s: float) -> Iterator[float]:
    """Seconds before each probe of a wait on workers: FIRST_PROBE_S, then 1 s, doubling up to `cap_s`:
    close together early, when a second fault is most likely, and every `cap_s` through a long wait (a
    checkpoint load of minutes), so that a large group does not flood the GCS with probe placement groups."""
    yield min(FIRST_PROBE_S, cap_s)
    gap = 1.0
    while True:
        yield min(gap, cap_s)
        gap *= 2


class WorkerGroup:
    def __init__(self, cfg: JobConfig, run_dir: str, *, cpus_per_worker: float, gpus_per_worker: float,
                 job_id: str, start_timeout_s: float = 30.0, start_probe_s: float = 3.0,
                 probe_timeout_s: float = 2.0, owner: str | None = None, namespace: str = "elastron"):
        """`owner`: the named actor (in `namespace`) the coordinator runs in, whose restart the workers
        outlive (None: they end with the process that started them). `start_probe_s`: how long a start
        waits for its workers before it probes the nodes they are still starting on (and again as
        often); one that does not answer within `probe_timeout_s` fails the start at once, instead of
        leaving its actor pending until Ray's health checks declare the node dead."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.cpus = cpus_per_worker
        self.gpus = gpus_per_worker
        self.job_id = job_id
        self.start_timeout_s = start_timeout_s
        self.start_probe_s, self.probe_timeout_s = start_probe_s, probe_timeout_s
        self.owner, self.namespace = owner, namespace
        self.workers: list[WorkerHandle] = []
        """Every worker the group holds: the members first, in rank order, then spares and standbys."""
        self._vacant: dict[str, list[PlacementGroup]] = defaultdict(list)
        """Per node, the placement groups of members a salvage stopped there while the node lived: still
        placed, their resources free once the process is gone. The next start puts its workers there
        (a standby claims one at once, where a new placement group would wait for the old one's removal
        to free the node's slot); those it does not take are removed after it."""
        self._unread: list[Any] = []
        """Refs of calls the group stopped waiting for (the other ranks' `run` once one rank failed, say):
        read when they have ended (`_settle`), so that their errors, expected after a failure, go to this
        logger at debug level instead of being printed by Ray as "Unhandled error" tracebacks when the refs
        are dropped."""

    # -- membership ------------------------------------------------------------------------------------
    @property
    def members(self) -> list[WorkerHandle]:
        """The ranks, in rank order."""
        return self._with(Role.MEMBER)

    @property
    def spares(self) -> list[WorkerHandle]:
        return self._with(Role.SPARE)

    @property
    def standby(self) -> list[WorkerHandle]:
        return self._with(Role.STANDBY)

    def _with(self, role: Role) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role is role]

    def _set_members(self, members: list[WorkerHandle]) -> None:
        """`members` become the ranks, in this order; every other handle keeps its role (a member left
        out must have been stopped, or be given another role, by the caller)."""
        for m in members:
            m.role = Role.MEMBER
        rest = [w for w in self.workers if w.role is not Role.MEMBER and all(w is not m for m in members)]
        self.workers = list(members) + rest

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
        self._set_members(members)
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
            self._stop(leavers)
        missing = [nid for nid in want for _ in range(want[nid] - len(pool[nid]))]
        try:
            warm = self._take_spares(missing)
            for w in warm:
                missing.remove(w.node_id)
            # salvaged members kept idle rejoin: not started here, as warm survivors kept as members are not
            rejoined = sum(w.rejoins for w in warm)
            warm += (claimed := self._take_standby(missing))
            for w in claimed:
                missing.remove(w.node_id)
            kept = sorted({m.node_id for ms in pool.values() for m in ms})  # a kept member's node can die meanwhile
            started = self._start(warm + self._launch(missing), watch=kept) if warm or missing else []
        finally:
            self._release_vacant()
        for m in started:  # placement targets a node softly: group by where the actor really runs
            pool[m.node_id].append(m)
        order = list(dict.fromkeys(nodes)) + [nid for nid in pool if nid not in want]
        return [m for nid in order for m in pool.get(nid, [])], leavers, started, \
            Started(started=len(started) - rejoined, stopped=len(leavers), from_standby=len(claimed), rejoined=rejoined)

    def _await_probing(self, refs: list, what: str, *, timeout_s: float) -> list:
        """`_get(refs)`, probing the members' nodes (`probe_gaps`) while some have not answered."""
        deadline = time.monotonic() + timeout_s
        pending, gaps = list(refs), probe_gaps(self.start_probe_s)
        next_probe = time.monotonic() + next(gaps)
        while pending:
            now = time.monotonic()
            if now >= deadline:
                self._unread += refs
                raise WorkerFailure(FailureKind.TIMED_OUT, f"workers did not finish {what} within {timeout_s:.0f}s")
            # woken by each answer, not only by the last: a rank that failed fails the wait at once
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(deadline, next_probe) - now))
            for ref in done:
                self._get([ref], what, timeout=0, also=refs)
            if pending and time.monotonic() >= next_probe:
                self._probe_or_fail(sorted({m.node_id for m in self.members}), f"during {what}")
                next_probe = time.monotonic() + next(gaps)
        return self._get(refs, what, timeout=0)

    def shutdown(self) -> None:
        self._settle()
        self._stop(list(self.workers))
        self._release_vacant()

    def stop_members(self, *, dead: Collection[str] = ()) -> None:
        """Stop every member, and the spares on `dead` nodes or whose start failed; the other spares and
        the standbys stay for the next start (`shutdown` stops them too)."""
        self._settle()
        self._stop(self.members + [w for w in self.spares if w.node_id in dead or not _sound(w.ping)])
        self._release_vacant()

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
        steps = {r.step for r in res}
        if len(steps) != 1:
            raise WorkerFailure(FailureKind.OUT_OF_STEP, f"ranks resumed at different steps {sorted(steps)}")
        parts = {k: max(r.parts.get(k, 0.0) for r in res) for k in res[0].parts}
        return Formed(step=steps.pop(), form_s=time.perf_counter() - t0, form_parts=parts,
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
            steps = set(self._await_probing([m.actor.hand_over.remote() for m in self.members], "hand over",
                                            timeout_s=600))
            if len(steps) != 1:
                raise WorkerFailure(FailureKind.OUT_OF_STEP, f"ranks handed over different steps {sorted(steps)}")
        old_ranks = survivors if survivors is not None else list(range(self.size))
        old_members = list(self.members)
        members, leavers, started, start = self._arrange(nodes, stop_leavers_first=False)
        everyone = old_members + started  # the transfer group: old ranks first, in their order
        self._set_members(everyone)
        slot = {id(m): i for i, m in enumerate(everyone)}
        new_to_group = {r: slot[id(m)] for r, m in enumerate(members)}
        group_to_new = {g: r for r, g in new_to_group.items()}
        t1 = time.perf_counter()
        old_to_group = {r: g for g, r in enumerate(old_ranks)}
        if serve is not None:
            old_to_group = {r: old_to_group[s] for r, s in serve.items()}
        port = self._await_probing([everyone[0].actor.free_port.remote()], "state transfer", timeout_s=60)[0]
        refs = [m.actor.reshard.remote(
            rank=g, world_size=len(everyone), master_addr=everyone[0].ip, master_port=port,
            old_plan=old.to_dict(), new_plan=new.to_dict(),
            old_rank=old_ranks[g] if g < len(old_members) else None, new_rank=group_to_new.get(g),
            old_to_group=old_to_group, new_to_group=new_to_group, snapshot_step=snapshot_step,
            nodes={i: e.node_id for i, e in enumerate(everyone)}) for g, m in enumerate(everyone)]
        moved = self._await_probing(refs, "state transfer", timeout_s=600)
        t2 = time.perf_counter()
        self._stop(leavers)
        self._set_members(members)
        formed = self.form(new, adopt=True)
        return Moved(step=formed.step, started=start.started, stopped=start.stopped,
                     bytes_moved=sum(r.bytes_received for r in moved), handover_s=t1 - t0, transfer_s=t2 - t1,
                     form_s=formed.form_s, form_parts=formed.form_parts, snapshot_bytes=formed.snapshot_bytes,
                     transfer_parts={k: max(r.timings.get(k, 0.0) for r in moved) for k in moved[0].timings})

    def run(self, *, until_step: int, steps: int, should_abort=lambda: False) -> list[dict]:
        """`steps` training steps on every rank (the same count everywhere); rank 0's metrics. Polls
        `should_abort` while waiting so a dead node is acted on at once, not after a collective timeout.
        Once some ranks have answered, the nodes of those that have not are probed (`probe_gaps`): the
        ranks end a call together (their steps share collectives), so one missing may have died with its
        node after its last collective, which fails no peer, and Ray reports its call only once its
        health checks declare the node dead (seconds)."""
        self._settle()
        node = {m.actor.run.remote(until_step=until_step, steps=steps): m.node_id for m in self.members}
        refs = list(node)
        pending, next_probe, gaps = list(refs), None, probe_gaps(self.start_probe_s)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.2)  # woken by each rank's answer
            for ref in done:
                self._get([ref], "run", also=refs)  # raises WorkerFailure if that rank failed
            if pending and should_abort():
                self._unread += refs
                raise WorkerFailure(FailureKind.NODE_LOST, "a node hosting workers died during a step")
            if pending and len(pending) < len(refs):
                now = time.monotonic()
                next_probe = next_probe or now + next(gaps)
                if now >= next_probe:
                    try:
                        self._probe_or_fail(sorted({node[r] for r in pending}), "during a step")
                    except WorkerFailure:
                        self._unread += refs
                        raise
                    next_probe = time.monotonic() + next(gaps)
        return self._get([refs[0]], "run")[0]

    def salvage(self, *, gone: Collection[str] = (), dead: Callable[[], Collection[str]] = tuple,
                timeout_s: float = 15.0, abort: bool = True) -> Salvage:
        """After a failure: every member that answers within `timeout_s` with shards it can vouch for
        (Worker.salvage) stays, in old-rank order; one that answers with none, but idle and sound
        (`Salvaged.reusable`: no trainer, or its state untrusted and dropped), becomes a spare for the
        next start; the others (dead, stuck in a collective, a save left running) are stopped, and
        the result says why. Members on `gone` nodes, which the cluster watcher already lists
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
        self._replies(list(aborts.values()), timeout_s=2.0, grace_s=0.5, skip=on_dead_nodes(aborts))
        refs = {id(m): m.actor.salvage.remote() for m in asked}
        ready = self._replies(list(refs.values()), timeout_s=timeout_s, grace_s=2.0, skip=on_dead_nodes(refs))
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
            if info is not None and (info.held or info.snapshots):  # live shards, or peer snapshots
                kept[info.old_rank] = (m, info)
            elif info is not None and info.reusable:  # idle, holding its slot: a spare for the next start
                idle.append(m)
            else:
                lost.append(m)
                stopped_why.append(why or "no reason given")
        dead_nodes = set(gone) | set(dead())
        for m in lost:
            if m.pg is not None and m.node_id not in dead_nodes:  # its slot, for the next start there
                self._vacant[m.node_id].append(m.pg)
                m.pg = None
        self._stop(lost)
        for m in idle:
            m.role, m.rejoins, m.ping = Role.SPARE, True, m.actor.info.options(concurrency_group=CONTROL).remote()
        self._set_members([kept[r][0] for r in sorted(kept)])
        self._unread += list(aborts.values()) + list(refs.values())
        self._settle()  # the survivors' interrupted calls have ended: their salvage ran after them
        return Salvage(kept={r: kept[r][1] for r in sorted(kept)}, idle=len(idle), stopped_why=tuple(stopped_why))

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
        way (it stages during the next step and commits in the background). Probes the members' nodes
        while it waits, as every wait on workers does: a node that dies during the save fails it within
        seconds (WorkerFailure NODE_LOST), not after Ray's own detection."""
        steps = set(self._await_probing([m.actor.checkpoint.remote(blocking=blocking) for m in self.members],
                                        "checkpoint", timeout_s=600))
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
            return WorkerFailure(FailureKind.WORKER_DIED, f"a worker died during {what}: {str(e).splitlines()[0]}")
        if isinstance(e, GetTimeoutError):
            return WorkerFailure(FailureKind.TIMED_OUT, f"workers did not finish {what} within {timeout:.0f}s")
        cause = getattr(e, "cause", None)
        kind = FailureKind.CONFIG_REJECTED if isinstance(cause, ConfigError) else FailureKind.WORKER_RAISED
        msg = str(cause) if cause is not None else str(e).splitlines()[-1]
        return WorkerFailure(kind, f"a worker raised during {what}: {msg}")

    # -- starting, taking over and stopping actors ------------------------------------------------------
    def _launch(self, nodes: list[str]) -> list[WorkerHandle]:
        """Ask for one placement group and actor per node, without waiting for either: spares until a
        start makes them members."""
        out = []
        for nid in nodes:
            named = self._named()
            pg = self._take_vacant(nid) or self._slot(nid, **named)
            actor = self._actor(num_cpus=self.cpus, num_gpus=self.gpus or None,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0), **named)
            out.append(WorkerHandle(actor, nid, pg, Role.SPARE, ping=actor.info.remote()))
        return out

    def _slot(self, nid: str, *, node: dict | None = None, **named) -> PlacementGroup:
        """A placement group for one worker's resources, targeting node `nid` (softly; with `node`, its
        `ray.nodes()` row, pinned there by a sliver of its `node:IP` resource: `on_node`)."""
        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **on_node(node)}
        return placement_group([bundle], strategy="STRICT_PACK", _soft_target_node_id=nid, **named)

    def _take_vacant(self, nid: str) -> PlacementGroup | None:
        """A slot a stopped member left on node `nid` (`_vacant`), if there is one."""
        return self._vacant[nid].pop() if self._vacant.get(nid) else None

    def _release_vacant(self) -> None:
        """Remove the slots no start took: they hold resources the job is not using."""
        for pgs in self._vacant.values():
            for pg in pgs:
                _remove(pg)
        self._vacant.clear()

    def _named(self, kind: str = "") -> dict[str, str]:
        """Name and lifetime of a new actor or placement group: detached and named after the job when the
        group has an owner, so that they outlive its coordinator (`service.pool.detached`). `kind`: a name
        part after the job's prefix (`standby_kind`)."""
        if self.owner is None:
            return {}
        return {"name": f"{worker_prefix(self.job_id)}{kind}{uuid.uuid4().hex[:12]}", "lifetime": "detached"}

    def _actor(self, **options):
        """A new Worker actor with these Ray `options`."""
        from workers.actor import Worker

        cls = ray.remote(concurrency_groups={CONTROL: 1})(Worker)  # `abort` must run while `run` is stuck
        owned = self.owner is not None
        options.setdefault("runtime_env", {"env_vars": {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}})
        return cls.options(max_concurrency=1, **options, **({"namespace": self.namespace} if owned else {})).remote(
            self.cfg, self.run_dir, threads=max(1, int(self.cpus)),
            owner=(self.owner, self.namespace) if owned else None)

    # -- standbys ------------------------------------------------------------------------------------
    def keep_standby(self) -> int:
        """Keep `resources.standby_per_node` idle workers started on each node that hosts members (not
        on a node that only a growth's spare holds yet: the spare's start and warm-up, which the growth
        waits for, have the node to themselves; its standby follows once it is a member), CPU workers only (a GPU is given to a process when it starts), without
        waiting for them. A standby reserves nothing: it runs pinned to its node and holds a slot only
        once claimed as a member (`_take_standby`). Each call reads the standbys' last ping (`info`) and
        sends the next: those that died (or whose node did) are dropped, as are those on nodes that host
        no member any more. A new standby first warms up (`Worker.warm_up`). Returns how many were started."""
        per_node = self.cfg.resources.standby_per_node if not self.gpus else 0
        hosts = {w.node_id for w in self.members}
        standby = self.standby
        done, _ = ray.wait([w.ping for w in standby], num_returns=len(standby), timeout=0)
        gone = [w for w in standby if w.node_id not in hosts or (w.ping in done and not _idle(w.ping))]
        for w in gone:
            self._kill(w.actor)
        self.workers = [w for w in self.workers if all(w is not g for g in gone)]
        for w in self.standby:
            if w.ping in done:
                w.ping = w.actor.info.remote()
        have = Counter(w.node_id for w in self.standby)
        need = [nid for nid in sorted(hosts) for _ in range(per_node - have[nid])]
        for nid in need:
            actor = self._actor(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
                                **self._named(standby_kind(nid)))
            actor.warm_up.remote()  # paid while it waits; its ping (and a claim) answer after it
            self.workers.append(WorkerHandle(actor, nid, None, Role.STANDBY, ping=actor.info.remote()))
        return len(need)

    def _take_standby(self, nodes: list[str]) -> list[WorkerHandle]:
        """Standbys on `nodes` (one per entry at most), each claimed (`Worker.claim`) with the slot a
        stopped member left on its node (`_vacant`) or else a new placement group, to be awaited with this
        start like a fresh worker. A new group's bundle asks for a sliver of the node's `node:IP` resource
        too: where IPs are unique, a slot that is not free yet (the group of the worker it replaces still
        being removed) is waited for there, not taken on another node."""
        want, taken = Counter(nodes), []
        info: dict[str, dict] | None = None
        for w in self.standby:
            if want[w.node_id] > 0:
                want[w.node_id] -= 1
                if (pg := self._take_vacant(w.node_id)) is None:
                    info = info if info is not None else {n["NodeID"]: n for n in ray.nodes()}
                    pg = self._slot(w.node_id, node=info.get(w.node_id), **self._named())
                w.pg = pg
                w.ping = w.actor.claim.remote(w.pg)
                taken.append(w)
        self.workers = [w for w in self.workers if all(w is not t for t in taken)]
        return taken

    def adopt(self, *, timeout_s: float = 10.0) -> int:
        """Take over the detached workers a previous coordinator of this job left running (its process
        died; they did not): each that answers within `timeout_s` becomes a member, the others are
        stopped. Standbys stay standbys; one still starting is not waited for (its `info` waits for its
        start, ~2 s) but kept on the node its name gives, its answer read later as its ping
        (`keep_standby` replaces it then if it turns out claimed or dead; a claimed one answers as soon
        as the members do). Their process groups and trainers are as that coordinator left them.
        The placement groups of workers that died meanwhile are removed. Returns how many were taken
        over (0 for a group without an owner)."""
        if self.owner is None:
            return 0
        found = find_workers(self.job_id, self.namespace)
        refs = [a.info.options(concurrency_group=CONTROL).remote() for _, a in found]
        pinned = {r: standby_node(self.job_id, name) for (name, _), r in zip(found, refs)}
        standby = {r for r, node in pinned.items() if node is not None}
        ready = self._replies([r for r in refs if r not in standby], timeout_s=timeout_s, grace_s=timeout_s)
        ready |= set(ray.wait(list(standby), num_returns=len(standby), timeout=0.1)[0])
        for (_, actor), ref in zip(found, refs):
            info = None
            if ref in ready:
                try:
                    info = ray.get(ref)
                except RayError:
                    pass
            if ref in standby and ref not in ready:  # still starting: kept, its answer read as its ping
                self.workers.append(WorkerHandle(actor, pinned[ref], None, Role.STANDBY, ping=ref))
            elif info is None:
                self._kill(actor)
            elif info["pg"] is None:  # a standby, never claimed: it stays one
                self.workers.append(WorkerHandle(actor, info["node_id"], None, Role.STANDBY, ping=ref))
            else:
                self.workers.append(WorkerHandle(actor, info["node_id"], info["pg"], Role.MEMBER, ip=info["ip"]))
        self._unread += [r for r in refs if r not in ready and r not in standby]
        release_workers(self.job_id, keep={m.pg.id.hex() for m in self.members})
        self._set_members(self.members)  # members first
        return len(self.members)

    def carry_on(self, plan: Plan, *, timeout_s: float = 15.0, grace_s: float = 1.0) -> CarriedOn:
        """After `adopt`: ask every member where it stands (`Worker.standing`, answered once the call the
        lost coordinator sent has ended); if they are `plan`'s ranks, each sound, at one step, they
        are the group, in rank order. A member stuck in a collective (that coordinator died between
        sending a call to one member and to the next) does not answer: `grace_s` after the first
        answer, the group does not carry on, and the salvage that follows deals with it."""
        members = list(self.members)
        refs = [m.actor.standing.remote() for m in members]
        ready = self._replies(refs, timeout_s=timeout_s, grace_s=grace_s)
        self._unread += [r for r in refs if r not in ready]
        if len(ready) < len(refs):
            return CarriedOn(why=f"{len(refs) - len(ready)} of {len(refs)} workers did not answer")
        try:
            said = [ray.get(r) for r in refs]
        except RayError as e:
            return CarriedOn(why=f"a worker failed to answer: {type(e).__name__}")
        if unsound := [s.why for s in said if not s.sound]:
            return CarriedOn(why=f"{len(unsound)} worker(s) cannot carry on ({unsound[0]})")
        if sorted(s.rank for s in said) != list(range(plan.world_size)):
            return CarriedOn(why=f"ranks {sorted(s.rank for s in said)} are not the {plan.world_size} of {plan.layout}")
        theirs = {(p.layout, p.micro_batch_size, p.grad_accum_steps) for p in (Plan.from_dict(s.plan) for s in said)}
        if theirs != {(plan.layout, plan.micro_batch_size, plan.grad_accum_steps)}:
            return CarriedOn(why=f"they train another plan than {plan.layout}")
        if len(steps := {s.step for s in said}) != 1:
            return CarriedOn(why=f"they are at different steps {sorted(steps)}")
        by_rank = sorted(zip(said, members), key=lambda p: p[0].rank)
        self._set_members([m for _, m in by_rank])
        head = by_rank[0][0]
        return CarriedOn(step=head.step, committed_step=head.committed_step, rows=head.rows)

    def _start(self, launched: list[WorkerHandle], *, watch: list[str] = ()) -> list[WorkerHandle]:
        """`launched` (new actors, and spares and standbys taken for this start) as members once all have
        answered; `watch`: the nodes of the members kept beside them, probed with those being started on."""
        try:
            infos = self._await_starts(launched, watch=watch)
        except WorkerFailure as e:
            # none of them is a member yet: those that came up on a live node stay as spares for the next
            # start, and so do those still coming up when the failure is a node's death (a second fault
            # during a recovery's start then costs no process start); the rest are stopped, or their
            # slots stay held
            keep = []
            for w in launched:
                if (answer := _answer(w.ping)) is not None:
                    w.node_id = answer["node_id"]
                elif not (e.nodes and _sound(w.ping)):
                    continue
                if w.node_id not in e.nodes:
                    w.role = Role.SPARE
                    keep.append(w)
            self.workers += keep
            self._stop([w for w in launched if all(w is not k for k in keep)])
            raise
        for w, i in zip(launched, infos):
            w.node_id, w.ip, w.role, w.rejoins, w.ping = i["node_id"], i["ip"], Role.MEMBER, False, None
        return launched

    def _await_starts(self, launched: list[WorkerHandle], *, watch: list[str] = ()) -> list[dict]:
        """Each launched actor's `info`, in order; WorkerFailure as soon as one fails, when a placement
        group is not placed within `start_timeout_s` ("start"), or when the workers have not answered
        60 s after that ("timeout"). While some have not answered, probe the nodes (`probe_gaps`)
        they are starting on (each one's target, and where its placement group landed): WorkerFailure(NODE_LOST)
        when one does not answer, instead of waiting out Ray's own detection of a dead node (~15 s for
        an actor on it; for good for a placement group that cannot fit without it)."""
        from ray.util import placement_group_table

        pending = {w.ping: (w.node_id, w.pg) for w in launched}
        targets = {w.node_id for w in launched}
        infos = {}
        t0 = time.monotonic()
        place_by, deadline = t0 + self.start_timeout_s, t0 + self.start_timeout_s + 60
        gaps = probe_gaps(self.start_probe_s)
        next_probe = t0 + next(gaps)
        while pending:
            now = time.monotonic()
            wake = min(deadline, next_probe, place_by if now < place_by else deadline)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, wake - now))
            for ref in done:
                del pending[ref]
                infos[ref] = self._get([ref], "start", timeout=0)[0]  # a failed start raises here
            if not pending:
                break
            tables = {ref: placement_group_table(pg) for ref, (_, pg) in pending.items()}
            now = time.monotonic()
            if now >= place_by and (unplaced := [(nid, t.get("state")) for ref, (nid, _) in pending.items()
                                                 if (t := tables[ref]).get("state") != "CREATED"]):
                raise WorkerFailure(FailureKind.START_FAILED, f"could not place {len(unplaced)} of {len(launched)} worker(s) within "
                                             f"{self.start_timeout_s:.0f}s (" + ", ".join(
                                                 f"on {nid[:8]}: {state}" for nid, state in unplaced) + ")")
            if now >= deadline:
                raise WorkerFailure(FailureKind.TIMED_OUT, f"workers did not finish start within {deadline - t0:.0f}s")
            if now >= next_probe:
                # where the pending landed (an unplaced bundle's node is "") and where each was meant to
                # go: a placement group aimed at a dead node the GCS still lists lands elsewhere (the
                # target is soft), may even start there, and takes the slot another start waits for
                where = {x for ref in pending for x in (tables[ref].get("bundles_to_node_id") or {}).values() if x}
                self._probe_or_fail(sorted(where | targets | set(watch)), "while workers started")
                next_probe = time.monotonic() + next(gaps)
        return [infos[w.ping] for w in launched]

    def _probe_or_fail(self, nodes: list[str], during: str) -> None:
        """WorkerFailure(NODE_LOST) if one of `nodes` does not answer a probe: a call waiting on a worker
        there would otherwise wait out Ray's own detection of the dead node (~15 s or more), and a
        placement group there would wait for good."""
        if dead := set(nodes) - probe_nodes(nodes, timeout_s=self.probe_timeout_s):
            raise WorkerFailure(FailureKind.NODE_LOST, f"node(s) {', '.join(n[:8] for n in sorted(dead))} stopped answering "
                                        f"{during}", nodes=dead)

    def prewarm(self, nodes: list[str]) -> int:
        """Start actors on `nodes` in the background while the group keeps training (a growth is
        settling), each warming up (`Worker.warm_up`) once started, so the resize itself only moves state
        and re-forms the process group. Returns how many were started; nodes that already have a sound
        spare are skipped (one whose start failed is stopped and started again)."""
        self._stop([w for w in self.spares if not _sound(w.ping)])
        have = Counter(w.node_id for w in self._placed_spares())
        need = [nid for nid, k in (Counter(nodes) - have).items() for _ in range(k)]
        launched = self._launch(need)
        for w in launched:
            w.actor.warm_up.remote()
            w.ping = w.actor.info.remote()  # answers once the warm-up has run: `warm` reads it
        self.workers += launched
        return len(need)

    def warm(self, nodes: list[str]) -> bool:
        """Whether a spare has started and warmed up on each entry of `nodes` (its `info`, sent after its
        warm-up, has answered): a growth onto them then waits for no process."""
        want = Counter(nodes)
        for w in self._placed_spares():
            if want[w.node_id] > 0 and _answer(w.ping) is not None:
                want[w.node_id] -= 1
        return not +want

    def _take_spares(self, nodes: list[str]) -> list[WorkerHandle]:
        """Spares on `nodes`, taken out of the group to be awaited with this start (a spare that failed,
        or whose node died, fails the start like a fresh worker would)."""
        want, taken = Counter(nodes), []
        for w in self._placed_spares():
            if want[w.node_id] > 0:
                want[w.node_id] -= 1
                taken.append(w)
        self.workers = [w for w in self.workers if all(w is not t for t in taken)]
        return taken

    def _placed_spares(self) -> list[WorkerHandle]:
        """The spares, each with the node it really runs on: a spare's placement group targets its node
        softly, so where that node could not take it (full, or dead but still listed) it lands on another
        and holds that node's slot; counted on its target, it would be taken for neither node, and a start
        on the other would wait for good for the slot it holds. From its `info` answer, else from where
        its placement group landed."""
        from ray.util import placement_group_table

        for w in self.spares:
            if (answer := _answer(w.ping)) is not None:
                w.node_id = answer["node_id"]
            elif w.pg is not None and (landed := [n for n in (placement_group_table(w.pg).get("bundles_to_node_id")
                                                                 or {}).values() if n]):
                w.node_id = landed[0]
        return self.spares

    def _stop(self, handles: list[WorkerHandle]) -> None:
        """Kill these workers, release their placement groups and drop them from the group."""
        for w in handles:
            self._kill(w.actor)
            if w.pg is not None:
                _remove(w.pg)
        self.workers = [w for w in self.workers if all(w is not h for h in handles)]

    @staticmethod
    def _kill(actor) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone is fine
            logger.debug("kill of a worker failed", exc_info=True)


def _remove(pg: PlacementGroup) -> None:
    try:
        remove_placement_group(pg)
    except Exception:
        logger.debug("placement group removal failed", exc_info=True)


def _answer(ping) -> dict | None:
    """What the `info` (or `claim`) call `ping` answered; None while it runs, or if it failed."""
    try:
        return ray.get(ping, timeout=0)
    except RayError:  # GetTimeoutError too
        return None


def _sound(ping) -> bool:
    """Whether the call `ping` has not failed (finished well, or still running)."""
    done, _ = ray.wait([ping], timeout=0)
    return not done or _answer(ping) is not None


def _idle(ping) -> bool:
    """Whether the finished `info` call `ping` says its worker is a standby still: alive, holding no
    placement group."""
    answer = _answer(ping)
    return answer is not None and answer["pg"] is None
