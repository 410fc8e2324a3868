"""Fakes shared by the tests, in one place: a cluster, a worker group and a coordinator over them (no Ray,
no torch ranks), the coordinator's parts over them without a coordinator (`make_parts`), and a gate
that holds fake training at a step.

The fake group models what matters for the coordinator: a step counter, checkpoints committed every
`interval` steps or on request, and resumption from the last committed step when a group is formed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from dataclasses import dataclass, replace

from parallel.layout import Layout
from parallel.planner import Plan, plan
from service.control.coordinator import Coordinator, CoordinatorOptions
from service.control.events import Event
from service.control.job import Job
from service.control.progress import Progress
from service.control.reconfigure import Reconfigure
from service.control.recovery import Recovery
from service.control.journal import Journal
from service.control.recovery import Ledger
from service.control.state import JobState
from service.control.takeover import Takeover
from service.pool.cluster import ClusterWatcher
from service.pool.group import CarriedOn, FailureKind, Formed, Moved, Salvage, Started, WorkerFailure
from service.pool.node_health import NodeHealth
from service.pool.placement import assign_nodes
from workers.config import JobConfig, job_constraints
from workers.report import Salvaged, StepMetrics, Trained



def metrics_row(step: int, **fields) -> StepMetrics:
    """The row of a fake step: loss 10/step, time = step, the fields given, zeros for the others."""
    return StepMetrics(**{"step": step, "loss": 10.0 / step, "lr": 0.0, "grad_norm": 0.0, "tokens": 0, "layout": Layout(),
                          "world_size": 1, "time": float(step), "step_time": 0.0, "tokens_per_s": 0.0, **fields})

class FakeCluster:
    def __init__(self, nodes: dict[str, int]):
        self.nodes = dict(nodes)  # node id -> CPUs
        self.dead: set[str] = set()
        self.draining: dict[str, int] = {}

    def rows(self) -> list[dict]:
        return [{"NodeID": n, "Alive": n not in self.dead, "Resources": {"CPU": float(c)}}
                for n, c in self.nodes.items()]

    def watcher(self) -> ClusterWatcher:
        return ClusterWatcher(nodes_fn=self.rows, draining_fn=lambda: dict(self.draining))


class Disk:
    """What survives a group: the committed checkpoint step."""

    def __init__(self, interval: int):
        self.interval = interval
        self.committed = 0


class FakeGroup:
    disk: Disk
    cluster: FakeCluster
    fail_next: list[FailureKind | str] = []
    """Kinds the next calls fail with, in order ("transfer": the next reshard fails)."""
    heals = False
    """Whether survivors of a failure keep their state (a salvage), as real workers do."""
    snapshots: dict[int, dict[int, tuple[int, ...]]] | None = None
    """{old rank: the peer snapshots it holds} that each surviving member reports in a salvage (its live
    state then vouched for only when `heals`); None: snapshots off. `resharded` records each reshard's
    keyword arguments."""
    intact = True
    """Whether members taken over after a coordinator restart still train as its plan's group, as real
    workers do unless a call to them failed or stuck (`carry_on`)."""

    def __init__(self, cfg=None, run_dir=None, **kw):
        self.cfg = cfg
        self._standby = 0
        self.members: list[str] = []
        self.step = 0
        self.plan = None

    @property
    def size(self) -> int:
        return len(self.members)

    def nodes(self) -> Counter:
        return Counter(self.members)

    def scale_to(self, nodes):
        keep = Counter(self.members) & Counter(nodes)
        started = sum((Counter(nodes) - keep).values())
        stopped = sum((Counter(self.members) - keep).values())
        self.members = list(nodes)
        return Started(started=started, stopped=stopped)

    def prewarm(self, nodes):
        return 0

    def warm(self, nodes):
        return True

    def keep_standby(self, free=None, cap=None):
        """Standbys as `standby_targets` places them (no process: a count)."""
        from service.pool.reserve import standby_targets

        per_node = self.cfg.resources.standby_per_node if self.cfg is not None else 0
        want = sum(standby_targets(per_node, Counter(self.members), free or {}, cap=cap).values())
        started, self._standby = max(0, want - self._standby), want
        return started

    def standbys(self) -> int:
        return self._standby

    def stop_members(self, *, dead=()):
        self.members = []

    def form(self, plan, *, adopt=False):
        self.plan = plan
        if not adopt:
            self.step = self.disk.committed
        return Formed(step=self.step)

    def adopt(self):
        return 0

    def carry_on(self, plan):
        """The members train on as they are when `intact`, running `plan`, none on a dead node."""
        if not self.intact or self.plan != plan or any(m in self.cluster.dead for m in self.members):
            return CarriedOn(why="they are not the plan's group")
        return CarriedOn(step=self.step, committed_step=self.disk.committed)

    def salvage(self, *, fate=None, gone=(), dead=tuple, timeout_s=15.0, abort=True):
        """Survivors (members off dead nodes) vouch for their state at the current step when `heals`.
        Records the nodes it was told are gone (`salvaged_gone`)."""
        self.salvaged_gone = set(gone)
        if self.snapshots is not None:
            kept = {r: m for r, m in enumerate(self.members) if m not in self.cluster.dead}
            why = ("its node is dead",) * (len(self.members) - len(kept))
            self.members = list(kept.values())
            return Salvage(kept={r: Salvaged(held=self.heals, step=self.step if self.heals else None, old_rank=r,
                                             reusable=not self.heals, snapshots=self.snapshots.get(r, {}))
                                 for r in kept if self.heals or self.snapshots.get(r)}, stopped_why=why)
        if not self.heals:
            why = ("it did not answer",) * len(self.members)
            self.members = []
            return Salvage(stopped_why=why)
        kept = {r: m for r, m in enumerate(self.members) if m not in self.cluster.dead}
        why = ("its node is dead",) * (len(self.members) - len(kept))
        self.members = list(kept.values())
        return Salvage(kept={r: Salvaged(held=True, step=self.step, old_rank=r) for r in kept}, stopped_why=why)

    def reshard(self, old, new, nodes, *, survivors=None, serve=None, snapshot_step=None):
        """A live transfer: the step carries over (from peer snapshots: their step), no checkpoint is read
        (or written)."""
        self.resharded.append({"survivors": survivors, "serve": serve, "snapshot_step": snapshot_step})
        if self.fail_next and self.fail_next[0] == "transfer":
            self.fail_next.pop(0)
            raise WorkerFailure(FailureKind.WORKER_DIED, "a worker died during state transfer")
        if snapshot_step is not None:
            self.step = snapshot_step
        start = self.scale_to(nodes)
        formed = self.form(new, adopt=True)
        return Moved(step=formed.step, started=start.started, stopped=start.stopped, bytes_moved=1 << 20)

    def run(self, *, until_step, steps, should_abort=lambda: False):
        if self.fail_next:
            raise WorkerFailure(self.fail_next.pop(0), "worker raised: boom")
        if should_abort() or any(m in self.cluster.dead for m in self.members):
            raise WorkerFailure(FailureKind.WORKER_DIED, "a worker died")
        self.step += 1
        if self.step % self.disk.interval == 0:
            self.disk.committed = self.step
        ws = self.plan.world_size and len(self.members)
        return Trained(rows=(metrics_row(self.step, world_size=ws),), committed_step=self.disk.committed)

    def checkpoint(self, *, blocking=True):
        self.disk.committed = self.step  # a background save commits before the next fake step
        return self.step

    def leave(self):
        pass

    def shutdown(self):
        self.members = []


def tiny_job(*, steps=20, interval=5, min_workers=1, max_workers=4, parallel: dict | None = None,
             resources: dict | None = None, checkpoint: dict | None = None) -> JobConfig:
    """A tiny job's config; `parallel` and `checkpoint` add to those sections, `resources` is its own."""
    return JobConfig.from_dict({
        "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2},
        "parallel": {"min_workers": min_workers, "max_workers": max_workers, **(parallel or {})},
        "checkpoint": {"interval_steps": interval, **(checkpoint or {})},
        **({"resources": resources} if resources else {}),
    })


