"""A job's commands from arrival to effect: queued from any thread, applied by its loop at a step's start.

`Inbox.send` checks a command against the job as it stands (a resize against the current range:
CommandError naming the field) and queues it, waking a loop that naps while it waits. `apply_all`, at
the start of each coordinator step, applies what is queued: a resize changes the policy's range (acting
at once on a running group), a grant is what the shared-cluster scheduler offers (kept here: `grant`,
`queue`), a pause or stop checkpoints the workers the state holds and parks the job, a resume starts it
again. A command the lifecycle cannot take yet (a pause while STARTING) is kept for a later step.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import replace

from service.control.commands import Command, Grant, Pause, Resume, SetWorkers, Stop
from service.control.events import Cause, EventKind
from service.control.journal import Journal
from service.control.policy import PolicyConfig, ScalingPolicy
from service.control.progress import Progress
from service.control.state import TRANSITIONS, JobState
from service.control.states import Ended, Paused, Running, Starting, State, held
from service.pool.group import WorkerFailure

logger = logging.getLogger(__name__)


class Inbox:
    """`policy`: the job's scaling policy, whose range a resize changes (`policy_config(lo, hi)` makes a
    range, CommandError/ValueError if it is not one); `state()`: the job's state now; `enter(state)`: the
    coordinator's move to `state`."""

    def __init__(self, job_id: str, *, journal: Journal, progress: Progress, policy: ScalingPolicy,
                 policy_config: Callable[[int, int | None], PolicyConfig], state: Callable[[], State],
                 enter: Callable[[State], None]):
        self.job_id, self.journal, self.progress, self.policy = job_id, journal, progress, policy
        self.policy_config, self.state, self.enter = policy_config, state, enter
        self._queue: queue.Queue[Command] = queue.Queue()
        self._woken = threading.Event()
        self.grant: dict[str, int] | None = None
        """{node_id: workers} the shared-cluster scheduler grants this job (service.sharing.scheduler); None: the
        whole cluster. Assign a new dict to change it: placement and the policy read it each iteration."""
        self.queue: tuple[int | None, str] = (None, "")
        """(place, reason) the scheduler gave with a grant too small to start on (shown while QUEUED)."""
        self.standby_cap: int | None = None
        """The most standby workers the scheduler lets the job keep (its owner's worker quota, less the
        members); None: as many as resources.standby_per_node asks."""

    def send(self, cmd: Command) -> None:
        """Queue `cmd` for the next step. A resize is checked now against the range as it stands, and
        applied to the range current then, so that a second resize composes with the first."""
        if isinstance(cmd, SetWorkers):
            self.policy_config(*cmd.bounds(self.policy.config.min_workers, self.policy.config.max_workers))
        self._queue.put(cmd)
        self.wake()

    def wake(self) -> None:
        """End a nap now (a command arrived, or the loop is asked to end)."""
        self._woken.set()

    def nap(self, seconds: float) -> None:
        """Wait up to `seconds`, less if a command arrives."""
        self._woken.wait(seconds)
        self._woken.clear()

    def apply_all(self) -> None:
        """Apply every queued command, in order; those the lifecycle cannot take yet are kept."""
        deferred = []
        while True:
            try:
                cmd = self._queue.get_nowait()
            except queue.Empty:
                break
            if not self._apply(cmd):
                deferred.append(cmd)
        for cmd in deferred:
            self._queue.put(cmd)

    def _apply(self, cmd: Command) -> bool:
        """Apply one command; False to keep it for a later step."""
        step = self.progress.step_done
        match cmd:
            case SetWorkers():
                try:
                    self.policy.config = self.policy_config(*cmd.bounds(self.policy.config.min_workers,
                                                                        self.policy.config.max_workers))
                except ValueError as e:  # valid alone, not on top of an earlier resize: say so, keep going
                    self.journal.note(EventKind.FAILURE, reason=f"resize refused: {e}", step=step, cause=Cause.USER)
                    return True
                if isinstance(now := self.state(), Running):  # act now: a user's request needs no settle time
                    self.enter(replace(now, resize_requested=True))
            case Grant():
                told = (cmd.nodes, cmd.reason, cmd.queue_position)
                if told != (self.grant, *self.queue):
                    self.journal.note(EventKind.SCHEDULE, reason=cmd.reason, step=step,
                                      details={"grant": cmd.nodes, "queue_position": cmd.queue_position})
                self.grant, self.queue = dict(cmd.nodes), (cmd.queue_position, cmd.reason)
                self.standby_cap = cmd.standby
            case Pause() | Stop():
                return self._park(cmd)
            case Resume() if isinstance(self.state(), Paused):
                self.enter(Starting(reason=f"resume requested by {cmd.by}", cause=cmd.by))
        return True

    def _park(self, cmd: Pause | Stop) -> bool:
        """Checkpoint, release the workers, and move to PAUSED or STOPPED; False (kept for later) where
        the lifecycle has no such move yet (e.g. a pause while STARTING: applied once it runs)."""
        kind, target = ("pause", JobState.PAUSED) if isinstance(cmd, Pause) else ("stop", JobState.STOPPED)
        now = self.state()
        if now.name.is_terminal or now.name is target:
            return True
        if target not in TRANSITIONS[now.name]:
            return False
        by = cmd.by if isinstance(cmd, Pause) else Cause.USER
        lost = None
        group = held(now)
        if group is not None and group.size:  # a group without members has nothing to save
            try:
                self.progress.committed_step = group.checkpoint()
            except WorkerFailure as e:
                lost = (f"the checkpoint before {kind} failed ({e}); the last committed checkpoint is step "
                        f"{self.progress.committed_step}, so steps after it are lost")
                logger.warning("job %s: %s", self.job_id, lost)
                self.journal.note(EventKind.FAILURE, reason=lost, step=self.progress.step_done, cause=by,
                                  details={"kind": e.kind, "before": kind})
        if lost and target is JobState.STOPPED and JobState.FAILED in TRANSITIONS[now.name]:  # not a clean stop
            target = JobState.FAILED
        why = (cmd.reason if isinstance(cmd, Pause) and cmd.reason else f"{kind} requested by {by}")
        why += f", but {lost}" if lost else ""
        self.enter(Paused(reason=why, cause=by) if target is JobState.PAUSED else
                   Ended(final=target, reason=why, cause=by))  # the move stops the workers the state held
        return True
