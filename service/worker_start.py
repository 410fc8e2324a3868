"""Starting, taking over and stopping a worker group's actors: part of `service.worker_group.WorkerGroup`
(a mixin: `self` is the group), kept apart so that file is membership and the collective calls.

A start asks for one placement group and actor per node and waits for both in one loop, probing the
nodes they are starting on (`_await_starts`): a node that dies meanwhile fails the start within
seconds, not after Ray's own detection. Workers started ahead of a growth are spares (`prewarm`).
Idle workers kept started beside the members, reserving nothing, are standbys (`keep_standby`): a
member that crashed is replaced by one on its node, claimed with a placement group for its slot,
without a process start (~2.5 s on CPU, mostly importing torch). A group with an `owner` starts
detached actors in detached placement groups, named after the job (`service.detached`), which a
restarted coordinator takes over (`adopt`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from service.detached import STANDBY, find_workers, release_workers, worker_prefix
from service.group_types import WorkerFailure
from service.placement import on_node, probe_nodes

if TYPE_CHECKING:
    from service.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

CONTROL = "control"
"""A worker actor's second lane (concurrency group): `abort` runs there while the default lane is busy."""


@dataclass
class Member:
    actor: Any
    pg: PlacementGroup
    node_id: str
    ip: str


FIRST_PROBE_S = 0.5
"""A wait on workers probes their nodes first after this long: soon enough to catch a node that died
just before the call (a second fault right after a first), late enough that a quick call (a live
resize's form, ~0.1 s) never pays for a probe."""


def probe_gaps(cap_s: float) -> Iterator[float]:
    """Seconds before each probe of a wait on workers: FIRST_PROBE_S, then 1 s, doubling up to `cap_s`.
    The probes come close together early, when a second fault is most likely (the chaos run's double:
    a node removed 0.3 s after a worker kill, which a probe just before it misses; every 3 s from the
    start, the next probe came 3 s later), and every `cap_s` through a long wait (a checkpoint load of
    minutes), so that a large group does not flood the GCS with probe placement groups."""
    yield min(FIRST_PROBE_S, cap_s)
    gap = 1.0
    while True:
        yield min(gap, cap_s)
        gap *= 2