def fake_group_cls(cluster: FakeCluster, interval: int) -> type[FakeGroup]:
    """A FakeGroup class of its own (its disk, its failures to come) on `cluster`."""
    return type("G", (FakeGroup,), {"disk": Disk(interval), "cluster": cluster, "fail_next": [], "resharded": []})


def make_coordinator(tmp_path, nodes, *, steps=20, interval=5, min_workers=1, max_workers=4, settle=0.0,
                     parallel: dict | None = None, resources: dict | None = None, **opts):
    """A coordinator of a tiny job on a FakeCluster of `nodes` (id -> CPUs), with a FakeGroup class of
    its own; `parallel` adds to the job's parallel section, `resources` is its resources section, `opts`
    go to CoordinatorOptions."""
    cluster = FakeCluster(nodes)
    cfg = tiny_job(steps=steps, interval=interval, min_workers=min_workers, max_workers=max_workers,
                   parallel=parallel, resources=resources)
    group_cls = fake_group_cls(cluster, interval)
    c = Coordinator(Job.of(cfg, job_id="job1", run_dir=tmp_path), watcher=cluster.watcher(),
                    options=CoordinatorOptions(settle_seconds=settle, max_restarts=2, **opts))
    c.worker_group_cls = group_cls
    # The fake cluster's "dead" nodes are exactly those a placement probe would not reach.
    c.group_probe = lambda nodes, timeout_s: {n for n in nodes if n not in cluster.dead}
    return c, cluster, group_cls


