"""The coordinator's commands: what its user and the shared-cluster scheduler may ask of it, from any
thread (`resize`, `pause`, `resume`, `stop`, `set_grant`), queued as values (service.commands) and
applied, one at a time, at the start of the coordinator's next iteration (`_apply_commands`)."""

from __future__ import annotations

import logging
import queue

from service.commands import Command, Grant, Pause, Resume, SetWorkers, Stop
from service.state import JobState
from service.group_types import WorkerFailure

logger = logging.getLogger("service.coordinator")
S = JobState
PAUSERS = ("user", "scheduler")


class Commands:
    """Mixin of service.coordinator.Coordinator (which sets the attributes it uses)."""

    # -- from other threads ----------------------------------------------------------------------------------
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
        """The shared-cluster scheduler's grant (service.shared_cluster): plan onto these workers only."""
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
