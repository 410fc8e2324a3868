"""One job's coordinator: keeps training running while the cluster under it changes.

Driven by `step()` (one iteration: apply queued user commands, then run the handler of the current
state), so tests and the demo can advance it deterministically; `run()` loops until a terminal state.
Each state has one handler (`_on_<state>`, dispatched from the `_handlers` table); the handlers ask the
scaling policy for a decision (service.policy: Noop, Resize, Wait, Fail) and act on it. Methods for the
outside (`status`, `events_since`, `metrics_since`, `resize`, `pause`, `resume`, `stop`) are thread-safe:
commands (service.commands) are queued and applied at the start of the next iteration.

Flows (service.reconfigure does them):
  planned resize / grow   finish the chunk, plan, move the state live from the old workers to the new
                          ones (parallel.reshard=live; `storage`: a synchronous checkpoint, then load),
                          resume (0 redone); a durable checkpoint is then written in the background
  preemption notice       the same at once, the draining node's workers sending before its deadline (0 lost)
  failure (no notice)     survivors salvage their shards; if they hold every shard (replicas), heal from
                          them (0 redone), else tear the group down and resume from the last committed
                          checkpoint on what is left; a live transfer that fails falls back the same way
  too little capacity     WAITING_FOR_CAPACITY with the reason, until the policy can start again

Which nodes are usable (watcher minus unresponsive suspects) is service.node_health.NodeHealth; the
worker group is anything that satisfies service.group_types.Group (`worker_group_cls` is the seam).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from parallel.planner import Plan, PlanError, plan, size_for
from service.cluster import ClusterSnapshot, ClusterWatcher
from service.commands import Command
from service.coordinator_commands import Commands
from service.group_types import Group, WorkerFailure
from service.metrics_ring import RecentMetrics
from service.ledger import cap_slots
from service.node_health import NodeHealth
from service.options import CoordinatorOptions
from service.policy import Decision, Fail, Failure, PolicyConfig, Resize, ScalingPolicy, Wait
from service.reconfig import Reconfig
from service.reconfigure import GroupLifecycle
from service.run_files import job_events, last_plan, where_it_stopped
from service.specs import worker_range
from service.state import JobState, StateMachine
from service.status import JobStatus
from service.placement import assign_nodes, probe_nodes, raylets_refusing
from service.worker_group import WorkerGroup
from workers.config import JobConfig, job_constraints

logger = logging.getLogger(__name__)
S = JobState


class Coordinator(Commands, GroupLifecycle):
    worker_group_cls: Callable[..., Group] = WorkerGroup  # seam: tests swap in a fake group

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
        lo, hi = worker_range(cfg, workers, layout=layout)
        self.events = job_events(self.run_dir / "events.jsonl", self.job_id)
        self.sm = StateMachine(self.job_id, sink=self.events.append)
        self.policy = ScalingPolicy(self._policy_config(lo, hi), size_for=self._size_for)
        self.watcher = watcher or ClusterWatcher(interval_s=self.opts.poll_interval_s)
        self._own_watcher = watcher is None
        self.group: Group | None = None
        self.plan: Plan | None = None
        self.step_done = 0
        self.committed_step = 0
        self.metrics: dict[int, dict] = RecentMetrics()  # bounded: the store and metrics.jsonl keep the rest
        self.failures: list[Failure] = []
        self.reconfigs: list[Reconfig] = []
        self._open: Reconfig | None = None
        self._heal = None  # service.reconfigure.Heal while a failed group's survivors wait to heal from peers
        self._commands: queue.Queue[Command] = queue.Queue()
        self._woken = threading.Event()
        self._user_resize = False
        self.grant: dict[str, int] | None = None
        """{node_id: workers} the shared-cluster scheduler grants this job (service.scheduler); None: the
        whole cluster. Assign a new dict to change it: placement and the policy read it each iteration."""
        self.queue: tuple[int | None, str] = (None, "")
        """(place, reason) the scheduler gave with a grant too small to start on (shown while QUEUED)."""
        o = self.opts
        self.health = NodeHealth(probe_nodes, probe_timeout_s=o.probe_timeout_s, suspect_seconds=o.suspect_seconds,
                                 reprobe_interval_s=o.reprobe_interval_s, include_head=o.include_head,
                                 refused=raylets_refusing)
        self._handlers: dict[JobState, Callable[[ClusterSnapshot], None]] = {
            S.PENDING: self._on_pending, S.STARTING: self._on_starting, S.RUNNING: self._on_running,
            S.RESIZING: self._on_resizing, S.RECOVERING: self._on_recovering,
            S.WAITING_FOR_CAPACITY: self._on_waiting_for_capacity, S.QUEUED: self._on_waiting_for_capacity}
        """One handler per state that acts; PAUSED and the terminal states wait for a command or nothing."""
        self._lock = threading.RLock()
        self._take_over_due = False
        """After a restart whose workers may still run (detached, `opts.owner`): the first iteration takes
        them over (`_take_over`)."""
        self._lost_plan: Plan | None = None
        """The plan the lost coordinator's group ran (its last resize event's); None if it formed none."""
        if len(self.events):
            self._resume_after_restart()

    @property
    def group_probe(self):
        """Seam: which nodes still place work, probe(node_ids, timeout_s=) -> set (None: trust the watcher)."""
        return self.health.probe_fn

    @group_probe.setter
    def group_probe(self, fn) -> None:
        self.health.probe_fn = fn

    def _resume_after_restart(self) -> None:
        """This job's events are already in the run directory: an earlier coordinator of the same job
        died (its actor was restarted by Ray, or the job was started again by hand). Workers it started
        detached (`opts.owner`) outlive it: the first iteration takes them over and heals from their
        state (`_take_over`); else, or for what cannot heal, the next group resumes from the last
        committed checkpoint. This reconfiguration is recorded as a failure whose steps lost run from
        the last step the old group logged."""
        prior = self.events.events
        last_step, last_state, layout = where_it_stopped(prior, self.run_dir)
        self._take_over_due = self.opts.owner is not None
        self._lost_plan = Plan.from_dict(d) if (d := last_plan(prior)) else None
        how = ("taking over the workers it left running, else resuming from the last committed checkpoint"
               if self._take_over_due else "resuming from the last committed checkpoint")
        why = (f"the coordinator restarted (its previous process was lost in state {last_state} at step "
               f"{last_step}); {how}")
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
            # (RECOVERING: a failed group's survivors may still be held, but they run no layout)
            running = self.group is not None and self.plan is not None and self.sm.state is not S.RECOVERING
            recs = [r.to_dict() for r in list(self.reconfigs)]
            queued = self.sm.state is S.QUEUED
            return JobStatus(
                job_id=self.job_id, state=sm["state"], reason=(queued and self.queue[1]) or sm["reason"],
                cause=sm["cause"], since=sm["since"], priority=self.cfg.scheduling.priority,
                held=dict(self.group.nodes()) if self.group is not None else {}, grant=None if self.grant is None else dict(self.grant),
                queue_position=self.queue[0] if queued else None,
                layout=self.plan.layout.to_dict() if running else sm["layout"], step=self.step_done,
                total_steps=self.total_steps, world_size=self.plan.world_size if running else 0,
                loss=last.get("loss"), val_loss=self.metrics.val_loss, tokens_per_s=last.get("tokens_per_s"),
                committed_step=self.committed_step,
                min_workers=self.policy.config.min_workers, max_workers=self.policy.config.max_workers,
                run_dir=str(self.run_dir), reconfigurations=dict(Counter(r["cause"] for r in recs)),
                steps_lost=sum(r["steps_lost"] for r in recs), events=len(self.events))

    def events_since(self, index: int = 0) -> list[dict]:
        return [e.to_dict() for e in self.events.since(index)]

    def metrics_since(self, step: int = 0) -> list[dict]:
        with self._lock:
            return self.metrics.since(step)

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
        """One iteration: apply the queued commands, then the current state's handler. Returns the state
        after it. (The first iteration after a restart first takes over the lost coordinator's workers,
        whatever the commands replayed into it say: a pause or stop then releases them.)"""
        if self._take_over_due:
            self._take_over(self.watcher.latest or self.watcher.poll())
        self._apply_commands()
        handler = self._handlers.get(self.sm.state)
        if handler is None:  # PAUSED (a command moves it on) or terminal
            if self.sm.state is S.PAUSED:
                self._nap(0.05)
            return self.sm.state
        handler(self.watcher.latest or self.watcher.poll())
        return self.sm.state

    # -- one handler per state -----------------------------------------------------------------------------
    def _on_pending(self, snap: ClusterSnapshot) -> None:
        if self.grant is not None and not self._usable(snap):  # launched by the scheduler, nothing granted yet
            self.sm.transition(S.QUEUED, reason=self.queue[1] or "waiting for the shared-cluster scheduler",
                               step=self.step_done)
            return
        self.sm.transition(S.STARTING, reason="starting", step=self.step_done, cause="planned")
        self._on_starting(snap)

    def _on_starting(self, snap: ClusterSnapshot) -> None:
        """No group yet (or again, after a resume): start one as soon as the policy allows."""
        self._start_or_wait(snap)

    def _on_recovering(self, snap: ClusterSnapshot) -> None:
        """The group was lost: start a new one from the last committed checkpoint on what is left."""
        self._start_or_wait(snap)

    def _on_waiting_for_capacity(self, snap: ClusterSnapshot) -> None:
        """No workers held (WAITING_FOR_CAPACITY, QUEUED): start again once the policy sees enough usable
        (and granted) workers."""
        self._start_or_wait(snap)

    def _on_resizing(self, snap: ClusterSnapshot) -> None:
        """A resize completes within the step that begins it; a step that still finds it (its re-form
        raised) carries on from what is there."""
        (self._start_or_wait if self.group is None else self._on_running)(snap)

    def _on_running(self, snap: ClusterSnapshot) -> None:
        if self.step_done >= self.total_steps:
            self._finish()
        else:
            self._running(snap)

    # -- what the handlers do ------------------------------------------------------------------------------
    def _start_or_wait(self, snap: ClusterSnapshot) -> None:
        self._reprobe(snap)  # before starting small or waiting: a suspect may just have been slow
        d = self._decide(snap, current_workers=0)
        if isinstance(d, Fail):
            self._fail(d.reason)
        elif isinstance(d, Wait):
            if self._heal is not None:  # survivors cannot wait holding their state: it comes back from storage
                self._drop_heal(d.reason)
            if self.group is not None:  # warm survivors or standbys of a failure: nothing is kept while waiting
                self._shutdown_group()
            target = S.QUEUED if d.by_scheduler else S.WAITING_FOR_CAPACITY
            if self.sm.state is not target:
                self.sm.transition(target, reason=(d.by_scheduler and self.queue[1]) or d.reason, step=self.step_done)
            self._nap(min(0.2, self.opts.poll_interval_s))
        elif isinstance(d, Resize):
            if self.sm.state in (S.WAITING_FOR_CAPACITY, S.QUEUED):
                self.sm.transition(S.RECOVERING if self.step_done else S.STARTING,
                                   reason=f"capacity is back: {d.reason}", step=self.step_done, cause=d.cause)
            self._reform(d.workers, snap, cause=d.cause, reason=d.reason)

    def _decide(self, snap: ClusterSnapshot, *, current_workers: int) -> Decision:
        r = self.cfg.resources
        fits = sum(self.health.slots(snap, r.cpus_per_worker, r.gpus_per_worker).values())  # the grant aside
        return self.policy.decide(time.time(), current_workers=current_workers, usable_workers=fits,
                                  draining=snap.draining(), failures=self.failures,
                                  granted=None if self.grant is None else self._usable(snap))

    def _running(self, snap: ClusterSnapshot) -> None:
        if self._our_nodes_dead(snap):
            self._recover(WorkerFailure("node_died", "a node hosting workers is gone"))
            return
        d = self._decide(snap, current_workers=self.group.size)
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
        """Keep standby workers beside the members; while a growth settles, start the workers it will
        need on the new nodes."""
        self.group.keep_standby()
        pending = self.policy.pending_growth
        if pending is None:
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
            self._durable_checkpoint()  # after a live move: the fallback checkpoint, now that it trains
        if self.sm.state is not S.RUNNING:
            self.sm.transition(S.RUNNING, reason="training", layout=self.plan.layout, step=self.step_done)

    def _steps_per_call(self) -> int:
        """As many steps as fit in chunk_seconds at the last measured step time (1 until measured)."""
        last = self.metrics.get(self.step_done)
        step_time = last.get("step_time") if last else None
        if not step_time:
            return 1
        return max(1, min(100, int(self.opts.chunk_seconds / step_time)))

    def _policy_config(self, lo: int, hi: int) -> PolicyConfig:
        return PolicyConfig(min_workers=lo, max_workers=hi, settle_seconds=self.opts.settle_seconds,
                            max_restarts=self.opts.max_restarts, restart_window_s=self.opts.restart_window_s)

    def _plan(self, workers: int) -> Plan:
        return plan(workers, self.model_cfg, replace(self.constraints, min_workers=1, max_workers=workers))

    def _size_for(self, offered: int) -> int | None:
        return size_for(offered, self.model_cfg, self.constraints)

    def _probe(self, nodes: list[str]) -> set[str]:
        return self.health.probe(nodes)

    def _reprobe(self, snap: ClusterSnapshot) -> None:
        if back := self.health.reprobe(snap):
            self.sm.note("capacity", reason=f"{len(back)} node(s) place work again after a failed probe: "
                                            f"{', '.join(n[:8] for n in sorted(back))}",
                         step=self.step_done, details={"nodes": sorted(back)})

    def _slots(self, snap: ClusterSnapshot) -> dict[str, int]:
        r = self.cfg.resources
        return cap_slots(self.health.slots(snap, r.cpus_per_worker, r.gpus_per_worker), self.grant)

    def _usable(self, snap: ClusterSnapshot) -> int:
        return sum(self._slots(snap).values())

    def _assign(self, p: Plan, snap: ClusterSnapshot) -> list[str]:
        """Node of each rank of plan `p`, keeping current members where they are."""
        return assign_nodes(p.world_size, self._slots(snap), prefer=self.group.nodes() if self.group else None,
                            tp=p.layout.tp)

    def _our_nodes_dead(self, snap: ClusterSnapshot | None) -> bool:
        return self.group is not None and NodeHealth.any_gone(snap, self.group.nodes())