@dataclass(kw_only=True)
class Parts:
    """The coordinator's three parts, built without a coordinator (make_parts), over what a coordinator
    would give them: a journal, the progress, node health, the watcher and the failure ledger."""

    recovery: Recovery
    reconfigure: Reconfigure
    takeover: Takeover
    progress: Progress
    watcher: ClusterWatcher
    cluster: FakeCluster
    group_cls: type[FakeGroup]
    events: list[Event]
    """Every event the parts emitted, oldest first."""

    def holding(self, workers: int, nodes: list[str], *, step: int) -> tuple[FakeGroup, Plan]:
        """A group formed for the plan of `workers` on `nodes`, trained to `step` (the job's step too):
        (the group, its plan)."""
        p = self.reconfigure.plan_for(workers)
        g = self.reconfigure.new_group()
        g.members, g.plan, g.step = list(nodes), p, step
        self.progress.step_done = step
        return g, p

    @property
    def failures(self):
        return self.recovery.ledger.failures

    def notes(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


def make_parts(tmp_path, nodes, *, interval=5, parallel: dict | None = None, checkpoint: dict | None = None,
               **opts) -> Parts:
    """Recovery, Reconfigure and Takeover of a tiny job on a FakeCluster of `nodes` (id -> CPUs) with a
    FakeGroup class of its own, wired as the coordinator wires them; `opts` go to CoordinatorOptions.
    Plans come from the planner, nodes from `assign_nodes` over the alive nodes' CPUs. Events are
    stamped with the state RUNNING (no coordinator holds a state)."""
    cluster = FakeCluster(nodes)
    cfg = tiny_job(interval=interval, parallel=parallel, checkpoint=checkpoint)
    group_cls = fake_group_cls(cluster, interval)
    events: list[Event] = []
    o = CoordinatorOptions(settle_seconds=0.0, max_restarts=2, **opts)
    health = NodeHealth(lambda nodes, timeout_s: {n for n in nodes if n not in cluster.dead},
                        probe_timeout_s=o.probe_timeout_s, suspect_seconds=o.suspect_seconds,
                        reprobe_interval_s=o.reprobe_interval_s)
    watcher = cluster.watcher()
    watcher.poll()
    journal = Journal("job1", current=lambda: JobState.RUNNING, sink=events.append)
    progress = Progress()
    model, constraints = cfg.model.build(), job_constraints(cfg)

    def new_group():
        return group_cls(cfg, str(tmp_path))

    def plan_for(workers: int) -> Plan:
        return plan(workers, model, replace(constraints, min_workers=1, max_workers=workers))

    def assign(p: Plan, snap, prefer=None) -> list[str]:
        return assign_nodes(p.world_size, {n.node_id: int(n.cpus) for n in snap.alive()}, tp=p.layout.tp)

    recovery = Recovery(cfg=cfg, journal=journal, progress=progress, health=health, watcher=watcher,
                        ledger=Ledger(o.restart_window_s))
    reconfigure = Reconfigure(cfg=cfg, journal=journal, progress=progress, watcher=watcher, recovery=recovery,
                              new_group=new_group, plan_for=plan_for, assign=assign)
    takeover = Takeover(journal=journal, progress=progress, health=health, recovery=recovery,
                        reconfigure=reconfigure, new_group=new_group, run_dir=tmp_path, detached=o.owner is not None)
    return Parts(recovery=recovery, reconfigure=reconfigure, takeover=takeover, progress=progress, watcher=watcher,
                 cluster=cluster, group_cls=group_cls, events=events)


def advance(c: Coordinator, until, limit=500):
    """Step `c` (reading the fake cluster first) until `until(c)` holds; fail after `limit` steps."""
    for _ in range(limit):
        c.watcher.poll()
        if until(c):
            return
        c.step()
    raise AssertionError(f"condition not reached; state {c.state.name}, step {c.step_done}")


class Gate:
    """How far fake training may go: `allow(n)` lets the group reach step n; None means no limit."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.cond = threading.Condition()

    def allow(self, n: int | None) -> None:
        with self.cond:
            self.limit = n
            self.cond.notify_all()

    def wait_for(self, step: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.limit is None or step <= self.limit, timeout)


class GatedGroup(FakeGroup):
    """FakeGroup whose next step waits for the gate (up to 0.05 s) and takes step_s seconds. Its rows
    carry tokens/s and, unless mfu_per_step is None (a CPU: no known peak), an MFU of mfu_per_step * step."""

    gate: Gate | None = None
    step_s: float = 0.0
    mfu_per_step: float | None = 0.001

    def run(self, *, until_step, should_abort=lambda: False, **kw):
        # A closed gate returns no rows after a short wait, as a real group does when its chunk ends.
        if self.gate is not None and not self.gate.wait_for(self.step + 1, 0.05):
            return Trained()
        if self.step_s:
            time.sleep(self.step_s)  # simulated training time, so a browser can watch the chart grow
        trained = super().run(until_step=until_step, should_abort=should_abort, **kw)
        rows = tuple(replace(r, tokens_per_s=1000.0 + 10 * r.step,
                             val_loss=20.0 / r.step if r.step % 2 == 0 else None,  # as train.eval_interval: 2 would
                             mfu=None if self.mfu_per_step is None else self.mfu_per_step * r.step)
                     for r in trained.rows)
        return replace(trained, rows=rows)


class PollingCoordinator(Coordinator):
    """Reads the fake cluster at every iteration (the real one has a watcher thread for that)."""

    def step(self):
        self.watcher.poll()
        return super().step()
