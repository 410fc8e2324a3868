"""One job's coordinator: keeps training running while the cluster under it changes.

It holds one state value (service.control.states), which carries the workers the job holds and the plan
they run; the job's lifecycle state is derived from it. `step()` applies the queued commands
(service.control.inbox), then runs the handler of the state's class, which returns the next state: one
transition per step, returned as (previous, next), so tests and the demo advance it deterministically;
`run()` loops until a final state. The handlers ask whether the restart budget is spent
(service.control.failure.give_up) and the scaling policy for a decision (service.control.policy), and
hand the work to three composed parts, each given the workers and plan it acts on and returning the
next state: `reconfigure` carries a decision out from where `choose_source` says the state comes
(service.control.reconfigure), `recovery` deals with a failed group (service.control.recovery, every
decision of it in service.control.failure), and `takeover` with the workers a lost predecessor left
running (service.control.takeover); the training chunks and their bookkeeping
(service.control.progress) stay here. Every move and note goes into the job's journal
(service.control.journal). Methods for the outside (`status`, assembled by service.control.view;
`events_since`, `metrics_since`, `send`) are thread-safe.

Which nodes are usable (watcher minus unresponsive suspects) is service.pool.node_health.NodeHealth; the
worker group is anything that satisfies service.pool.group.Group (`worker_group_cls` is the seam).
docs/recovery.md draws the states and says how each kind of fault is handled.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from parallel.planner import Plan, PlanError, plan, size_for
from service.control.commands import Command
from service.control.drain import DrainLead
from service.control.events import Cause, EventKind
from service.control.failure import Failure, give_up
from service.control.inbox import Inbox
from service.control.job import Job
from service.control.journal import Journal
from service.control.options import CoordinatorOptions
from service.control.policy import Decision, Fail, Noop, PolicyConfig, Resize, ScalingPolicy, Wait
from service.control.progress import Progress
from service.control.reconfiguration import Reconfigs
from service.control.reconfigure import Reconfigure
from service.control.recovery import Ledger, Recovery
from service.control.run_files import job_events
from service.control.state import JobState
from service.control.states import (Adopting, Ended, Paused, Pending, Recovering, Resizing, Running, Starting, State,
                                    Waiting, held)
from service.control.status import JobStatus
from service.control.takeover import Takeover
from service.control.view import job_status
from service.pool.cluster import ClusterSnapshot, ClusterWatcher
from service.pool.group import FailureKind, Group, WorkerFailure
from service.pool.node_health import NodeHealth
from service.pool.placement import assign_nodes, cap_slots, probe_nodes, raylets_refusing
from service.pool.worker_group import WorkerGroup
from workers.config import job_constraints
from workers.report import StepMetrics

S = JobState


class Coordinator:
    worker_group_cls: Callable[..., Group] = WorkerGroup  # seam: tests swap in a fake group

    def __init__(self, job: Job, *, options: CoordinatorOptions | None = None, watcher: ClusterWatcher | None = None):
        self.job = job
        self.cfg, self.job_id, self.run_dir, self.total_steps = job.cfg, job.id, job.run_dir, job.total_steps
        self.model_cfg = self.cfg.model.build()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.opts = options or CoordinatorOptions()
        self.constraints = job_constraints(self.cfg, layout=job.layout)  # a forced layout (request or config) in it
        self.events = job_events(self.run_dir / "events.jsonl", self.job_id)
        self.state: State = Pending(reason="submitted")
        """What the job is doing, and the workers it holds for it (service.control.states)."""
        self.journal = Journal(self.job_id, current=lambda: self.state.name, sink=self.events.append)
        self.policy = ScalingPolicy(self._policy_config(job.min_workers, job.max_workers), size_for=self._size_for,
                                    hold_growth=self._hold_growth)
        self.drain = DrainLead.of(self.cfg.parallel)
        """How long before a drain's deadline the group moves off the noticed node (`_drain_lead`)."""
        self.watcher = watcher or ClusterWatcher(interval_s=self.opts.poll_interval_s)
        self._own_watcher = watcher is None
        self._lock = threading.RLock()
        self.progress = Progress(self._lock, run_dir=self.run_dir)
        """Steps done, the committed step, recent metrics and reconfiguration records."""
        self.inbox = Inbox(self.job_id, journal=self.journal, progress=self.progress, policy=self.policy,
                           policy_config=self._policy_config, state=lambda: self.state, enter=self._enter)
        """The commands sent to the job, and the scheduler's grant (service.control.inbox)."""
        o = self.opts
        self.health = NodeHealth(probe_nodes, probe_timeout_s=o.probe_timeout_s, suspect_seconds=o.suspect_seconds,
                                 reprobe_interval_s=o.reprobe_interval_s, include_head=o.include_head,
                                 refused=raylets_refusing)
        self.recovery = Recovery(cfg=self.cfg, journal=self.journal, progress=self.progress, health=self.health,
                                 watcher=self.watcher, ledger=Ledger(o.restart_window_s))
        self.reconfigure = Reconfigure(cfg=self.cfg, journal=self.journal, progress=self.progress,
                                       watcher=self.watcher, recovery=self.recovery, new_group=self._new_group,
                                       plan_for=self._plan, assign=self._assign)
        self.takeover = Takeover(journal=self.journal, progress=self.progress, health=self.health,
                                 recovery=self.recovery, reconfigure=self.reconfigure, new_group=self._new_group,
                                 run_dir=self.run_dir, detached=o.owner is not None)
        self._handlers: dict[type, Callable[[State, ClusterSnapshot], State]] = {
            Adopting: self._on_adopting, Pending: self._on_pending, Starting: self._start_or_wait,
            Recovering: self._start_or_wait, Waiting: self._start_or_wait, Running: self._on_running,
            Resizing: self._on_resizing, Paused: self._on_paused}
        """One handler per state class; `Ended` has none."""
        self._halted = threading.Event()
        if len(self.events):
            self.state = self.takeover.restarted(self.events.events)

    # -- what the state holds --------------------------------------------------------------------------------
    @property
    def group(self) -> Group | None:
        """The workers the job holds (members, and their spares and standbys), as its state carries them."""
        return held(self.state)

    @property
    def plan(self) -> Plan | None:
        """The plan the job's group runs (None while none is formed)."""
        return self.state.plan if isinstance(self.state, (Running, Resizing)) else None

    @property
    def failures(self) -> tuple[Failure, ...]:
        """The failures the restart budget counts."""
        return self.recovery.ledger.failures

    # -- progress, kept by `self.progress` ------------------------------------------------------------------
    @property
    def step_done(self) -> int:
        return self.progress.step_done

    @step_done.setter
    def step_done(self, step: int) -> None:
        self.progress.step_done = step

    @property
    def committed_step(self) -> int:
        return self.progress.committed_step

    @committed_step.setter
    def committed_step(self, step: int) -> None:
        self.progress.committed_step = step

    @property
    def metrics(self) -> dict[int, StepMetrics]:
        return self.progress.metrics

    @property
    def reconfigs(self) -> Reconfigs:
        return self.progress.reconfigs

    @property
    def group_probe(self):
        """Seam: which nodes still place work, probe(node_ids, timeout_s=) -> set (None: trust the watcher)."""
        return self.health.probe_fn

    @group_probe.setter
    def group_probe(self, fn) -> None:
        self.health.probe_fn = fn

    # -- outside interface (thread-safe) ------------------------------------------------------------------
    def status(self) -> JobStatus:
        with self._lock:
            return job_status(job_id=self.job_id, state=self.state, journal=self.journal, progress=self.progress,
                              policy=self.policy.config, grant=self.grant, queue=self.queue,
                              total_steps=self.total_steps, priority=self.cfg.scheduling.priority,
                              run_dir=self.run_dir, events=len(self.events))

    def events_since(self, index: int = 0) -> list[dict]:
        return [e.to_dict() for e in self.events.since(index)]

    def metrics_since(self, step: int = 0) -> list[dict]:
        with self._lock:
            return [m.to_dict() for m in self.metrics.since(step)]

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self, on_tick=None) -> JobState:
        if self._own_watcher:
            self.watcher.poll()
            self.watcher.start()
        try:
            while not self.state.name.is_terminal and not self._halted.is_set():
                self.step()
                if on_tick is not None:
                    on_tick(self)
            return self.state.name
        finally:
            if self._own_watcher:
                self.watcher.stop()
            if (group := held(self.state)) is not None:
                group.shutdown()

    def halt(self) -> None:
        """End `run()` at the next chance, whatever the state, releasing the group (its process is ending:
        `elastron run` on Ctrl-C). The job's last checkpoint is where the next run resumes."""
        self._halted.set()
        self.inbox.wake()

    def step(self) -> tuple[State, State]:
        """One iteration: apply the queued commands (not while `Adopting`), then, unless a command moved
        the job, the current state's handler. Returns (the state before, the state after)."""
        before = self.state
        if not isinstance(before, Adopting):
            self.inbox.apply_all()
            if self.state.name is not before.name:  # a pause, stop or resume: that is this step's move
                return before, self.state
        handler = self._handlers.get(type(self.state))
        if handler is not None:
            self._enter(handler(self.state, self.watcher.latest or self.watcher.poll()))
        return before, self.state

    def _enter(self, nxt: State) -> None:
        """Make `nxt` the state, recording the move when its name changes (the journal checks that it is
        legal). Workers the old state held that the new one does not are stopped: what the state holds
        is what the job holds."""
        prev = self.state
        if nxt.name is not prev.name:
            layout = nxt.plan.layout if isinstance(nxt, Running) else None
            self.journal.moved(nxt.name, reason=nxt.reason, step=self.step_done, cause=nxt.cause, layout=layout)
        with self._lock:
            self.state = nxt
        if (old := held(prev)) is not None and old is not held(nxt):
            old.shutdown()

    # -- one handler per state -----------------------------------------------------------------------------
    def _on_adopting(self, state: Adopting, snap: ClusterSnapshot) -> State:
        """After a restart: take over the workers the lost coordinator left running (`Takeover.adopt`)."""
        return self.takeover.adopt(state, snap)

    def _on_pending(self, state: Pending, snap: ClusterSnapshot) -> State:
        if self.grant is not None and not self._usable(snap):  # launched by the scheduler, nothing granted yet
            return Waiting(reason=self.queue[1] or "waiting for the shared-cluster scheduler", by_scheduler=True,
                           group=state.group, survivors=state.survivors, record=state.record)
        return Starting(reason="starting", cause=Cause.PLANNED, group=state.group, survivors=state.survivors,
                        record=state.record)

    def _start_or_wait(self, state: Starting | Recovering | Waiting, snap: ClusterSnapshot) -> State:
        """No group runs (STARTING, RECOVERING, WAITING_FOR_CAPACITY, QUEUED): start one as soon as the
        policy allows, from the survivors of a failure if they can form it, else from storage."""
        self._reprobe(snap)  # before starting small or waiting: a suspect may just have been slow
        d = self._decide(snap, current_workers=0)
        if isinstance(d, Fail):
            return self._fail(d.reason)
        if isinstance(d, Resize) and isinstance(state, Waiting):  # capacity is back: start in the next step
            back = Recovering if self.step_done else Starting
            return back(reason=f"capacity is back: {d.reason}", cause=d.cause, group=state.group,
                        survivors=state.survivors, record=state.record)
        if not isinstance(d, (Resize, Wait)):
            return state
        nxt = self.reconfigure.carry_out(d, snap, group=state.group, sound=None, survivors=state.survivors,
                                         cause=d.cause if isinstance(d, Resize) else Cause.FAILURE,
                                         detected=time.time(), record=state.record,
                                         old=state.failed_plan if isinstance(state, Recovering) else None)
        return self._queued(nxt, d) if isinstance(nxt, Waiting) else nxt

    def _queued(self, waiting: Waiting, d: Wait) -> Waiting:
        """A job released before it runs waits for the cluster, or in the scheduler's queue: a job the
        scheduler has given nothing waits there even where the cluster is too small as well (the
        scheduler's reason, "the whole cluster fits 4", and place say why)."""
        self._nap(min(0.2, self.opts.poll_interval_s))
        queued = d.by_scheduler or self.grant == {}
        return replace(waiting, reason=(queued and self.queue[1]) or waiting.reason, by_scheduler=queued)

    def _on_running(self, state: Running, snap: ClusterSnapshot) -> State:
        if self.step_done >= self.total_steps:
            return self._finish(state)
        if self._nodes_dead(snap, state.group):
            return self.recovery.recover(WorkerFailure(FailureKind.NODE_LOST, "a node hosting workers is gone"),
                                         state.group, state.plan)
        d = self._decide(snap, current_workers=state.group.size, requested=state.resize_requested, group=state.group)
        if isinstance(d, Fail):
            return self._fail(d.reason)
        if isinstance(d, Noop) and d.move_at is not None and set(snap.draining()) != state.drains_noted:
            self.journal.note(EventKind.CAPACITY, reason=f"training on: {d.reason}", step=self.step_done,
                              details={"draining": snap.draining(), "move_at": d.move_at})
            state = replace(state, drains_noted=frozenset(snap.draining()))
        if isinstance(d, (Resize, Wait)):
            cause = d.cause if isinstance(d, Resize) else Cause.PREEMPTION if snap.draining() else Cause.FAILURE
            if cause == Cause.PREEMPTION:
                self.journal.note(EventKind.PREEMPTION, reason=d.reason, step=self.step_done, cause=cause,
                                  details={"draining": snap.draining()})
            return Resizing(reason=d.reason, cause=cause, group=state.group, plan=state.plan, decision=d,
                            detected=time.time(), record=state.record)
        if state.record is None:  # a re-formed group's first step goes first: a process start would slow it
            self._prewarm(snap, state.group)
        return self._train_chunk(replace(state, resize_requested=False))

    def _on_resizing(self, state: Resizing, snap: ClusterSnapshot) -> State:
        """The sound group changes as decided: live, or through a checkpoint, or it is released."""
        sound = state.plan if state.group.size else None
        return self.reconfigure.carry_out(state.decision, snap, group=state.group, sound=sound, survivors=None,
                                          cause=state.cause, detected=state.detected, record=state.record,
                                          old=state.plan)

    def _on_paused(self, state: Paused, snap: ClusterSnapshot) -> Paused:
        self._nap(0.05)  # a command moves it on
        return state

    # -- what the handlers do ------------------------------------------------------------------------------
    def _decide(self, snap: ClusterSnapshot, *, current_workers: int, requested: bool = False,
                group: Group | None = None) -> Decision:
        """The policy's decision on what the cluster offers now; `group`: the running group, whose workers
        on draining nodes must leave them (by `_drain_lead` before the earliest deadline)."""
        c = self.policy.config
        if why := give_up(self.failures, now=time.time(), max_restarts=c.max_restarts, window_s=c.restart_window_s):
            return Fail(why)
        r = self.cfg.resources
        fits = sum(self.health.slots(snap, r.cpus_per_worker, r.gpus_per_worker).values())  # the grant aside
        no_gpu = r.gpus_per_worker and not any(n.gpus for n in snap.alive())
        why = (f"each worker needs {r.gpus_per_worker:g} GPU (resources.gpus_per_worker) and the cluster has "
               "none; use a cluster with GPUs, or resources.device: cpu" if no_gpu else "")
        draining = snap.draining()
        leaving = None if group is None else sum(n for node, n in group.nodes().items() if node in draining)
        return self.policy.decide(time.time(), current_workers=current_workers, usable_workers=fits,
                                  draining=draining,
                                  granted=None if self.grant is None else self._usable(snap), requested=requested,
                                  short_because=why, leaving=leaving, drain_lead_s=self._drain_lead())

    def _drain_lead(self) -> float | None:
        """How long before a drain's deadline the group starts moving off its node (service.control.drain),
        from what this job measured: the longest training call between two decisions (the last step, or
        the chunk when longer: `_train_chunk` returns within the larger of the two) and the last live move's
        hand-over and transfer (with `reshard: storage` none is measured: the assumed move)."""
        last = self.metrics.get(self.step_done)
        call_s = max(self.opts.chunk_seconds, last.step_time if last and last.step_time else 0.0)
        move_s = self.progress.last_move_off_s() if self.cfg.parallel.reshard == "live" else None
        return self.drain.lead_s(call_s=call_s, move_s=move_s)

    def _prewarm(self, snap: ClusterSnapshot, group: Group) -> None:
        """While a growth settles, start the workers it will need on the new nodes (they warm up while
        the group trains: the growth waits for them, `_hold_growth`); then keep standby workers beside
        the members and on a node the job may use but does not (`Group.keep_standby`)."""
        if (pending := self.policy.pending_growth) is not None and (extra := self._joiners(pending[0], snap, group)):
            if started := group.prewarm(extra):
                self.journal.note(EventKind.CAPACITY, reason=f"starting {started} worker(s) to warm up for the "
                                                             f"growth to {pending[0]} while the group trains",
                                  step=self.step_done, details={"nodes": sorted(set(extra))})
        group.keep_standby(self._slots(snap), cap=self.inbox.standby_cap)

    def _joiners(self, workers: int, snap: ClusterSnapshot | None, group: Group | None) -> list[str]:
        """The node of each worker a growth of `group` to `workers` adds (none if it cannot be planned)."""
        if group is None or snap is None:
            return []
        try:
            nodes = self._assign(self._plan(workers), snap, group.nodes())
        except (PlanError, ValueError):
            return []
        return list((Counter(nodes) - group.nodes()).elements())

    def _hold_growth(self, workers: int) -> str:
        """The policy's question before a settled growth to `workers`: why wait longer, the group training
        on meanwhile? While the workers it adds have not started and warmed up on their nodes
        (`Group.warm`), and while a periodic checkpoint save is still being written (the hand-over would
        wait for it with the whole group stopped). "" once neither holds, or once the growth has waited
        `start_timeout_s` (the start then deals with a worker that never came up)."""
        pending = self.policy.pending_growth
        group = held(self.state)
        if group is None or (pending is not None and time.time() - pending[1] >= self.opts.start_timeout_s):
            return ""
        if not group.warm(self._joiners(workers, self.watcher.latest, group)):
            return "its joining workers start and warm up"
        every = self.cfg.checkpoint.interval_steps
        if (saving := self.step_done - self.step_done % every) > self.committed_step:
            return f"the checkpoint of step {saving} is written"
        return ""

    def _train_chunk(self, state: Running) -> State:
        try:
            trained = state.group.run(until_step=self.total_steps,
                                      steps=self.progress.steps_per_call(self.opts.chunk_seconds),
                                      should_abort=lambda: self._halted.is_set() or
                                      self._nodes_dead(self.watcher.latest, state.group))
        except WorkerFailure as e:
            return state if self._halted.is_set() else self.recovery.recover(e, state.group, state.plan)
        rows = self.progress.trained(trained)
        if not rows or state.record is None:
            return state
        self.progress.closed(state.record, rows[0])
        if state.durable_due:  # after a live move: the fallback checkpoint, now that it trains
            return self._durable_checkpoint(replace(state, record=None, durable_due=False))
        return replace(state, record=None)

    def _policy_config(self, lo: int, hi: int) -> PolicyConfig:
        return PolicyConfig(min_workers=lo, max_workers=hi, settle_seconds=self.opts.settle_seconds,
                            max_restarts=self.opts.max_restarts, restart_window_s=self.opts.restart_window_s)

    def _plan(self, workers: int) -> Plan:
        return plan(workers, self.model_cfg, replace(self.constraints, min_workers=1, max_workers=workers))

    def _size_for(self, offered: int) -> int | None:
        return size_for(offered, self.model_cfg, self.constraints)

    def _reprobe(self, snap: ClusterSnapshot) -> None:
        if back := self.health.reprobe(snap):
            self.journal.note(EventKind.CAPACITY, reason=f"{len(back)} node(s) place work again after a failed "
                                                         f"probe: {', '.join(n[:8] for n in sorted(back))}",
                              step=self.step_done, details={"nodes": sorted(back)})

    def _slots(self, snap: ClusterSnapshot) -> dict[str, int]:
        r = self.cfg.resources
        return cap_slots(self.health.slots(snap, r.cpus_per_worker, r.gpus_per_worker), self.grant)

    def _usable(self, snap: ClusterSnapshot) -> int:
        return sum(self._slots(snap).values())

    def _assign(self, p: Plan, snap: ClusterSnapshot, prefer: Counter | None) -> list[str]:
        """Node of each rank of plan `p`, keeping the members `prefer` counts ({node: members}) where they are."""
        return assign_nodes(p.world_size, self._slots(snap), prefer=prefer, tp=p.layout.tp)

    @staticmethod
    def _nodes_dead(snap: ClusterSnapshot | None, group: Group) -> bool:
        return NodeHealth.any_gone(snap, group.nodes())

    # -- commands: what the user and the scheduler may ask, from any thread ----------------------------
    def send(self, cmd: Command) -> None:
        """Queue `cmd` for the next step (`Inbox.send`: a resize is checked now, CommandError naming the field)."""
        self.inbox.send(cmd)

    @property
    def grant(self) -> dict[str, int] | None:
        """{node_id: workers} the shared-cluster scheduler grants this job; None: the whole cluster."""
        return self.inbox.grant

    @grant.setter
    def grant(self, nodes: dict[str, int] | None) -> None:
        self.inbox.grant = nodes

    @property
    def queue(self) -> tuple[int | None, str]:
        """(place, reason) the scheduler gave with a grant too small to start on (shown while QUEUED)."""
        return self.inbox.queue

    def _nap(self, seconds: float) -> None:
        self.inbox.nap(seconds)

    def _durable_checkpoint(self, state: Running) -> State:
        """After the first step at a layout formed from live state: a durable checkpoint in the background
        (it stages during the next step and commits while training goes on), so a later failure has a
        fallback. Not before that first step, which on a busy worker it would slow down."""
        try:
            step = state.group.checkpoint(blocking=False)
        except WorkerFailure as e:
            return self.recovery.recover(e, state.group, state.plan)
        self.journal.note(EventKind.CHECKPOINT, reason=f"durable checkpoint of step {step} under "
                                                       f"{state.plan.layout} writing in the background", step=step)
        return state

    def _new_group(self) -> Group:
        o, r = self.opts, self.cfg.resources
        return self.worker_group_cls(self.cfg, str(self.run_dir), cpus_per_worker=r.cpus_per_worker,
                                     gpus_per_worker=r.gpus_per_worker, job_id=self.job_id,
                                     start_timeout_s=o.start_timeout_s, start_probe_s=o.reprobe_interval_s,
                                     probe_timeout_s=o.probe_timeout_s, owner=o.owner, namespace=o.namespace)

    def _finish(self, state: Running) -> State:
        if state.record is not None:  # re-formed at the last step: no step left to close its record with
            self.reconfigs.append(state.record)
        try:
            self.committed_step = state.group.checkpoint()
        except WorkerFailure as e:
            return self.recovery.recover(e, state.group, state.plan)
        return Ended(final=S.SUCCEEDED, reason=f"reached step {self.total_steps}")  # `_enter` stops the group

    def _fail(self, reason: str) -> Ended:
        return Ended(final=S.FAILED, reason=reason)  # `_enter` stops the group
