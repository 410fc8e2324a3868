"""One job's coordinator: keeps training running while the cluster under it changes.

Driven by `step()` (one iteration: read the cluster, decide, act, or train one short chunk), so tests
and the demo can advance it deterministically; `run()` loops until a terminal state. Methods for the
outside (`status`, `events`, `metrics`, `resize`, `pause`, `resume`, `stop`) are thread-safe: commands
are queued and applied at the start of the next iteration.

Flows:
  planned resize / grow   finish the chunk, synchronous checkpoint, plan, re-form survivors, resume (0 redone)
  preemption notice       the same at once, shrinking off the draining node before its deadline (0 lost)
  failure (no notice)     tear the group down, resume from the last committed checkpoint on what is left
  too little capacity     WAITING_FOR_CAPACITY with the reason, until the policy can start again
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from parallel.planner import Plan, PlanError, plan
from service.cluster import ClusterSnapshot, ClusterWatcher
from service.events import EventLog
from service.policy import Fail, Failure, PolicyConfig, Resize, ScalingPolicy, Wait
from service.reconfig import Reconfig
from service.run_files import read_metrics
from service.state import JobState, StateMachine
from service.status import JobStatus
from service.worker_group import WorkerFailure, WorkerGroup, assign_nodes, probe_nodes
from workers.config import JobConfig, job_constraints

logger = logging.getLogger(__name__)
S = JobState


@dataclass(kw_only=True, slots=True)
class CoordinatorOptions:
    settle_seconds: float = 10.0
    """Capacity must be stable this long before the job grows onto it."""
    chunk_seconds: float = 0.5
    """Target length of one training call between two looks at the cluster (steps per call are set
    from the measured step time, the same count on every rank)."""
    poll_interval_s: float = 0.5
    """Cluster watcher interval."""
    max_restarts: int = 3
    """Failures of one kind tolerated within restart_window_s before the job fails."""
    restart_window_s: float = 600.0
    start_timeout_s: float = 30.0
    """How long placing new workers may take before it counts as a failure."""
    include_head: bool = True
    """Whether workers may run on the Ray head node."""
    probe_timeout_s: float = 2.0
    """After a failure, a node that cannot place a tiny bundle within this long is left out of plans."""
    suspect_seconds: float = 60.0
    """How long such a node stays out (unless Ray confirms it dead first, or a later probe reaches it)."""
    reprobe_interval_s: float = 3.0
    """While the job waits or starts with suspects left out, how often they are probed again."""


class Coordinator:
    worker_group_cls = WorkerGroup  # seam: tests swap in a fake group
    group_probe = staticmethod(probe_nodes)  # seam: which nodes still place work (None: trust the watcher)

    def __init__(self, cfg: JobConfig, *, run_dir: str | Path, total_steps: int | None = None,
                 job_id: str | None = None, workers: int | None = None, layout: str | None = None,
                 options: CoordinatorOptions | None = None, watcher: ClusterWatcher | None = None):
        self.cfg = cfg
        self.model_cfg = cfg.model.build()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.job_id = job_id or uuid.uuid4().hex[:12]
        self.total_steps = total_steps or cfg.train.steps
        self.opts = options or CoordinatorOptions()
        self.constraints = job_constraints(cfg, layout=layout)  # a forced layout (argument or config) in it
        self.forced = self.constraints.layout
        lo, hi = cfg.parallel.min_workers, cfg.parallel.max_workers
        if workers is not None:
            lo, hi = min(lo, workers), workers
        if self.forced is not None:
            lo = hi = self.forced.world_size
        self.events = _load_events(self.run_dir / "events.jsonl", self.job_id)
        self.sm = StateMachine(self.job_id, sink=self.events.append)
        self.policy = ScalingPolicy(self._policy_config(lo, hi), size_for=self._size_for)
        self.watcher = watcher or ClusterWatcher(interval_s=self.opts.poll_interval_s)
        self._own_watcher = watcher is None
        self.group: WorkerGroup | None = None
        self.plan: Plan | None = None
        self.step_done = 0
        self.committed_step = 0
        self.metrics: dict[int, dict] = {}
        self.failures: list[Failure] = []
        self.reconfigs: list[Reconfig] = []
        self._open: Reconfig | None = None
        self._commands: queue.Queue = queue.Queue()
        self._user_resize = False
        self._suspects: dict[str, float] = {}  # node id -> when a probe found it unresponsive
        self._last_reprobe = 0.0
        self._lock = threading.RLock()
        if len(self.events):
            self._resume_after_restart()

    def _resume_after_restart(self) -> None:
        """This job's events are already in the run directory: an earlier coordinator of the same job
        died (its actor was restarted by Ray, or the job was started again by hand). Its workers died
        with it; the next group resumes from the last committed checkpoint, and this reconfiguration
        is recorded as a failure whose steps lost run from the last step the old group logged."""
        prior = self.events.events
        last_step = max([e.step for e in prior if e.step is not None] + [_last_logged_step(self.run_dir)])
        last_state = next((e.to_state for e in reversed(prior) if e.kind == "transition"), None)
        layout = next((e.new_layout for e in reversed(prior) if e.new_layout), None)
        why = (f"the coordinator restarted (its previous process was lost in state {last_state} at step "
               f"{last_step}); resuming from the last committed checkpoint")
        self.failures.append(Failure(time=time.time(), kind="coordinator", error=why))
        self.sm.note("failure", reason=why, step=last_step, cause="failure",
                     details={"kind": "coordinator_restart", "previous_events": len(prior)})
        self._open = Reconfig(cause="failure", detected=time.time(), step_before=last_step, old_layout=layout)

    # -- outside interface (thread-safe) ------------------------------------------------------------------
    def status(self) -> JobStatus:
        with self._lock:
            last = self.metrics.get(self.step_done, {})
            sm = self.sm.snapshot()
            # Layout and world size from one plan, the one the group runs (set under this lock once the
            # group has formed): never a new layout with the old size, or the size of a group half re-formed.
            running = self.group is not None and self.plan is not None
            recs = [r.to_dict() for r in list(self.reconfigs)]
            return JobStatus(
                job_id=self.job_id, state=sm["state"], reason=sm["reason"], cause=sm["cause"], since=sm["since"],
                layout=self.plan.layout.to_dict() if running else sm["layout"], step=self.step_done,
                total_steps=self.total_steps, world_size=self.plan.world_size if running else 0,
                loss=last.get("loss"), tokens_per_s=last.get("tokens_per_s"), committed_step=self.committed_step,
                min_workers=self.policy.config.min_workers, max_workers=self.policy.config.max_workers,
                run_dir=str(self.run_dir), reconfigurations=dict(Counter(r["cause"] for r in recs)),
                steps_lost=sum(r["steps_lost"] for r in recs), events=len(self.events))

    def events_since(self, index: int = 0) -> list[dict]:
        return [e.to_dict() for e in self.events.since(index)]

    def metrics_since(self, step: int = 0) -> list[dict]:
        with self._lock:
            return [self.metrics[s] for s in sorted(self.metrics) if s > step]

    def resize(self, *, workers: int | None = None, min_workers: int | None = None,
               max_workers: int | None = None) -> None:
        lo = min_workers if min_workers is not None else self.policy.config.min_workers
        hi = max_workers if max_workers is not None else self.policy.config.max_workers
        if workers is not None:
            lo, hi = min(lo, workers), workers
        self._policy_config(lo, hi)  # validate now, in the caller's thread
        self._commands.put(("resize", lo, hi))

    def pause(self) -> None:
        self._commands.put(("pause",))

    def resume(self) -> None:
        self._commands.put(("resume",))

    def stop(self) -> None:
        self._commands.put(("stop",))

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self, on_tick=None) -> JobState:
        if self._own_watcher:
            self.watcher.poll()
            self.watcher.start()
        try:
            while not self.sm.state.is_terminal:
                self.step()
                if on_tick is not None:
                    on_tick(self)
            return self.sm.state
        finally:
            if self._own_watcher:
                self.watcher.stop()
            self._shutdown_group()

    def step(self) -> JobState:
        """One iteration. Returns the state after it."""
        self._apply_commands()
        state = self.sm.state
        if state.is_terminal or state is S.PAUSED:
            if state is S.PAUSED:
                time.sleep(0.05)
            return self.sm.state
        snap = self.watcher.latest or self.watcher.poll()
        if state is S.PENDING:
            self.sm.transition(S.STARTING, reason="starting", step=self.step_done, cause="planned")
        if self.group is None:
            self._start_or_wait(snap)
        elif self.step_done >= self.total_steps:
            self._finish()
        else:
            self._running(snap)
        return self.sm.state

    # -- states --------------------------------------------------------------------------------------------
    def _start_or_wait(self, snap: ClusterSnapshot) -> None:
        self._reprobe(snap)  # before starting small or waiting: a suspect may just have been slow
        d = self.policy.decide(time.time(), current_workers=0, usable_workers=self._usable(snap),
                               draining=snap.draining(), failures=self.failures)
        if isinstance(d, Fail):
            self._fail(d.reason)
        elif isinstance(d, Wait):
            if self.sm.state is not S.WAITING_FOR_CAPACITY:
                self.sm.transition(S.WAITING_FOR_CAPACITY, reason=d.reason, step=self.step_done)
            time.sleep(min(0.2, self.opts.poll_interval_s))
        elif isinstance(d, Resize):
            if self.sm.state is S.WAITING_FOR_CAPACITY:
                self.sm.transition(S.RECOVERING if self.step_done else S.STARTING,
                                   reason=f"capacity is back: {d.reason}", step=self.step_done, cause=d.cause)
            self._reform(d.workers, snap, cause=d.cause, reason=d.reason)

    def _running(self, snap: ClusterSnapshot) -> None:
        if self._our_nodes_dead(snap):
            self._recover(WorkerFailure("node_died", "a node hosting workers is gone"))
            return
        d = self.policy.decide(time.time(), current_workers=self.group.size, usable_workers=self._usable(snap),
                               draining=snap.draining(), failures=self.failures)
        if self._user_resize:
            self._user_resize = False
            offered = min(self._usable(snap), self.policy.config.max_workers or self._usable(snap))
            target = self._size_for(offered)
            if target and target != self.group.size:
                d = Resize(workers=target, cause="user", reason=f"resize to {target} workers requested by user")
        if isinstance(d, Fail):
            self._fail(d.reason)
        elif isinstance(d, Resize):
            self._planned_resize(d.workers, snap, cause=d.cause, reason=d.reason)
        elif isinstance(d, Wait):
            self._planned_resize(0, snap, cause="preemption" if snap.draining() else "failure", reason=d.reason)
        else:
            self._prewarm(snap)
            self._train_chunk()

    def _prewarm(self, snap: ClusterSnapshot) -> None:
        """While a growth settles, start the workers it will need on the new nodes."""
        pending = self.policy.pending_growth
        if pending is None or not hasattr(self.group, "prewarm"):
            return
        try:
            nodes = self._assign(self._plan(pending[0]), snap)
        except (PlanError, ValueError):
            return
        extra = list((Counter(nodes) - self.group.nodes()).elements())
        if extra:
            self.group.prewarm(extra)

    def _train_chunk(self) -> None:
        try:
            rows = self.group.run(until_step=self.total_steps, steps=self._steps_per_call(),
                                  should_abort=lambda: self._our_nodes_dead(self.watcher.latest))
        except WorkerFailure as e:
            self._recover(e)
            return
        with self._lock:
            for m in rows:
                self.metrics[m["step"]] = m
            if rows:
                self.step_done = rows[-1]["step"]
                self.committed_step = max(self.committed_step, rows[-1].get("committed_step", 0))
        if rows and self._open is not None:
            self._open.first_step(rows[0], self.metrics.get(self._open.step_before))
            self.reconfigs.append(self._open)
            self._open = None
        if self.sm.state is not S.RUNNING:
            self.sm.transition(S.RUNNING, reason="training", layout=self.plan.layout, step=self.step_done)

    def _steps_per_call(self) -> int:
        """As many steps as fit in chunk_seconds at the last measured step time (1 until measured)."""
        last = self.metrics.get(self.step_done)
        step_time = last.get("step_time") if last else None
        if not step_time:
            return 1
        return max(1, min(100, int(self.opts.chunk_seconds / step_time)))

    # -- reconfiguration -----------------------------------------------------------------------------------
    def _planned_resize(self, workers: int, snap: ClusterSnapshot, *, cause: str, reason: str) -> None:
        """Checkpoint at the current step, then re-form at `workers` (0: release everything and wait)."""
        t0 = time.time()
        if cause == "preemption":
            self.sm.note("preemption", reason=reason, step=self.step_done, cause=cause,
                         details={"draining": snap.draining()})
        self.sm.transition(S.RESIZING, reason=reason, step=self.step_done, cause=cause)
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

    def _recover(self, err: WorkerFailure, *, tried: list[str] = ()) -> None:
        """`tried`: the nodes a failed re-form was placing workers on (not members yet, but just as
        likely to be the dead ones: e.g. a node killed right after the probe of the previous failure)."""
        t0 = time.time()
        with self._lock:
            self.failures.append(Failure(time=t0, kind=err.kind, error=str(err)))
        nodes = sorted(set(self.group.nodes() if self.group is not None else ()) | set(tried))
        self._shutdown_group()
        dead = self._probe(nodes)
        self.sm.note("failure", reason=str(err), step=self.step_done, cause="failure",
                     details={"kind": err.kind, "unresponsive_nodes": sorted(dead)})
        if self.sm.can(S.RECOVERING):
            self.sm.transition(S.RECOVERING, reason=str(err), step=self.step_done, cause="failure")
        self._open = Reconfig(cause="failure", detected=t0, step_before=self.step_done,
                              old_layout=self.plan.layout.to_dict() if self.plan else None)

    def _reform(self, workers: int, snap: ClusterSnapshot, *, cause: str, reason: str, t0: float | None = None) -> None:
        t0 = t0 or time.time()
        try:
            p = self._plan(workers)
            nodes = self._assign(p, snap)
        except (PlanError, ValueError) as e:
            self._fail(f"cannot plan {workers} workers: {e}")
            return
        old = self.plan.layout.to_dict() if self.plan else None
        if self.group is None:
            self.group = self.worker_group_cls(self.cfg, str(self.run_dir),
                                               cpus_per_worker=self.cfg.resources.cpus_per_worker,
                                               gpus_per_worker=self.cfg.resources.gpus_per_worker,
                                               job_id=self.job_id, start_timeout_s=self.opts.start_timeout_s)
        try:
            if self.group.size:
                self.group.leave()
            started, stopped = self.group.scale_to(nodes)
            formed = self.group.form(p)
        except WorkerFailure as e:
            self._recover(e, tried=nodes)
            return
        with self._lock:
            self.plan = p
            resumed = formed["step"]
            rc = self._open if self._open is not None else Reconfig(cause=cause, detected=t0, step_before=self.step_done,
                                                                    old_layout=old)
            cause = rc.cause  # a recovery re-forms through a "planned" start: the event says why it happened
            rc.formed(new_layout=p.layout.to_dict(), resumed_step=resumed, started=started, stopped=stopped,
                      world_size=p.world_size)
            self._open = rc
            self.step_done = resumed
        self.sm.note("resize", reason=f"{reason}; layout {p.layout} on {p.world_size} workers "
                                      f"({started} started, {stopped} stopped, resumed at step {resumed})",
                     step=resumed, cause=cause, details={"plan": p.to_dict(), **rc.to_dict()})
        self.sm.transition(S.RUNNING, reason=f"running {p.layout}", layout=p.layout, step=resumed, cause=cause)

    # -- helpers -------------------------------------------------------------------------------------------
    def _finish(self) -> None:
        try:
            self.committed_step = self.group.checkpoint()
        except WorkerFailure as e:
            self._recover(e)
            return
        self._shutdown_group()
        self.sm.transition(S.SUCCEEDED, reason=f"reached step {self.total_steps}", step=self.step_done)

    def _fail(self, reason: str) -> None:
        self._shutdown_group()
        self.sm.transition(S.FAILED, reason=reason, step=self.step_done)

    def _shutdown_group(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    def _apply_commands(self) -> None:
        deferred = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            kind = cmd[0]
            if kind == "resize":
                self.policy.config = self._policy_config(cmd[1], cmd[2])
                self._user_resize = True  # act now: a user's request needs no settle time
            elif kind in ("pause", "stop"):
                target = S.PAUSED if kind == "pause" else S.STOPPED
                if self.sm.state.is_terminal or self.sm.state is target:
                    continue
                if not self.sm.can(target):  # e.g. pause while STARTING: apply once it is running
                    deferred.append(cmd)
                    continue
                if self.group is not None:
                    try:
                        self.committed_step = self.group.checkpoint()
                    except WorkerFailure as e:
                        logger.warning("job %s: checkpoint before %s failed (%s); resuming will restart from "
                                       "step %d", self.job_id, kind, e, self.committed_step)
                self._shutdown_group()
                self.sm.transition(target, reason=f"{kind} requested by user", step=self.step_done, cause="user")
            elif kind == "resume" and self.sm.state is S.PAUSED:
                self.sm.transition(S.STARTING, reason="resume requested by user", step=self.step_done, cause="user")
        for cmd in deferred:
            self._commands.put(cmd)

    def _policy_config(self, lo: int, hi: int) -> PolicyConfig:
        return PolicyConfig(min_workers=lo, max_workers=hi, settle_seconds=self.opts.settle_seconds,
                            max_restarts=self.opts.max_restarts, restart_window_s=self.opts.restart_window_s)

    def _plan(self, workers: int) -> Plan:
        return plan(workers, self.model_cfg, replace(self.constraints, min_workers=1, max_workers=workers))

    def _size_for(self, offered: int) -> int | None:
        try:
            return self._plan(offered).world_size
        except ValueError:  # PlanError, or no worker offered at all (max_workers=0)
            return None

    def _probe(self, nodes: list[str]) -> set[str]:
        """Mark the nodes among `nodes` that no longer place work as suspects; return them."""
        if not nodes or self.group_probe is None:
            return set()
        dead = set(nodes) - self.group_probe(nodes, timeout_s=self.opts.probe_timeout_s)
        now = self._last_reprobe = time.time()
        for nid in dead:
            self._suspects[nid] = now
        return dead

    def _reprobe(self, snap: ClusterSnapshot) -> None:
        """Probe the suspects again (at most every `reprobe_interval_s`): a raylet that was only slow,
        e.g. on a loaded machine, places work again and its node is usable again at once instead of
        after `suspect_seconds`."""
        now = time.time()
        self._usable_nodes(snap)  # drops suspects that expired or that Ray confirmed dead
        if not self._suspects or self.group_probe is None or now - self._last_reprobe < self.opts.reprobe_interval_s:
            return
        self._last_reprobe = now
        back = self.group_probe(sorted(self._suspects), timeout_s=self.opts.probe_timeout_s)
        for nid in back:
            del self._suspects[nid]
        if back:
            self.sm.note("capacity", reason=f"{len(back)} node(s) place work again after a failed probe: "
                                            f"{', '.join(n[:8] for n in sorted(back))}",
                         step=self.step_done, details={"nodes": sorted(back)})

    def _usable_nodes(self, snap: ClusterSnapshot) -> list:
        now = time.time()
        self._suspects = {n: t for n, t in self._suspects.items()
                          if now - t < self.opts.suspect_seconds and (snap.node(n) is not None and snap.node(n).alive)}
        return [n for n in snap.usable_nodes(self.opts.include_head) if n.node_id not in self._suspects]

    def _slots(self, snap: ClusterSnapshot) -> dict[str, int]:
        """Workers that fit on each usable node (alive, not draining, not a suspect)."""
        r = self.cfg.resources
        return {n.node_id: n.workers_fit(r.cpus_per_worker, r.gpus_per_worker) for n in self._usable_nodes(snap)}

    def _usable(self, snap: ClusterSnapshot) -> int:
        return sum(self._slots(snap).values())

    def _assign(self, p: Plan, snap: ClusterSnapshot) -> list[str]:
        """Node of each rank of plan `p`, keeping current members where they are."""
        return assign_nodes(p.world_size, self._slots(snap), prefer=self.group.nodes() if self.group else None,
                            tp=p.layout.tp)

    def _our_nodes_dead(self, snap: ClusterSnapshot | None) -> bool:
        if snap is None or self.group is None:
            return False
        for nid in self.group.nodes():
            node = snap.node(nid)
            if node is None or not node.alive:
                return True
        return False


def _load_events(path: Path, job_id: str) -> EventLog:
    """The job's event log, continuing this job's events already in `path` (a restarted coordinator)
    and ignoring those of other jobs that ran in the same directory before."""
    log = EventLog.load(path)
    mine = [e for e in log.events if e.job_id == job_id]
    return log if len(mine) == len(log) else EventLog(path, mine)


def _last_logged_step(run_dir: Path) -> int:
    """The step of the last complete line of RUN_DIR/metrics.jsonl (rank 0 writes one per step), or 0."""
    rows = read_metrics(run_dir / "metrics.jsonl", after=0)
    return rows[-1]["step"] if rows else 0
