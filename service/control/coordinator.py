"""One job's coordinator: keeps training running while the cluster under it changes.

It holds one state value (service.control.states) and the resources that outlive a state (the worker
group, the plan it runs). `step()` applies the queued commands, then runs the handler of the state's
class, which returns the next state: one transition per step, returned as (previous, next), so tests
and the demo advance it deterministically; `run()` loops until a final state. The handlers ask the
scaling policy for a decision (service.control.policy) and `choose_source` (service.control.source)
where the next group's state comes from. Methods for the outside (`status`, `events_since`,
`metrics_since`, `resize`, `pause`, `resume`, `stop`, `set_grant`) are thread-safe: commands
(service.control.commands) are queued and applied at the start of the next step.

Which nodes are usable (watcher minus unresponsive suspects) is service.pool.node_health.NodeHealth; the
worker group is anything that satisfies service.pool.group.Group (`worker_group_cls` is the seam).
docs/recovery.md draws the states and says how each kind of fault is handled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from parallel.peers import cover
from parallel.planner import Plan, PlanError, plan, size_for
from service.control.commands import Command, Grant, Pause, Resume, SetWorkers, Stop
from service.control.failure import During, Facts, Response, classify, live_gap, respond
from service.control.job import Job
from service.control.options import CoordinatorOptions
from service.control.policy import FINAL_KINDS, Decision, Fail, Failure, PolicyConfig, Resize, ScalingPolicy, Wait
from service.control.progress import Progress
from service.control.reconfiguration import Reconfig, Reconfigs
from service.control.run_files import job_events, last_plan, where_it_stopped
from service.control.source import Heal, Memory, Release, Restore, Survivors, choose_source, from_survivors
from service.control.state import JobState, StateMachine
from service.control.states import (Adopting, Ended, Paused, Pending, Recovering, Resizing, Running, Starting, State,
                                    Waiting)
from service.control.status import JobStatus
from service.pool.cluster import ClusterSnapshot, ClusterWatcher
from service.pool.group import CarriedOn, FailureKind, Group, WorkerFailure
from service.pool.node_health import NodeHealth
from service.pool.placement import assign_nodes, cap_slots, probe_nodes, raylets_refusing
from service.pool.worker_group import WorkerGroup
from workers.config import job_constraints

logger = logging.getLogger(__name__)
S = JobState


_RESTARTS = (FailureKind.COORDINATOR_RESTARTED, "coordinator_restart")
"""How an earlier coordinator's restart is named in the job's events (the second: before FailureKind)."""


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
        self.sm = StateMachine(self.job_id, sink=self.events.append)
        self.policy = ScalingPolicy(self._policy_config(job.min_workers, job.max_workers), size_for=self._size_for,
                                    hold_growth=self._hold_growth)
        self.watcher = watcher or ClusterWatcher(interval_s=self.opts.poll_interval_s)
        self._own_watcher = watcher is None
        self.group: Group | None = None
        """The workers the job holds: members, and their spares and standbys."""
        self.plan: Plan | None = None
        """The plan the group was formed for (kept through a failure: what a salvage checks against)."""
        self._lock = threading.RLock()
        self.progress = Progress(self._lock)
        """Steps done, the committed step, recent metrics and reconfiguration records."""
        self.failures: list[Failure] = []
        self._commands: queue.Queue[Command] = queue.Queue()
        self._woken = threading.Event()
        self.grant: dict[str, int] | None = None
        """{node_id: workers} the shared-cluster scheduler grants this job (service.sharing.scheduler); None: the
        whole cluster. Assign a new dict to change it: placement and the policy read it each iteration."""
        self.queue: tuple[int | None, str] = (None, "")
        """(place, reason) the scheduler gave with a grant too small to start on (shown while QUEUED)."""
        o = self.opts
        self.health = NodeHealth(probe_nodes, probe_timeout_s=o.probe_timeout_s, suspect_seconds=o.suspect_seconds,
                                 reprobe_interval_s=o.reprobe_interval_s, include_head=o.include_head,
                                 refused=raylets_refusing)
        self._handlers: dict[type, Callable[[State, ClusterSnapshot], State]] = {
            Adopting: self._on_adopting, Pending: self._on_pending, Starting: self._start_or_wait,
            Recovering: self._start_or_wait, Waiting: self._start_or_wait, Running: self._on_running,
            Resizing: self._on_resizing, Paused: self._on_paused}
        """One handler per state class; `Ended` has none."""
        self._halted = threading.Event()
        self.state: State = self._restarted() if len(self.events) else Pending()

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
    def metrics(self) -> dict[int, dict]:
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

    def _restarted(self) -> Adopting | Pending:
        """This job's events are already in the run directory: an earlier coordinator of the same job
        died (its actor was restarted by Ray, or the job was started again by hand). Workers it started
        detached (`opts.owner`) outlive it: the first step takes them over (`Adopting`); else, or for
        what cannot heal, the next group resumes from the last committed checkpoint. This
        reconfiguration is recorded as a failure whose steps lost run from the last step the old group
        logged."""
        prior = self.events.events
        last_step, last_state, layout = where_it_stopped(prior, self.run_dir)
        adopt = self.opts.owner is not None
        how = ("taking over the workers it left running, else resuming from the last committed checkpoint"
               if adopt else "resuming from the last committed checkpoint")
        why = (f"the coordinator restarted (its previous process was lost in state {last_state} at step "
               f"{last_step}); {how}")
        # The earlier restarts count too (Ray restarts the actor any number of times; the policy's budget,
        # max_restarts within restart_window_s as for every failure kind, is what ends a crash loop).
        self.failures.extend(Failure(time=e.time, kind=FailureKind.COORDINATOR_RESTARTED, error=e.reason or "")
                             for e in prior if e.kind == "failure" and (e.details or {}).get("kind") in _RESTARTS)
        self.failures.append(Failure(time=time.time(), kind=FailureKind.COORDINATOR_RESTARTED, error=why))
        self.sm.note("failure", reason=why, step=last_step, cause="failure",
                     details={"kind": FailureKind.COORDINATOR_RESTARTED, "previous_events": len(prior)})
        record = Reconfig(cause="failure", detected=time.time(), step_before=last_step, old_layout=layout)
        if adopt:
            return Adopting(reason=why, lost=Plan.from_dict(d) if (d := last_plan(prior)) else None, record=record)
        return Pending(reason=why, record=record)

    # -- outside interface (thread-safe) ------------------------------------------------------------------
    def status(self) -> JobStatus:
        with self._lock:
            last = self.metrics.get(self.step_done, {})
            sm = self.sm.snapshot()
            # Layout and world size from one plan, the one the group runs (set under this lock once the
            # group has formed): never a new layout with the old size, or the size of a group half re-formed.
            # (RECOVERING: a failed group's survivors may still be held, but they run no layout)
            running = self.group is not None and self.plan is not None and self.sm.state is not S.RECOVERING
            causes, lost = self.reconfigs.totals()
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
                run_dir=str(self.run_dir), reconfigurations=causes, steps_lost=lost, events=len(self.events))

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
            while not self.sm.state.is_terminal and not self._halted.is_set():
                self.step()
                if on_tick is not None:
                    on_tick(self)
            return self.sm.state
        finally:
            if self._own_watcher:
                self.watcher.stop()
            self._shutdown_group()

    def halt(self) -> None:
        """End `run()` at the next chance, whatever the state, releasing the group (its process is ending:
        `elastron run` on Ctrl-C). The job's last checkpoint is where the next run resumes."""
        self._halted.set()
        self._woken.set()

    def step(self) -> tuple[State, State]:
        """One iteration: apply the queued commands (not while `Adopting`), then, unless a command moved
        the job, the current state's handler. Returns (the state before, the state after)."""
        before = self.state
        if not isinstance(before, Adopting):
            self._apply_commands()
            if self.state.name is not before.name:  # a pause, stop or resume: that is this step's move
                return before, self.state
        handler = self._handlers.get(type(self.state))
        if handler is not None:
            self._enter(handler(self.state, self.watcher.latest or self.watcher.poll()))
        return before, self.state

    def _enter(self, nxt: State) -> None:
        """Make `nxt` the state, recording the move when its name changes."""
        if nxt.name is not self.state.name:
            layout = self.plan.layout if isinstance(nxt, Running) and self.plan is not None else None
            self.sm.transition(nxt.name, reason=nxt.reason, step=self.step_done, cause=nxt.cause, layout=layout)
        with self._lock:
            self.state = nxt

    # -- one handler per state -----------------------------------------------------------------------------
    def _on_adopting(self, state: Adopting, snap: ClusterSnapshot) -> Pending | Running:
        """After a restart: the workers the lost coordinator left running (`Group.adopt`) become this
        one's group. If they still are the training group of its last plan, every rank sound and at one
        step, that group trains on as it is (`Group.carry_on`: nothing re-formed, no state moved). Else,
        if between them they hold every shard of that plan at one step, the next group heals from them;
        else they stay as warm processes for the resume from storage (so do those of a job that
        reshards through storage, and those started before the lost coordinator formed any group)."""
        self.health.sweep(snap)  # nodes that died with (or before) the lost coordinator: not planned onto
        pending = Pending(reason=state.reason, cause=state.cause, record=state.record)
        group = self._new_group()
        found = group.adopt()
        if not found:
            return pending
        self.group = group
        record = state.record
        self.step_done = max(self.step_done, record.step_before if record is not None else 0)
        self.sm.note("info", reason=f"took over {found} worker(s) the previous coordinator left running",
                     step=self.step_done, details={"adopted": found, "nodes": dict(group.nodes())})
        if state.lost is None:
            return pending
        gone = self.health.gone(snap, sorted(group.nodes()))
        if not gone:
            standing = group.carry_on(state.lost)
            if standing.step is not None:
                return self._carried_on(state.lost, standing, record)
            self.sm.note("info", reason=f"the workers taken over cannot train on as they are: {standing.why}",
                         step=self.step_done)
        self.plan = state.lost  # what `_salvage` checks their shards against
        response = respond(self._facts(FailureKind.COORDINATOR_RESTARTED, During.TAKEOVER))
        if not response.salvage:
            self.plan = None
            return pending
        survivors, kept = self._salvage(gone, response)
        self.plan = None  # no layout runs until the next group forms
        if survivors is not None and record is not None:
            # the workers may have finished a step the lost coordinator never recorded (their metrics
            # came back with the salvage): the heal moves from there, not from its last recorded step
            record.step_before = self.step_done
        if not kept:
            self._drop_members(gone)
        return replace(pending, survivors=survivors)

    def _carried_on(self, p: Plan, kept: CarriedOn, record: Reconfig | None) -> Running:
        """The group the lost coordinator formed for `p` trains on from the step its workers are at (the
        metrics of steps they finished after that coordinator died came back with `kept`)."""
        self.progress.recovered(kept.rows, at=self.step_done, committed=kept.committed_step)
        if record is not None:
            record.step_before = kept.step
        return self._formed(p, p.layout.to_dict(), kept.step, 0, 0, cause="failure", detected=time.time(),
                            reason="the workers the previous coordinator left training train on as they are",
                            record=record, transfer={"path": "in place"})

    def _on_pending(self, state: Pending, snap: ClusterSnapshot) -> State:
        if self.grant is not None and not self._usable(snap):  # launched by the scheduler, nothing granted yet
            return Waiting(reason=self.queue[1] or "waiting for the shared-cluster scheduler", by_scheduler=True,
                           survivors=state.survivors, record=state.record)
        return Starting(reason="starting", cause="planned", survivors=state.survivors, record=state.record)

    def _start_or_wait(self, state: Starting | Recovering | Waiting, snap: ClusterSnapshot) -> State:
        """No group runs (STARTING, RECOVERING, WAITING_FOR_CAPACITY, QUEUED): start one as soon as the
        policy allows, from the survivors of a failure if they can heal it, else from storage."""
        self._reprobe(snap)  # before starting small or waiting: a suspect may just have been slow
        d = self._decide(snap, current_workers=0)
        if isinstance(d, Fail):
            return self._fail(d.reason)
        if isinstance(d, Resize) and isinstance(state, Waiting):  # capacity is back: start in the next step
            back = Recovering if self.step_done else Starting
            return back(reason=f"capacity is back: {d.reason}", cause=d.cause, survivors=state.survivors,
                        record=state.record)
        if not isinstance(d, (Resize, Wait)):
            return state
        return self._reconfigure(d, snap, sound=None, survivors=state.survivors, cause=d.cause if isinstance(d, Resize)
                                 else "failure", detected=time.time(), record=state.record, resizing=False)

    def _on_running(self, state: Running, snap: ClusterSnapshot) -> State:
        if self.step_done >= self.total_steps:
            return self._finish(state)
        if self._our_nodes_dead(snap):
            return self._recover(WorkerFailure(FailureKind.NODE_LOST, "a node hosting workers is gone"))
        d = self._decide(snap, current_workers=self.group.size, requested=state.resize_requested)
        if isinstance(d, Fail):
            return self._fail(d.reason)
        if isinstance(d, (Resize, Wait)):
            cause = d.cause if isinstance(d, Resize) else "preemption" if snap.draining() else "failure"
            if cause == "preemption":
                self.sm.note("preemption", reason=d.reason, step=self.step_done, cause=cause,
                             details={"draining": snap.draining()})
            return Resizing(reason=d.reason, cause=cause, decision=d, detected=time.time(), record=state.record)
        if state.record is None:  # a re-formed group's first step goes first: a process start would slow it
            self._prewarm(snap)
        return self._train_chunk(replace(state, resize_requested=False))

    def _on_resizing(self, state: Resizing, snap: ClusterSnapshot) -> State:
        """The sound group changes as decided: live, or through a checkpoint, or it is released."""
        sound = self.plan if self.group is not None and self.group.size else None
        return self._reconfigure(state.decision, snap, sound=sound, survivors=None, cause=state.cause,
                                 detected=state.detected, record=state.record, resizing=True)

    def _on_paused(self, state: Paused, snap: ClusterSnapshot) -> Paused:
        self._nap(0.05)  # a command moves it on
        return state

    # -- what the handlers do ------------------------------------------------------------------------------
    def _decide(self, snap: ClusterSnapshot, *, current_workers: int, requested: bool = False) -> Decision:
        r = self.cfg.resources
        fits = sum(self.health.slots(snap, r.cpus_per_worker, r.gpus_per_worker).values())  # the grant aside
        no_gpu = r.gpus_per_worker and not any(n.gpus for n in snap.alive())
        why = (f"each worker needs {r.gpus_per_worker:g} GPU (resources.gpus_per_worker) and the cluster has "
               "none; use a cluster with GPUs, or resources.device: cpu" if no_gpu else "")
        return self.policy.decide(time.time(), current_workers=current_workers, usable_workers=fits,
                                  draining=snap.draining(), failures=self.failures,
                                  granted=None if self.grant is None else self._usable(snap), requested=requested,
                                  short_because=why)

    def _prewarm(self, snap: ClusterSnapshot) -> None:
        """While a growth settles, start the workers it will need on the new nodes (they warm up while
        the group trains: the growth waits for them, `_hold_growth`); then keep standby workers beside
        the members and on a node the job may use but does not (`Group.keep_standby`)."""
        if (pending := self.policy.pending_growth) is not None and (extra := self._joiners(pending[0], snap)):
            if started := self.group.prewarm(extra):
                self.sm.note("capacity", reason=f"starting {started} worker(s) to warm up for the growth to "
                                                f"{pending[0]} while the group trains", step=self.step_done,
                             details={"nodes": sorted(set(extra))})
        self.group.keep_standby(self._slots(snap))

    def _joiners(self, workers: int, snap: ClusterSnapshot | None) -> list[str]:
        """The node of each worker a growth to `workers` adds (none if it cannot be planned)."""
        if self.group is None or snap is None:
            return []
        try:
            nodes = self._assign(self._plan(workers), snap)
        except (PlanError, ValueError):
            return []
        return list((Counter(nodes) - self.group.nodes()).elements())

    def _hold_growth(self, workers: int) -> str:
        """The policy's question before a settled growth to `workers`: why wait longer, the group training
        on meanwhile? While the workers it adds have not started and warmed up on their nodes
        (`Group.warm`), and while a periodic checkpoint save is still being written (the hand-over would
        wait for it with the whole group stopped). "" once neither holds, or once the growth has waited
        `start_timeout_s` (the start then deals with a worker that never came up)."""
        pending = self.policy.pending_growth
        if self.group is None or (pending is not None and time.time() - pending[1] >= self.opts.start_timeout_s):
            return ""
        if not self.group.warm(self._joiners(workers, self.watcher.latest)):
            return "its joining workers start and warm up"
        every = self.cfg.checkpoint.interval_steps
        if (saving := self.step_done - self.step_done % every) > self.committed_step:
            return f"the checkpoint of step {saving} is written"
        return ""

    def _train_chunk(self, state: Running) -> State:
        try:
            rows = self.group.run(until_step=self.total_steps, steps=self.progress.steps_per_call(self.opts.chunk_seconds),
                                  should_abort=lambda: self._halted.is_set() or self._our_nodes_dead(self.watcher.latest))
        except WorkerFailure as e:
            return state if self._halted.is_set() else self._recover(e)
        self.progress.trained(rows)
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
    def send(self, cmd: Command) -> None:
        """Queue `cmd` for the next step. A resize is checked now against the range as it stands
        (CommandError naming the field), and applied to the range current then, so that a second resize
        composes with the first."""
        if isinstance(cmd, SetWorkers):
            self._policy_config(*cmd.bounds(self.policy.config.min_workers, self.policy.config.max_workers))
        self._enqueue(cmd)

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
        """Apply one command; False to keep it for a later step."""
        match cmd:
            case SetWorkers():
                try:
                    self.policy.config = self._policy_config(*cmd.bounds(self.policy.config.min_workers,
                                                                         self.policy.config.max_workers))
                except ValueError as e:  # valid alone, not on top of an earlier resize: say so, keep going
                    self.sm.note("failure", reason=f"resize refused: {e}", step=self.step_done, cause="user")
                    return True
                if isinstance(self.state, Running):  # act now: a user's request needs no settle time
                    self._enter(replace(self.state, resize_requested=True))
            case Grant():
                told = (cmd.nodes, cmd.reason, cmd.queue_position)
                if told != (self.grant, *self.queue):
                    self.sm.note("schedule", reason=cmd.reason, step=self.step_done,
                                 details={"grant": cmd.nodes, "queue_position": cmd.queue_position})
                self.grant, self.queue = dict(cmd.nodes), (cmd.queue_position, cmd.reason)
            case Pause() | Stop():
                return self._park(cmd)
            case Resume() if isinstance(self.state, Paused):
                self._enter(Starting(reason=f"resume requested by {cmd.by}", cause=cmd.by))
        return True

    def _park(self, cmd: Pause | Stop) -> bool:
        """Checkpoint, release the workers, and move to PAUSED or STOPPED; False (kept for later) where
        the lifecycle has no such move yet (e.g. a pause while STARTING: applied once it runs)."""
        kind, target = ("pause", S.PAUSED) if isinstance(cmd, Pause) else ("stop", S.STOPPED)
        if self.sm.state.is_terminal or self.sm.state is target:
            return True
        if not self.sm.can(target):
            return False
        by = cmd.by if isinstance(cmd, Pause) else "user"
        lost = None
        if self.group is not None and self.group.size:  # a group without members has nothing to save
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
        why += f", but {lost}" if lost else ""
        self._enter(Paused(reason=why, cause=by) if target is S.PAUSED else Ended(final=target, reason=why, cause=by))
        return True

    # -- changing the group ----------------------------------------------------------------------------------
    def _reconfigure(self, d: Resize | Wait, snap: ClusterSnapshot, *, sound: Plan | None, survivors: Survivors | None,
                     cause: str, detected: float, record: Reconfig | None, resizing: bool) -> State:
        """Act on a decision to change the group, from where `choose_source` says its state comes.
        `sound`: the plan of a running group that holds all its state (a planned change); `survivors`:
        a failed group's, when they can heal it; `record`: the reconfiguration under way, if any."""
        source = choose_source(decision=d, sound=sound, survivors=survivors, reshard=self.cfg.parallel.reshard)
        if isinstance(source, (Restore, Release)) and source.flush:
            try:
                self.committed_step = self.group.checkpoint()
                self.sm.note("checkpoint", reason=f"flushed at step {self.committed_step} before resize",
                             step=self.committed_step, cause=cause)
            except WorkerFailure as e:  # e.g. the draining node died before the save finished: fall back
                return self._recover(e)
        snap = self.watcher.latest or snap
        if isinstance(source, Release):
            return self._release(d, healing=survivors is not None, record=record, resizing=resizing)
        try:
            p = self._plan(d.workers)
            nodes = self._assign(p, snap)
        except (PlanError, ValueError) as e:
            return self._fail(f"cannot plan {d.workers} workers: {e}")
        if isinstance(source, Restore):
            return self._restore(p, nodes, cause=cause, reason=d.reason, detected=detected, record=record)
        if isinstance(source, Memory):
            return self._move_live(source.old, p, nodes, survivors=sorted({s for _, s in source.serve}),
                                   memory=source, cause=cause, reason=d.reason, detected=detected, record=record)
        return self._move_live(source.old, p, nodes, survivors=list(source.ranks) if isinstance(source, Heal) else None,
                               cause=cause, reason=d.reason, detected=detected, record=record)

    def _release(self, d: Wait, *, healing: bool, record: Reconfig | None, resizing: bool) -> Waiting:
        """Hold no worker while the job waits (`healing`: survivors that could have healed are let go)."""
        if healing:
            self.sm.note("fallback", reason=f"{d.reason}: the surviving workers are released; the job will resume "
                                            f"from the last committed checkpoint (step {self.committed_step})",
                         step=self.step_done, cause="failure")
        self._shutdown_group()
        if resizing:  # a planned change to nothing: it waits for capacity
            return Waiting(reason=d.reason, record=record)
        self._nap(min(0.2, self.opts.poll_interval_s))
        # A job the scheduler has given nothing waits in its queue, even where the cluster is too small as
        # well: the scheduler's reason ("the whole cluster fits 4") and place say why.
        queued = d.by_scheduler or self.grant == {}
        return Waiting(reason=(queued and self.queue[1]) or d.reason, by_scheduler=queued, record=record)

    def _move_live(self, old: Plan, p: Plan, nodes: list[str], *, survivors: list[int] | None, cause: str,
                   reason: str, detected: float, record: Reconfig | None, memory: Memory | None = None) -> State:
        """Reshard live from `old` (all its ranks, or after a failure the `survivors` a salvage kept, or
        their peer snapshots: `memory`) to `p` on `nodes`; a durable checkpoint of the new layout
        follows its first step. A transfer that fails midway asks the survivors for the old group's
        peer snapshots (they outlive the transfer: `_recover` salvages), or, with snapshots off, falls
        back to the last committed checkpoint; the events say which."""
        try:
            if memory is not None:
                moved = self.group.reshard(old, p, nodes, survivors=survivors, serve=dict(memory.serve),
                                           snapshot_step=memory.step)
            else:
                moved = self.group.reshard(old, p, nodes, survivors=survivors)
        except WorkerFailure as e:
            if respond(self._facts(e.kind, During.TRANSFER)).salvage:  # peer snapshots outlive the transfer
                self.sm.note("failure", reason=f"the state transfer failed ({e}); asking the survivors for "
                                               f"the peer snapshots they hold", step=self.step_done, cause=cause,
                             details={"kind": e.kind})
            else:
                self.sm.note("fallback", reason=f"live state transfer failed ({e}); falling back to the last "
                                                f"committed checkpoint (step {self.committed_step})",
                             step=self.step_done, cause=cause, details={"kind": e.kind})
            return self._recover(e, tried=nodes, during=During.TRANSFER)
        mib = moved.bytes_moved / 2**20
        how, path = (("moved live", "live") if survivors is None else
                     (f"healed from surviving ranks {survivors}", "peers") if memory is None else
                     (f"formed from the peer snapshots of step {memory.step} that ranks {survivors} hold", "memory"))
        extra = {"snapshot_step": memory.step} if memory is not None else {}
        running = self._formed(p, old.layout.to_dict(), moved.step, moved.started, moved.stopped, cause=cause,
                               detected=detected, record=record,
                               reason=f"{reason}; {mib:.0f} MiB of state {how} in {moved.transfer_s:.2f}s",
                               transfer={"path": path, **extra, **moved.record()})
        return replace(running, durable_due=True)

    def _durable_checkpoint(self, state: Running) -> State:
        """After the first step at a layout formed from live state: a durable checkpoint in the background
        (it stages during the next step and commits while training goes on), so a later failure has a
        fallback. Not before that first step, which on a busy worker it would slow down."""
        try:
            step = self.group.checkpoint(blocking=False)
        except WorkerFailure as e:
            return self._recover(e)
        self.sm.note("checkpoint", reason=f"durable checkpoint of step {step} under {self.plan.layout} writing "
                                          "in the background", step=step)
        return state

    def _new_group(self) -> Group:
        o, r = self.opts, self.cfg.resources
        return self.worker_group_cls(self.cfg, str(self.run_dir), cpus_per_worker=r.cpus_per_worker,
                                     gpus_per_worker=r.gpus_per_worker, job_id=self.job_id,
                                     start_timeout_s=o.start_timeout_s, start_probe_s=o.reprobe_interval_s,
                                     probe_timeout_s=o.probe_timeout_s, owner=o.owner, namespace=o.namespace)

    def _facts(self, kind: FailureKind, during: During) -> Facts:
        """What the failure policy (service.control.failure.respond) decides from, besides the kind."""
        g = self.group
        return Facts(kind=kind, during=during, live_reshard=self.cfg.parallel.reshard == "live",
                     holds_group=g is not None and self.plan is not None and g.size > 0,
                     snapshots=self.cfg.checkpoint.peer_interval > 0)

    def _salvage(self, gone: set[str], response: Response, *,
                 dead: Callable[[], set[str]] = set) -> tuple[Survivors | None, bool]:
        """After a failure without notice: keep the surviving workers and their state when, between them,
        they hold every shard at one step (data-parallel replicas), so the group heals from peers; else
        when their peer snapshots hold every shard of one snapshot step (`parallel.peers.cover`), so the
        group is formed from those (`from_survivors` judges); else say why: the job falls back to the
        last committed checkpoint, and the survivors stay in the group as warm processes for that
        re-form to reuse (each has left the failed group and dropped its trainer; one whose save was
        still running is stopped instead). Returns (the
        survivors to heal from or None, whether any worker is kept). `gone`: nodes the watcher lists
        as dead (their workers are not asked); `response`: the failure policy's answer (whether to
        salvage, abort first, how long to wait, which of the survivors' offers count); `dead`: see
        `Group.salvage`."""
        g, p = self.group, self.plan
        if not response.salvage or g is None or p is None or not g.size:
            return None, False
        salvage = g.salvage(gone=gone, dead=dead, abort=response.abort, timeout_s=response.patience_s)
        infos = {r: i for r, i in salvage.kept.items() if i.held}  # live shards (the others: snapshots only)
        steps = {i.step for i in infos.values()}
        rows = max((i.rows for i in infos.values()), key=len, default=())
        why = (live_gap(p.layout, salvage.kept, last_step=self.step_done) if response.heal else
               "the live state went with the transfer that failed")
        copies = {r: i.snapshots for r, i in salvage.kept.items() if i.snapshots}
        memory = cover(p.layout, copies) if copies or response.memory else None
        source = from_survivors(p, live=None if why else tuple(sorted(infos)), memory=memory)
        stopped = {"stopped": list(salvage.stopped_why)} if salvage.stopped_why else {}
        if isinstance(source, str):
            self.sm.note("fallback", reason=f"cannot heal from the surviving workers: {why}; {source}; resuming "
                                            f"from the last committed checkpoint (step {self.committed_step})",
                         step=self.step_done, cause="failure",
                         details={"warm_workers": g.size + salvage.idle, "snapshots": {str(r): list(s) for r, s in
                                                                                       copies.items()}, **stopped})
            return None, g.size + salvage.idle > 0
        if isinstance(source, Memory):
            self.progress.recovered(rows, at=max([self.step_done, *steps, *(r["step"] for r in rows)]))
            self.sm.note("info", reason=f"cannot heal from the live state: {why}; forming the next group from the "
                                        f"peer snapshots of step {source.step} that the survivors hold",
                         step=self.step_done, cause="failure",
                         details={"snapshot_step": source.step, "serve": {str(r): s for r, s in source.serve},
                                  **stopped})
            return source, True
        if stopped or salvage.idle:
            said = ([f"kept {salvage.idle} idle (no state to heal from)"] if salvage.idle else []) + \
                   ([f"stopped {len(salvage.stopped_why)}: {'; '.join(salvage.stopped_why)}"]
                    if salvage.stopped_why else [])
            self.sm.note("info", reason=f"healing from {len(infos)} surviving worker(s); {'; '.join(said)}",
                         step=self.step_done, details={"idle": salvage.idle, **stopped})
        self.progress.recovered(rows, at=steps.pop())
        return source, True

    def _recover(self, err: WorkerFailure, *, tried: list[str] = (), during: During = During.TRAINING) -> Recovering:
        """The group failed: record it, keep the survivors' state if they can heal the next group, and
        go RECOVERING. `tried`: the nodes a failed re-form was placing workers on (not members yet, but
        just as likely to be the dead ones: e.g. a node killed right after the probe of the previous
        failure). `during`: what the group was doing; with the failure's kind, the failure policy
        (service.control.failure.respond) says whether to salvage and how long to wait."""
        t0 = time.time()
        response = respond(self._facts(err.kind, during))
        nodes = sorted(set(self.group.nodes() if self.group is not None else ()) | set(tried))
        self.health.suspect(err.nodes)  # the group's probe found them dead: they stay out of the next plan
        self.health.sweep(self.watcher.latest)  # and nodes dead before, which a restarted coordinator did not see
        # known dead (the watcher, or that probe): neither waited for nor probed again
        gone = self.health.gone(self.watcher.latest, nodes) | err.nodes
        # The probe (up to probe_timeout_s on a dead node; milliseconds where its raylet is gone) runs
        # while the survivors salvage (up to their grace for a silent peer): one wait instead of two, and
        # the salvage stops waiting for the members on the nodes the probe finds dead.
        survivors, kept = None, False
        with ThreadPoolExecutor(1, thread_name_prefix="probe") as pool:
            probing = pool.submit(self._probe, [n for n in nodes if n not in gone])

            def found_dead() -> set[str]:
                return probing.result() if probing.done() and probing.exception() is None else set()

            if response.salvage:
                survivors, kept = self._salvage(gone, response, dead=found_dead)
            dead = gone | probing.result()
        kind = classify(err.kind, on_dead_node=bool(dead))
        with self._lock:
            self.failures.append(Failure(time=t0, kind=kind, error=str(err)))
            # Only the failures within the policy's window count (and a final one, which ends the job):
            # the list stays as long as the restart budget, not as long as the job.
            window = self.policy.config.restart_window_s
            self.failures = [f for f in self.failures if f.time > t0 - window or f.kind in FINAL_KINDS]
        if not kept:
            self._drop_members(dead)
        # waited_s: since the failure was noticed, in the salvage and the probe
        self.sm.note("failure", reason=str(err), step=self.step_done, cause="failure",
                     details={"kind": kind, "unresponsive_nodes": sorted(dead),
                              "waited_s": round(time.time() - t0, 3)})
        record = Reconfig(cause="failure", detected=t0, step_before=self.step_done,
                          old_layout=self.plan.layout.to_dict() if self.plan else None)
        return Recovering(reason=str(err), cause="failure", survivors=survivors, record=record)

    def _restore(self, p: Plan, nodes: list[str], *, cause: str, reason: str, detected: float,
                 record: Reconfig | None) -> State:
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
            return self._recover(e, tried=nodes, during=During.RESTORE)
        return self._formed(p, old, formed.step, start.started, start.stopped, cause=cause, reason=reason,
                            detected=detected, record=record,
                            transfer={"path": "storage", "start_s": start_s, "standby": start.from_standby,
                                      "form_s": formed.form_s, "snapshot_bytes": formed.snapshot_bytes})

    def _formed(self, p: Plan, old: dict | None, resumed: int, started: int, stopped: int, *, cause: str,
                reason: str, detected: float, record: Reconfig | None, transfer: dict) -> Running:
        """Record a group formed for plan `p`; it runs next."""
        with self._lock:
            self.plan = p
            rc = record if record is not None else Reconfig(cause=cause, detected=detected,
                                                            step_before=self.step_done, old_layout=old)
            cause = rc.cause  # a recovery re-forms through a "planned" start: the event says why it happened
            rc.formed(new_layout=p.layout.to_dict(), resumed_step=resumed, started=started, stopped=stopped,
                      world_size=p.world_size, transfer=transfer)
            self.step_done = resumed
        self.sm.note("resize", reason=f"{reason}; layout {p.layout} on {p.world_size} workers "
                                      f"({started} started, {stopped} stopped, resumed at step {resumed})",
                     step=resumed, cause=cause, details={"plan": p.to_dict(), **rc.to_dict()})
        return Running(reason=f"running {p.layout}", cause=cause, record=rc)

    def _finish(self, state: Running) -> State:
        if state.record is not None:  # re-formed at the last step: no step left to close its record with
            self.reconfigs.append(state.record)
        try:
            self.committed_step = self.group.checkpoint()
        except WorkerFailure as e:
            return self._recover(e)
        self._shutdown_group()
        return Ended(final=S.SUCCEEDED, reason=f"reached step {self.total_steps}")

    def _fail(self, reason: str) -> Ended:
        self._shutdown_group()
        return Ended(final=S.FAILED, reason=reason)

    def _shutdown_group(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    def _drop_members(self, dead: set[str]) -> None:
        """After a failure that kept no worker: stop every member, but keep the group's standbys, and
        its spares off the `dead` nodes, for the re-form to claim (a shutdown would stop them too, and
        every worker would start afresh)."""
        if self.group is not None:
            self.group.stop_members(dead=dead)
