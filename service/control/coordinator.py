"""One job's coordinator: keeps training running while the cluster under it changes.

Driven by `step()` (one iteration: apply queued user commands, then run the handler of the current
state), so tests and the demo can advance it deterministically; `run()` loops until a terminal state.
Each state has one handler (`_on_<state>`, dispatched from the `_handlers` table); the handlers ask the
scaling policy for a decision (service.control.policy: Noop, Resize, Wait, Fail) and act on it. Methods for the
outside (`status`, `events_since`, `metrics_since`, `resize`, `pause`, `resume`, `stop`) are thread-safe:
commands (service.control.commands) are queued and applied at the start of the next iteration.

Flows (service.control.reconfigure does them):
  planned resize / grow   finish the chunk, plan, move the state live from the old workers to the new
                          ones (parallel.reshard=live; `storage`: a synchronous checkpoint, then load),
                          resume (0 redone); a durable checkpoint is then written in the background
  preemption notice       the same at once, the draining node's workers sending before its deadline (0 lost)
  failure (no notice)     survivors salvage their shards; if they hold every shard (replicas), heal from
                          them (0 redone), else tear the group down and resume from the last committed
                          checkpoint on what is left; a live transfer that fails falls back the same way
  too little capacity     WAITING_FOR_CAPACITY with the reason, until the policy can start again

Which nodes are usable (watcher minus unresponsive suspects) is service.pool.node_health.NodeHealth; the
worker group is anything that satisfies service.pool.group.Group (`worker_group_cls` is the seam).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from parallel.exchange import survivors_hold_everything
from parallel.planner import Plan, PlanError, plan, size_for
from service.pool.cluster import ClusterSnapshot, ClusterWatcher
from service.control.commands import Command, Grant, Pause, Resume, SetWorkers, Stop
from service.pool.group import Group, WorkerFailure
from service.control.metrics_ring import RecentMetrics
from service.sharing.ledger import cap_slots
from service.pool.node_health import NodeHealth
from service.control.options import CoordinatorOptions
from service.control.policy import Decision, Fail, Failure, PolicyConfig, Resize, ScalingPolicy, Wait
from service.control.reconfiguration import Reconfig
from service.control.source import Heal, Live, Release, Restore, choose_source
from service.control.run_files import job_events, last_plan, where_it_stopped
from service.control.job import worker_range
from service.control.state import JobState, StateMachine
from service.control.status import JobStatus
from service.pool.placement import assign_nodes, probe_nodes, raylets_refusing
from service.pool.worker_group import WorkerGroup
from workers.config import JobConfig, job_constraints

logger = logging.getLogger(__name__)
S = JobState
PAUSERS = ("user", "scheduler")


class Coordinator:
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
        self._heal: Heal | None = None  # while a failed group's survivors wait to heal from peers
        self._commands: queue.Queue[Command] = queue.Queue()
        self._woken = threading.Event()
        self._user_resize = False
        self.grant: dict[str, int] | None = None
        """{node_id: workers} the shared-cluster scheduler grants this job (service.sharing.scheduler); None: the
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
        elif isinstance(d, (Resize, Wait)):
            if isinstance(d, Resize) and self.sm.state in (S.WAITING_FOR_CAPACITY, S.QUEUED):
                self.sm.transition(S.RECOVERING if self.step_done else S.STARTING,
                                   reason=f"capacity is back: {d.reason}", step=self.step_done, cause=d.cause)
            self._reconfigure(d, snap, sound=False)

    def _decide(self, snap: ClusterSnapshot, *, current_workers: int, requested: bool = False) -> Decision:
        r = self.cfg.resources
        fits = sum(self.health.slots(snap, r.cpus_per_worker, r.gpus_per_worker).values())  # the grant aside
        return self.policy.decide(time.time(), current_workers=current_workers, usable_workers=fits,
                                  draining=snap.draining(), failures=self.failures,
                                  granted=None if self.grant is None else self._usable(snap), requested=requested)

    def _running(self, snap: ClusterSnapshot) -> None:
        if self._our_nodes_dead(snap):
            self._recover(WorkerFailure("node_died", "a node hosting workers is gone"))
            return
        requested, self._user_resize = self._user_resize, False
        d = self._decide(snap, current_workers=self.group.size, requested=requested)
        if isinstance(d, Fail):
            self._fail(d.reason)
        elif isinstance(d, (Resize, Wait)):
            cause = d.cause if isinstance(d, Resize) else "preemption" if snap.draining() else "failure"
            if cause == "preemption":
                self.sm.note("preemption", reason=d.reason, step=self.step_done, cause=cause,
                             details={"draining": snap.draining()})
            self.sm.transition(S.RESIZING, reason=d.reason, step=self.step_done, cause=cause)
            self._reconfigure(d, snap, sound=bool(self.group.size), cause=cause)
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

    # -- commands: what the user and the scheduler may ask, from any thread ----------------------------
    def resize(self, *, workers: int | None = None, min_workers: int | None = None,
               max_workers: int | None = None) -> None:
        cmd = SetWorkers(workers=workers, min_workers=min_workers, max_workers=max_workers)
        self._policy_config(*cmd.bounds(self.policy.config.min_workers, self.policy.config.max_workers))  # validate now
        self._enqueue(cmd)  # applied to the range current then: a second resize composes with the first

    def pause(self, *, by: str = "user", reason: str | None = None) -> None:
        if by not in PAUSERS:
            raise ValueError(f"pause by must be one of {PAUSERS}, got {by!r}")
        self._enqueue(Pause(by=by, reason=reason))

    def resume(self, *, by: str = "user") -> None:
        if by not in PAUSERS:
            raise ValueError(f"resume by must be one of {PAUSERS}, got {by!r}")
        self._enqueue(Resume(by=by))

    def stop(self) -> None:
        self._enqueue(Stop())

    def set_grant(self, nodes: dict[str, int], reason: str, queue_position: int | None = None) -> None:
        """The shared-cluster scheduler's grant (service.sharing.rounds): plan onto these workers only."""
        if not isinstance(nodes, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                  and v >= 1 for k, v in nodes.items()):
            raise ValueError(f"a grant is {{node_id: workers >= 1}}, got {nodes!r}")
        if not isinstance(reason, str) or not reason:
            raise ValueError("a grant needs its reason (a non-empty string)")
        self._enqueue(Grant(nodes=dict(nodes), reason=reason, queue_position=queue_position))

    def _enqueue(self, cmd: Command) -> None:
        self._commands.put(cmd)
        self._woken.set()  # a loop napping while it waits (QUEUED, PAUSED, ...) acts on it at once

    # -- in the loop -----------------------------------------------------------------------------------------
    def _nap(self, seconds: float) -> None:
        """Wait up to `seconds`, less if a command arrives."""
        self._woken.wait(seconds)
        self._woken.clear()

    def _apply_commands(self) -> None:
        deferred = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if not self._apply(cmd):
                deferred.append(cmd)
        for cmd in deferred:
            self._commands.put(cmd)

    def _apply(self, cmd: Command) -> bool:
        """Apply one command; False to keep it for a later iteration."""
        match cmd:
            case SetWorkers():
                try:
                    self.policy.config = self._policy_config(*cmd.bounds(self.policy.config.min_workers,
                                                                         self.policy.config.max_workers))
                except ValueError as e:  # valid alone, not on top of an earlier resize: say so, keep going
                    self.sm.note("failure", reason=f"resize refused: {e}", step=self.step_done, cause="user")
                    return True
                self._user_resize = True  # act now: a user's request needs no settle time
            case Grant():
                told = (cmd.nodes, cmd.reason, cmd.queue_position)
                if told != (self.grant, *self.queue):
                    self.sm.note("schedule", reason=cmd.reason, step=self.step_done,
                                 details={"grant": cmd.nodes, "queue_position": cmd.queue_position})
                self.grant, self.queue = dict(cmd.nodes), (cmd.queue_position, cmd.reason)
            case Pause() | Stop():
                return self._park(cmd)
            case Resume() if self.sm.state is S.PAUSED:
                self.sm.transition(S.STARTING, reason=f"resume requested by {cmd.by}", step=self.step_done, cause=cmd.by)
        return True

    def _park(self, cmd: Pause | Stop) -> bool:
        """Checkpoint, release the workers, and move to PAUSED or STOPPED."""
        kind, target = ("pause", S.PAUSED) if isinstance(cmd, Pause) else ("stop", S.STOPPED)
        if self.sm.state.is_terminal or self.sm.state is target:
            return True
        if not self.sm.can(target):  # e.g. pause while STARTING: apply once it is running
            return False
        by = cmd.by if isinstance(cmd, Pause) else "user"
        lost = None
        if self.group is not None:
            try:
                self.committed_step = self.group.checkpoint()
            except WorkerFailure as e:
                lost = (f"the checkpoint before {kind} failed ({e}); the last committed checkpoint is step "
                        f"{self.committed_step}, so steps after it are lost")
                logger.warning("job %s: %s", self.job_id, lost)
                self.sm.note("failure", reason=lost, step=self.step_done, cause=by,
                             details={"kind": f"checkpoint_before_{kind}"})
        self._shutdown_group()
        if lost and target is S.STOPPED and self.sm.can(S.FAILED):  # not a clean stop: say so
            target = S.FAILED
        why = (cmd.reason if isinstance(cmd, Pause) and cmd.reason else f"{kind} requested by {by}")
        self.sm.transition(target, reason=why + (f", but {lost}" if lost else ""), step=self.step_done, cause=by)
        return True

    # -- what the handlers do to the group ---------------------------------------------------------------
    def _reconfigure(self, d: Resize | Wait, snap: ClusterSnapshot, *, sound: bool, cause: str | None = None) -> None:
        """Act on a decision to change the group: where its state comes from is `choose_source`'s answer.
        `sound`: the running group holds all its state (a planned change), so it can hand it over live
        or save it first; else the group failed, or none runs."""
        t0 = time.time()
        cause = cause or (d.cause if isinstance(d, Resize) else "failure")
        source = choose_source(decision=d, sound=self.plan if sound else None, survivors=self._heal,
                               reshard=self.cfg.parallel.reshard)
        healing, self._heal = self._heal is not None, None  # used now, or released below
        if isinstance(source, (Restore, Release)) and source.flush:
            try:
                self.committed_step = self.group.checkpoint()
                self.sm.note("checkpoint", reason=f"flushed at step {self.committed_step} before resize",
                             step=self.committed_step, cause=cause)
            except WorkerFailure as e:  # e.g. the draining node died before the save finished: fall back
                self._recover(e)
                return
        snap = self.watcher.latest or snap
        match source:
            case Release():
                self._release(d, healing=healing)
            case Live(old) | Heal(old):
                p, nodes = self._place(d.workers, snap)
                if p is not None:
                    self._move_live(old, p, nodes, survivors=list(source.ranks) if isinstance(source, Heal) else None,
                                    cause=cause, reason=d.reason, t0=t0)
            case Restore():
                p, nodes = self._place(d.workers, snap)
                if p is not None:
                    self._restore(p, nodes, cause=cause, reason=d.reason, t0=t0)

    def _release(self, d: Wait, *, healing: bool) -> None:
        """Hold no worker while the job waits (`healing`: survivors that could have healed are let go)."""
        if healing:
            self.sm.note("fallback", reason=f"{d.reason}: the surviving workers are released; the job will resume "
                                            f"from the last committed checkpoint (step {self.committed_step})",
                         step=self.step_done, cause="failure")
        self._shutdown_group()
        if self.sm.state is S.RESIZING:  # a planned change to nothing: it waits for capacity
            self.sm.transition(S.WAITING_FOR_CAPACITY, reason=d.reason, step=self.step_done)
            return
        target = S.QUEUED if d.by_scheduler else S.WAITING_FOR_CAPACITY
        if self.sm.state is not target:
            self.sm.transition(target, reason=(d.by_scheduler and self.queue[1]) or d.reason, step=self.step_done)
        self._nap(min(0.2, self.opts.poll_interval_s))

    def _place(self, workers: int, snap: ClusterSnapshot) -> tuple[Plan | None, list[str]]:
        """The plan for `workers` and the node of each rank; (None, []) after failing the job when no
        layout fits."""
        try:
            p = self._plan(workers)
            return p, self._assign(p, snap)
        except (PlanError, ValueError) as e:
            self._fail(f"cannot plan {workers} workers: {e}")
            return None, []

    def _move_live(self, old: Plan, p: Plan, nodes: list[str], *, survivors: list[int] | None,
                   cause: str, reason: str, t0: float) -> None:
        """Reshard live from `old` (all its ranks, or after a failure the `survivors` a salvage kept) to
        `p` on `nodes`, then write a durable checkpoint of the new layout in the background while
        training goes on. A transfer that fails midway falls back to the last committed checkpoint, and
        the events say so."""
        try:
            moved = self.group.reshard(old, p, nodes, survivors=survivors)
        except WorkerFailure as e:
            self.sm.note("fallback", reason=f"live state transfer failed ({e}); falling back to the last "
                                            f"committed checkpoint (step {self.committed_step})",
                         step=self.step_done, cause=cause, details={"kind": e.kind})
            self._recover(e, tried=nodes, salvage=False)  # the workers handed their state over: nothing to keep
            return
        mib = moved.bytes_moved / 2**20
        how = "moved live" if survivors is None else f"healed from surviving ranks {survivors}"
        self._formed(p, old.layout.to_dict(), moved.step, moved.started, moved.stopped, cause=cause, t0=t0,
                     reason=f"{reason}; {mib:.0f} MiB of state {how} in {moved.transfer_s:.2f}s",
                     transfer={"path": "live" if survivors is None else "peers", **moved.record()})
        self._durable_due = True

    _durable_due = False
    """A layout was formed from live state and has no checkpoint yet: write one after its first step."""

    def _durable_checkpoint(self) -> None:
        """After the first step at a layout formed from live state: a durable checkpoint in the background
        (it stages during the next step and commits while training goes on), so a later failure has a
        fallback. Not before that first step, which on a busy worker it would slow down."""
        if not self._durable_due:
            return
        self._durable_due = False
        try:
            step = self.group.checkpoint(blocking=False)
        except WorkerFailure as e:
            self._recover(e)
            return
        self.sm.note("checkpoint", reason=f"durable checkpoint of step {step} under {self.plan.layout} writing "
                                          "in the background", step=step)

    def _new_group(self) -> Group:
        o, r = self.opts, self.cfg.resources
        return self.worker_group_cls(self.cfg, str(self.run_dir), cpus_per_worker=r.cpus_per_worker,
                                     gpus_per_worker=r.gpus_per_worker, job_id=self.job_id,
                                     start_timeout_s=o.start_timeout_s, start_probe_s=o.reprobe_interval_s,
                                     probe_timeout_s=o.probe_timeout_s, owner=o.owner, namespace=o.namespace)

    def _take_over(self, snap: ClusterSnapshot) -> None:
        """After a restart: the workers the lost coordinator left running (`Group.adopt`) become this
        one's group. If between them they hold every shard of its last plan at one step, the next group
        heals from them (no step redone, no process started); else they stay as warm processes for the
        resume from storage (so do those of a job that reshards through storage, and those started
        before the lost coordinator formed any group)."""
        self._take_over_due = False
        self.health.sweep(snap)  # nodes that died with (or before) the lost coordinator: not planned onto
        old = self._lost_plan
        group = self._new_group()
        found = group.adopt()
        if not found:
            return
        self.group = group
        self.step_done = max(self.step_done, self._open.step_before if self._open is not None else 0)
        self.sm.note("info", reason=f"took over {found} worker(s) the previous coordinator left running",
                     step=self.step_done, details={"adopted": found, "nodes": dict(group.nodes())})
        if self.cfg.parallel.reshard != "live" or old is None:
            return
        self.plan = old  # what `_salvage` checks their shards against; the heal keeps it
        kept = self._salvage(self.health.gone(snap, sorted(group.nodes())), abort=False)
        self.plan = None  # no layout runs until the next group forms
        if self._heal is not None and self._open is not None:
            # the workers may have finished a step the lost coordinator never recorded (their metrics
            # came back with the salvage): the heal moves from there, not from its last recorded step
            self._open.step_before = self.step_done
        if not kept:
            self._drop_members()

    def _salvage(self, gone: set[str], *, dead: Callable[[], set[str]] = set,
                 abort: bool = True, timeout_s: float = 15.0) -> bool:
        """After a failure without notice: keep the surviving workers and their state when, between them,
        they hold every shard at one step (data-parallel replicas), so the group heals from peers
        (`self._heal`); else say why: the job falls back to the last committed checkpoint, and the
        survivors stay in the group as warm processes for that re-form to reuse (each has left the
        failed group and dropped its trainer; one whose save was still running is stopped instead).
        Returns whether the group is kept. `gone`: nodes the watcher lists as dead (their workers are
        not asked); `dead`, `abort`, `timeout_s`: see `Group.salvage`."""
        g, p = self.group, self.plan
        if self.cfg.parallel.reshard != "live" or g is None or p is None or not g.size:
            return False
        salvage = g.salvage(gone=gone, dead=dead, abort=abort, timeout_s=timeout_s)
        infos = salvage.kept
        steps = {i.step for i in infos.values()}
        rows = max((i.rows for i in infos.values()), key=len, default=())
        last_row = rows[-1]["step"] if rows else self.step_done
        if not infos:
            why = "no worker answered with state it can vouch for"
        elif len(steps) != 1:
            why = f"the survivors stopped at different steps {sorted(steps)}"
        elif not survivors_hold_everything(p.layout, infos):
            why = f"ranks {sorted(infos)} of {p.layout} do not hold every shard between them"
        elif max(steps) != max(last_row, self.step_done):
            why = f"the metrics of step {max(steps)} were lost with the failed worker"
        else:
            why = None
        stopped = {"stopped": list(salvage.stopped_why)} if salvage.stopped_why else {}
        if why is not None:
            self.sm.note("fallback", reason=f"cannot heal from the surviving workers: {why}; resuming from the "
                                            f"last committed checkpoint (step {self.committed_step})",
                         step=self.step_done, cause="failure",
                         details={"warm_workers": g.size + salvage.idle, **stopped})
            return g.size + salvage.idle > 0
        if stopped or salvage.idle:
            said = ([f"kept {salvage.idle} idle (no state to heal from)"] if salvage.idle else []) + \
                   ([f"stopped {len(salvage.stopped_why)}: {'; '.join(salvage.stopped_why)}"]
                    if salvage.stopped_why else [])
            self.sm.note("info", reason=f"healing from {len(infos)} surviving worker(s); {'; '.join(said)}",
                         step=self.step_done, details={"idle": salvage.idle, **stopped})
        with self._lock:
            for r in rows:
                self.metrics.setdefault(r["step"], r)
            self.step_done = steps.pop()
        self._heal = Heal(old=p, ranks=tuple(sorted(infos)))
        return True

    def _recover(self, err: WorkerFailure, *, tried: list[str] = (), salvage: bool = True,
                 patience_s: float = 15.0) -> None:
        """`tried`: the nodes a failed re-form was placing workers on (not members yet, but just as
        likely to be the dead ones: e.g. a node killed right after the probe of the previous failure).
        `salvage`: try to keep the survivors' state to heal from (not after a failed transfer), waiting
        at most `patience_s` for them to answer."""
        t0 = time.time()
        with self._lock:
            self.failures.append(Failure(time=t0, kind=err.kind, error=str(err)))
        nodes = sorted(set(self.group.nodes() if self.group is not None else ()) | set(tried))
        self.health.suspect(err.nodes)  # the group's probe found them dead: they stay out of the next plan
        self.health.sweep(self.watcher.latest)  # and nodes dead before, which a restarted coordinator did not see
        # known dead (the watcher, or that probe): neither waited for nor probed again
        gone = self.health.gone(self.watcher.latest, nodes) | err.nodes
        # The probe (up to probe_timeout_s on a dead node; milliseconds where its raylet is gone) runs
        # while the survivors salvage (up to their grace for a silent peer): one wait instead of two, and
        # the salvage stops waiting for the members on the nodes the probe finds dead.
        with ThreadPoolExecutor(1, thread_name_prefix="probe") as pool:
            probing = pool.submit(self._probe, [n for n in nodes if n not in gone])

            def found_dead() -> set[str]:
                return probing.result() if probing.done() and probing.exception() is None else set()

            # a failed heal is not healed again, nor are its workers reused
            if not salvage or self._heal is not None or not self._salvage(gone, dead=found_dead,
                                                                          timeout_s=patience_s):
                self._drop_members()
            dead = gone | probing.result()
        # waited_s: since the failure was noticed, in the salvage and the probe
        self.sm.note("failure", reason=str(err), step=self.step_done, cause="failure",
                     details={"kind": err.kind, "unresponsive_nodes": sorted(dead),
                              "waited_s": round(time.time() - t0, 3)})
        if self.sm.can(S.RECOVERING):
            self.sm.transition(S.RECOVERING, reason=str(err), step=self.step_done, cause="failure")
        self._open = Reconfig(cause="failure", detected=t0, step_before=self.step_done,
                              old_layout=self.plan.layout.to_dict() if self.plan else None)

    def _restore(self, p: Plan, nodes: list[str], *, cause: str, reason: str, t0: float) -> None:
        """Form the group for plan `p` on `nodes` from the last committed checkpoint, reusing the
        processes that are there."""
        old = self.plan.layout.to_dict() if self.plan else None
        if self.group is None:
            self.group = self._new_group()
        try:
            if self.group.size:
                self.group.leave()
            t_start = time.perf_counter()
            start = self.group.scale_to(nodes)
            start_s = time.perf_counter() - t_start
            formed = self.group.form(p)
        except WorkerFailure as e:
            # the members hold nothing the checkpoint does not: those that answer at once stay warm, those
            # stuck (a rendezvous with a rank on a dead node waits out its timeout) are not waited for
            self._recover(e, tried=nodes, patience_s=1.0)
            return
        self._formed(p, old, formed.step, start.started, start.stopped, cause=cause, reason=reason, t0=t0,
                     transfer={"path": "storage", "start_s": start_s, "standby": start.from_standby,
                               "form_s": formed.form_s})

    def _formed(self, p, old: dict | None, resumed: int, started: int, stopped: int, *, cause: str,
                reason: str, t0: float, transfer: dict) -> None:
        """Record a group formed for plan `p` and go RUNNING."""
        with self._lock:
            self.plan = p
            rc = self._open if self._open is not None else Reconfig(cause=cause, detected=t0, step_before=self.step_done,
                                                                    old_layout=old)
            cause = rc.cause  # a recovery re-forms through a "planned" start: the event says why it happened
            rc.formed(new_layout=p.layout.to_dict(), resumed_step=resumed, started=started, stopped=stopped,
                      world_size=p.world_size, transfer=transfer)
            self._open = rc
            self.step_done = resumed
        self.sm.note("resize", reason=f"{reason}; layout {p.layout} on {p.world_size} workers "
                                      f"({started} started, {stopped} stopped, resumed at step {resumed})",
                     step=resumed, cause=cause, details={"plan": p.to_dict(), **rc.to_dict()})
        self.sm.transition(S.RUNNING, reason=f"running {p.layout}", layout=p.layout, step=resumed, cause=cause)

    def _finish(self) -> None:
        if self._open is not None:  # re-formed at the last step: no step left to close its record with
            self.reconfigs.append(self._open)
            self._open = None
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
        self._heal, self._durable_due = None, False
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    def _drop_members(self) -> None:
        """After a failure that kept no worker: stop every member, but keep the group's standbys for the
        re-form to claim (a shutdown would stop them too, and every worker would start afresh)."""
        self._heal, self._durable_due = None, False
        if self.group is not None:
            self.group.stop_members()