class WorkerStarts:
    """Methods of WorkerGroup (a mixin)."""

    def _launch(self: WorkerGroup, nodes: list[str]) -> list[tuple[str, Any, PlacementGroup, Any]]:
        """Ask for one placement group and actor per node, without waiting for either."""
        out = []
        for nid in nodes:
            named = self._named()
            pg = self._slot(nid, **named)
            actor = self._actor(num_cpus=self.cpus, num_gpus=self.gpus or None,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0), **named)
            out.append((nid, actor, pg, actor.info.remote()))
        return out

    def _slot(self: WorkerGroup, nid: str, *, node: dict | None = None, **named) -> PlacementGroup:
        """A placement group for one worker's resources, targeting node `nid` (softly; with `node`, its
        `ray.nodes()` row, pinned there by a sliver of its `node:IP` resource: `on_node`)."""
        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **on_node(node)}
        return placement_group([bundle], strategy="STRICT_PACK", _soft_target_node_id=nid, **named)

    def _named(self: WorkerGroup, kind: str = "") -> dict[str, str]:
        """Name and lifetime of a new actor or placement group: detached and named after the job when the
        group has an owner, so that they outlive its coordinator (`service.detached`). `kind`: a name
        part after the job's prefix (`STANDBY`)."""
        if self.owner is None:
            return {}
        return {"name": f"{worker_prefix(self.job_id)}{kind}{uuid.uuid4().hex[:12]}", "lifetime": "detached"}

    def _actor(self: WorkerGroup, **options):
        """A new Worker actor with these Ray `options`."""
        from workers.actor import Worker

        cls = ray.remote(concurrency_groups={CONTROL: 1})(Worker)  # `abort` must run while `run` is stuck
        owned = self.owner is not None
        return cls.options(max_concurrency=1, **options, **({"namespace": self.namespace} if owned else {})).remote(
            self.cfg, self.run_dir, threads=max(1, int(self.cpus)),
            owner=(self.owner, self.namespace) if owned else None)

    # -- standbys ------------------------------------------------------------------------------------
    def keep_standby(self: WorkerGroup) -> int:
        """Keep `resources.standby_per_node` idle workers started on each node that hosts members (CPU
        workers only: a GPU is given to a process when it starts), without waiting for them. A standby
        reserves nothing: it runs pinned to its node and holds a slot only once claimed as a member
        (`_take_standby`). Each call reads the standbys' last ping (`info`) and sends the next: those
        that died (or whose node did) are dropped, as are those on nodes that host no member any more.
        Returns how many were started."""
        per_node = self.cfg.resources.standby_per_node if not self.gpus else 0
        hosts = {m.node_id for m in self.members}
        done, _ = ray.wait([ref for *_, ref in self.standby], num_returns=len(self.standby), timeout=0)
        keep = []
        for nid, actor, ping in self.standby:
            if nid not in hosts or (ping in done and not _idle(ping)):
                self._kill(actor)
            else:
                keep.append((nid, actor, actor.info.remote() if ping in done else ping))
        have = Counter(nid for nid, *_ in keep)
        need = [nid for nid in sorted(hosts) for _ in range(per_node - have[nid])]
        self.standby = keep
        for nid in need:
            actor = self._actor(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
                                **self._named(STANDBY))
            self.standby.append((nid, actor, actor.info.remote()))
        return len(need)

    def _take_standby(self: WorkerGroup, nodes: list[str]) -> list[tuple[str, Any, PlacementGroup, Any]]:
        """Standbys on `nodes` (one per entry at most), each claimed with a new placement group for its
        slot on its node (`Worker.claim`), to be awaited with this start like a fresh worker. The bundle
        asks for a sliver of the node's `node:IP` resource too: where IPs are unique, a slot that is not
        free yet (the group of the worker it replaces still being removed) is waited for there, not
        taken on another node."""
        want, taken, keep = Counter(nodes), [], []
        info = {n["NodeID"]: n for n in ray.nodes()} if any(want[nid] for nid, *_ in self.standby) else {}
        for nid, actor, ref in self.standby:
            if want[nid] > 0:
                want[nid] -= 1
                pg = self._slot(nid, node=info.get(nid), **self._named())
                taken.append((nid, actor, pg, actor.claim.remote(pg)))
            else:
                keep.append((nid, actor, ref))
        self.standby = keep
        return taken

    def adopt(self: WorkerGroup, *, timeout_s: float = 10.0) -> int:
        """Take over the detached workers a previous coordinator of this job left running (its process
        died; they did not): each that answers within `timeout_s` becomes a member, the others are
        stopped. Standbys stay standbys; one still starting is not waited for (its `info` waits for its
        start, ~2 s) but stopped (a claimed one answers as soon as the members do). Their process groups
        and trainers are as that coordinator left them: `salvage` next.
        The placement groups of workers that died meanwhile are removed. Returns how many were taken
        over (0 for a group without an owner)."""
        if self.owner is None:
            return 0
        found = find_workers(self.job_id, self.namespace)
        refs = [a.info.options(concurrency_group=CONTROL).remote() for _, a in found]
        standby = {r for (name, _), r in zip(found, refs) if name.startswith(worker_prefix(self.job_id) + STANDBY)}
        ready = self._replies([r for r in refs if r not in standby], timeout_s=timeout_s, grace_s=timeout_s)
        ready |= set(ray.wait(list(standby), num_returns=len(standby), timeout=0.1)[0])
        for (_, actor), ref in zip(found, refs):
            info = None
            if ref in ready:
                try:
                    info = ray.get(ref)
                except RayError:
                    pass
            if info is None:
                self._kill(actor)
            elif info["pg"] is None:  # a standby, never claimed: it stays one
                self.standby.append((info["node_id"], actor, ref))
            else:
                self.members.append(Member(actor, info["pg"], info["node_id"], info["ip"]))
        self._unread += [r for r in refs if r not in ready]
        release_workers(self.job_id, keep={m.pg.id.hex() for m in self.members})
        return len(self.members)

    def _start(self: WorkerGroup, launched: list, *, watch: list[str] = ()) -> list[Member]:
        """Members of `launched` (new actors, and spares taken for this start) once all have answered;
        `watch`: the nodes of the members kept beside them, probed with those being started on."""
        try:
            infos = self._await_starts(launched, watch=watch)
        except WorkerFailure:  # none of them is a member yet: release all, or their CPUs stay held
            self._stop([Member(a, pg, nid, "") for nid, a, pg, _ in launched])
            raise
        return [Member(a, pg, i["node_id"], i["ip"]) for (_, a, pg, _), i in zip(launched, infos)]

    def _await_starts(self: WorkerGroup, launched: list, *, watch: list[str] = ()) -> list[dict]:
        """Each launched actor's `info`, in order; WorkerFailure as soon as one fails, when a placement
        group is not placed within `start_timeout_s` ("start"), or when the workers have not answered
        60 s after that ("timeout"). While some have not answered, probe the nodes (`probe_gaps`)
        they are starting on (each one's target, and where its placement group landed): WorkerFailure("node")
        when one does not answer, instead of waiting out Ray's own detection of a dead node (~15 s for
        an actor on it; for good for a placement group that cannot fit without it)."""
        from ray.util import placement_group_table

        pending = {ref: (nid, pg) for nid, _, pg, ref in launched}
        targets = {nid for nid, *_ in launched}
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
                raise WorkerFailure("start", f"could not place {len(unplaced)} of {len(launched)} worker(s) within "
                                             f"{self.start_timeout_s:.0f}s (" + ", ".join(
                                                 f"on {nid[:8]}: {state}" for nid, state in unplaced) + ")")
            if now >= deadline:
                raise WorkerFailure("timeout", f"workers did not finish start within {deadline - t0:.0f}s")
            if now >= next_probe:
                # where the pending landed (an unplaced bundle's node is "") and where each was meant to
                # go: a placement group aimed at a dead node the GCS still lists lands elsewhere (the
                # target is soft), may even start there, and takes the slot another start waits for
                where = {x for ref in pending for x in (tables[ref].get("bundles_to_node_id") or {}).values() if x}
                self._probe_or_fail(sorted(where | targets | set(watch)), "while workers started")
                next_probe = time.monotonic() + next(gaps)
        return [infos[ref] for *_, ref in launched]

    def _probe_or_fail(self: WorkerGroup, nodes: list[str], during: str) -> None:
        """WorkerFailure("node") if one of `nodes` does not answer a probe: a call waiting on a worker
        there would otherwise wait out Ray's own detection of the dead node (~15 s or more), and a
        placement group there would wait for good."""
        if dead := set(nodes) - probe_nodes(nodes, timeout_s=self.probe_timeout_s):
            raise WorkerFailure("node", f"node(s) {', '.join(n[:8] for n in sorted(dead))} stopped answering "
                                        f"{during}", nodes=dead)

    def prewarm(self: WorkerGroup, nodes: list[str]) -> int:
        """Start actors on `nodes` in the background while the group keeps training (a growth is
        settling), so the resize itself only re-forms the process group. Returns how many were started;
        nodes that already have a spare are skipped."""
        have = Counter(nid for nid, *_ in self.spares)
        need = [nid for nid, k in (Counter(nodes) - have).items() for _ in range(k)]
        self.spares += self._launch(need)
        return len(need)

    def _take_spares(self: WorkerGroup, nodes: list[str]) -> list:
        """Spares pre-started on `nodes`, taken out of `spares` to be awaited with this start (a spare
        that failed, or whose node died, fails the start like a fresh worker would)."""
        want, taken, keep = Counter(nodes), [], []
        for spare in self.spares:
            if want[spare[0]] > 0:
                want[spare[0]] -= 1
                taken.append(spare)
            else:
                keep.append(spare)
        self.spares = keep
        return taken

    def _stop(self: WorkerGroup, members: list[Member]) -> None:
        for m in members:
            self._kill(m.actor)
            try:
                if m.pg is not None:
                    remove_placement_group(m.pg)
            except Exception:
                logger.debug("placement group removal failed", exc_info=True)

    def _stop_standby(self: WorkerGroup) -> None:
        for _, actor, _ in self.standby:
            self._kill(actor)
        self.standby = []

    @staticmethod
    def _kill(actor) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone is fine
            logger.debug("kill of a worker failed", exc_info=True)


def _idle(ping) -> bool:
    """Whether the finished `info` call `ping` says its worker is a standby still: alive, holding no
    placement group."""
    try:
        return ray.get(ping, timeout=0)["pg"] is None
    except RayError:
        return False
