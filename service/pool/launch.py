"""Starting and stopping a group's worker actors.

`launch` asks for one slot and one actor per node without waiting; `start` waits until the launched
workers (and the spares and standbys a start takes) have answered their `info`, probing the nodes they
are starting on, and makes them members; `stop` kills workers and removes their slots. A group with an
owner starts its workers detached and named (`Slots.named`), so they outlive its coordinator's process.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.pool.calls import Calls
from service.pool.group import FailureKind, WorkerFailure
from service.pool.roster import Role, Roster, WorkerHandle
from service.pool.slots import Slots, remove_slot
from workers.config import JobConfig
from workers.report import WorkerInfo

__all__ = ["CONTROL", "WORKER_ENV", "Launcher"]

logger = logging.getLogger(__name__)

CONTROL = "control"
"""A worker actor's second lane (concurrency group): `abort` runs there while the default lane is busy."""

WORKER_ENV = {"MALLOC_ARENA_MAX": "2"}
"""Environment a worker process starts with (Ray `runtime_env`; a value set in the coordinator's own
environment wins). glibc gives each thread that allocates an arena of its own, up to 8 per core, and
keeps the memory a step frees in the arena that held it; a Ray actor runs its calls on threads that
change over its life, so over tens of reconfigurations the step's transient peak came to be kept in many
arenas at once: +150 to +250 MB of free heap in a survivor (benchmarks/soak.py, `small`). Two arenas
bound that; no step-time cost measured (benchmarks/throughput.py, CPU seconds per step)."""


class Launcher:
    """Starts and stops the workers of one group (`roster`), in slots from `slots`. `start_timeout_s`: how
    long a start waits for its placement groups to be placed (then 60 s more for the workers to answer)."""

    def __init__(self, cfg: JobConfig, run_dir: str, *, roster: Roster, slots: Slots, calls: Calls,
                 start_timeout_s: float, namespace: str):
        self.cfg, self.run_dir = cfg, run_dir
        self.roster, self.slots, self.calls = roster, slots, calls
        self.start_timeout_s, self.namespace = start_timeout_s, namespace

    def actor(self, **options) -> Any:
        """A new Worker actor with these Ray `options`."""
        from workers.actor import Worker

        cls = ray.remote(concurrency_groups={CONTROL: 1})(Worker)  # `abort` must run while `run` is stuck
        owned = self.slots.owner is not None
        options.setdefault("runtime_env", {"env_vars": {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()}})
        return cls.options(max_concurrency=1, **options, **({"namespace": self.namespace} if owned else {})).remote(
            self.cfg, self.run_dir, threads=max(1, int(self.slots.cpus)),
            owner=(self.slots.owner, self.namespace) if owned else None)

    def launch(self, nodes: list[str]) -> list[WorkerHandle]:
        """Ask for one placement group and actor per node, without waiting for either: spares until a
        start makes them members."""
        out = []
        for nid in nodes:
            named = self.slots.named()
            pg = self.slots.take_vacant(nid) or self.slots.new(nid, **named)
            actor = self.actor(num_cpus=self.slots.cpus, num_gpus=self.slots.gpus or None,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0), **named)
            out.append(WorkerHandle(actor, nid, pg, Role.SPARE, ping=actor.info.remote()))
        return out

    def start(self, launched: list[WorkerHandle], *, watch: list[str] = ()) -> list[WorkerHandle]:
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
                if (answer := w.answer()) is not None:
                    w.node_id = answer.node_id
                elif not (e.nodes and w.sound()):
                    continue
                if w.node_id not in e.nodes:
                    w.role = Role.SPARE
                    keep.append(w)
            self.roster.add(keep)
            self.stop([w for w in launched if all(w is not k for k in keep)])
            raise
        for w, i in zip(launched, infos):
            w.node_id, w.ip, w.role, w.rejoins, w.ping = i.node_id, i.ip, Role.MEMBER, False, None
        return launched

    def _await_starts(self, launched: list[WorkerHandle], *, watch: list[str] = ()) -> list[WorkerInfo]:
        """Each launched actor's `info`, in order; WorkerFailure as soon as one fails, when a placement
        group is not placed within `start_timeout_s` ("start"), or when the workers have not answered
        60 s after that ("timeout"). While some have not answered, probe the nodes (`probe_gaps`)
        they are starting on (each one's target, and where its placement group landed): WorkerFailure(NODE_LOST)
        when one does not answer, instead of waiting out Ray's own detection of a dead node (~15 s for
        an actor on it; for good for a placement group that cannot fit without it). The placement groups'
        tables (a GCS call each) are read only when a check is due, not each time a start answers: N starts
        answering one by one read N tables each before, N²/2 in all."""
        from ray.util import placement_group_table

        pending = {w.ping: (w.node_id, w.pg) for w in launched}
        targets = {w.node_id for w in launched}
        infos = {}
        t0 = time.monotonic()
        place_by, deadline = t0 + self.start_timeout_s, t0 + self.start_timeout_s + 60
        gaps = self.calls.gaps()
        next_probe = t0 + next(gaps)
        placed = False
        while pending:
            now = time.monotonic()
            wake = min(deadline, next_probe, place_by if now < place_by else deadline)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, wake - now))
            for ref in done:
                del pending[ref]
                infos[ref] = self.calls.get([ref], "start", timeout=0)[0]  # a failed start raises here
            if not pending:
                break
            now = time.monotonic()
            check_placed = now >= place_by and not placed
            if not (check_placed or now >= next_probe or now >= deadline):
                continue  # a start answered: nothing else is due (the tables are read only when it is)
            tables = {ref: placement_group_table(pg) for ref, (_, pg) in pending.items()}
            if check_placed and (unplaced := [(nid, t.get("state")) for ref, (nid, _) in pending.items()
                                              if (t := tables[ref]).get("state") != "CREATED"]):
                raise WorkerFailure(FailureKind.START_FAILED, f"could not place {len(unplaced)} of {len(launched)} worker(s) within "
                                             f"{self.start_timeout_s:.0f}s (" + ", ".join(
                                                 f"on {nid[:8]}: {state}" for nid, state in unplaced) + ")")
            placed = placed or check_placed  # every pending group was placed: no need to look again
            if now >= deadline:
                raise WorkerFailure(FailureKind.TIMED_OUT, f"workers did not finish start within {deadline - t0:.0f}s")
            if now >= next_probe:
                # where the pending landed (an unplaced bundle's node is "") and where each was meant to
                # go: a placement group aimed at a dead node the GCS still lists lands elsewhere (the
                # target is soft), may even start there, and takes the slot another start waits for
                where = {x for ref in pending for x in (tables[ref].get("bundles_to_node_id") or {}).values() if x}
                self.calls.probe_or_fail(sorted(where | targets | set(watch)), "while workers started")
                next_probe = time.monotonic() + next(gaps)
        return [infos[w.ping] for w in launched]

    def stop(self, handles: list[WorkerHandle]) -> None:
        """Kill these workers, release their placement groups and drop them from the group."""
        for w in handles:
            self.kill(w.actor)
            if w.pg is not None:
                remove_slot(w.pg)
        self.roster.drop(handles)

    @staticmethod
    def kill(actor) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone is fine
            logger.debug("kill of a worker failed", exc_info=True)
