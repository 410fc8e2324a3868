"""The job commands: a user's resize, pause, resume or stop delivered to the job's coordinator, and delete.

Each command is judged against the job's state as just synced (`conflict`), then sent under the job's
lock, at most one per job at a time (service.server.job_locks). Delete stops the job, waits for its final
checkpoint, releases its coordinator and forgets the job; its run directory stays.
"""

from __future__ import annotations

import logging
import time

from service.control.commands import CommandError, Pause, Resume, SetWorkers, Stop
from service.control.state import TERMINAL
from service.server.coordinators import Coordinators
from service.server.job_locks import JobLocks
from service.server.job_types import JobConflict, JobGone, JobUnavailable, Store
from service.server.owner_views import OwnerViews
from service.server.specs import SpecError
from service.server.store_sync import UNKNOWN, StoreSync

logger = logging.getLogger(__name__)

ACTIONS = {SetWorkers: "resize", Pause: "pause", Resume: "resume", Stop: "stop"}
"""Each user command's name in messages and answers."""


class JobCommands:
    def __init__(self, store: Store, coordinators: Coordinators, locks: JobLocks, syncer: StoreSync,
                 views: OwnerViews, *, stop_timeout_s: float):
        self.store, self.coordinators, self.locks, self.syncer, self.views = store, coordinators, locks, syncer, views
        self.stop_timeout_s = stop_timeout_s

    def command(self, job_id: str, cmd: SetWorkers | Pause | Resume | Stop, *, owner: str | None = None) -> dict:
        """Send a user's command (built and checked where the request entered) to the job's coordinator;
        JobConflict when the job's state rules it out, SpecError naming the field when the coordinator
        cannot apply it (e.g. a range below its current minimum)."""
        action = ACTIONS[type(cmd)]
        self.views.mine(job_id, owner)
        with self.locks.one_command(job_id, action), self.locks.held(job_id, self.store.get):
            row = self.syncer.sync(job_id)
            if why := conflict(cmd, row.state):
                raise JobConflict(f"cannot {action} job {job_id}: it is {row.state}; {why}")
            h = self.coordinators.get(job_id)
            if h is None:
                raise JobConflict(f"cannot {action} job {job_id}: its coordinator is not running"
                                  + (f" on {self.coordinators.where()}" if row.state == UNKNOWN else ""))
            try:
                h.send(cmd)
            except CommandError as e:
                raise SpecError((e.field,) if e.field else (), str(e)) from None
            except JobGone as e:
                raise JobUnavailable(f"cannot {action} job {job_id}: {e}") from None
            return {"id": job_id, "action": action, "accepted": True, "state": row.state}

    def delete(self, job_id: str, *, owner: str | None = None, force: bool = False) -> dict:
        """Stop the job, wait up to stop_timeout_s for its final checkpoint, release its coordinator and
        forget it. The run directory and its checkpoints stay. A coordinator still saving when the time
        is up is left alone (JobConflict: retry, or `force` to release it whatever it is doing)."""
        self.views.mine(job_id, owner)
        with self.locks.one_command(job_id, "delete"), self.locks.held(job_id, self.store.get) as lock_row:
            row = self.syncer.sync(job_id) if lock_row.state != UNKNOWN else lock_row
            if row.state not in TERMINAL and (h := self.coordinators.get(job_id)) is not None:
                try:
                    h.send(Stop())
                    deadline = time.monotonic() + self.stop_timeout_s
                    while time.monotonic() < deadline and self.syncer.sync(job_id).state not in TERMINAL:
                        time.sleep(0.05)
                except (JobGone, JobUnavailable):
                    logger.warning("job %s: coordinator did not take the stop; releasing it anyway", job_id)
                else:
                    if self.views.mine(job_id, None).state not in TERMINAL and not force:
                        raise JobConflict(
                            f"job {job_id} is stopping but has not finished its final checkpoint within "
                            f"{self.stop_timeout_s:.0f} s; it was left running so that the save completes: "
                            "retry DELETE once it is STOPPED, or add ?force=true to release it now")
                row = self.views.mine(job_id, None)
            self.coordinators.release(job_id, self.stop_timeout_s)
            self.store.delete(job_id)
        self.locks.forget(job_id)
        self.syncer.forget(job_id)
        return {"id": job_id, "state": row.state, "deleted": True, "run_dir": row.run_dir}


def conflict(cmd: SetWorkers | Pause | Resume | Stop, state: str) -> str | None:
    """Why a user's command does not fit the job's state (None: it does)."""
    match cmd:
        case SetWorkers():
            return "a finished job cannot be resized" if state in TERMINAL else None
        case Pause():
            return ("a finished job cannot be paused" if state in TERMINAL else
                    "it is already paused" if state == "PAUSED" else None)
        case Resume():
            return None if state == "PAUSED" else "only a PAUSED job can be resumed"
        case Stop():
            return "it has already finished" if state in TERMINAL else None
    return None
