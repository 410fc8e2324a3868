"""The job manager: the one thing the API talks to, a facade over the parts that do the work.

  - submissions (service.server.submissions): check, record and launch a job;
  - owner views (service.server.owner_views): what one caller may read;
  - job commands (service.server.job_commands): a user's command to a job, and delete;
  - the store sync (service.server.store_sync): the store kept in step with the coordinators;
  - scheduling rounds (service.server.scheduling): the shared cluster's grants, told to the coordinators;
  - beside them, the coordinators' handles (service.server.coordinators) and the per-job locks
    (service.server.job_locks), which the parts are given.

Each job's coordinator runs apart from the API (a named detached Ray actor, via a launcher), so the API
can restart without the jobs noticing. `start()` syncs every job the store has as not finished (finding
its coordinator again by name, or recording how it ended), then keeps syncing on a background thread,
each sync round followed by a scheduling round; `close()` stops that, and the jobs go on.

Every call takes `owner`: None sees every job (an admin, or a server without users); a user sees only
their own jobs. Knows nothing of HTTP: errors are named exceptions (JobNotFound, JobConflict, JobForbidden,
SpecError, JobUnavailable) that the API turns into status codes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from service.control.commands import Pause, Resume, SetWorkers, Stop
from service.control.state import TERMINAL
from service.server.admission import Admission
from service.server.coordinators import Coordinators
from service.server.job_commands import JobCommands
from service.server.job_locks import LOCK_TIMEOUT_S, JobLocks
from service.server.job_types import (JobConflict, JobForbidden, JobHandle, JobNotFound, JobRecord, JobUnavailable,
                                      Launcher, Store)
from service.server.owner_views import OwnerViews
from service.server.scheduling import Scheduling
from service.server.store_sync import SYNC_THREADS, UNKNOWN, StoreSync
from service.server.submissions import MAX_FINISHED_JOBS_PER_USER, MAX_LIVE_JOBS_PER_USER, Submissions
from service.sharing.rounds import Round
from service.sharing.scheduler import Quota

__all__ = ["JobConflict", "JobForbidden", "JobHandle", "JobManager", "JobNotFound", "JobUnavailable", "Launcher", "Store",
           "SYNC_THREADS", "TERMINAL", "UNKNOWN"]


class JobManager:
    def __init__(self, store: Store, launcher: Launcher, *, runs_root: str | Path, sync_interval_s: float = 0.5,
                 stop_timeout_s: float = 10.0, clock: Callable[[], float] = time.time,
                 data_roots: Sequence[str | Path] | None = None, quotas: Mapping[str, Quota] | None = None,
                 shared: bool = False, resume_prefixes: Sequence[str] = (), object_stores: Sequence[str] = (),
                 azure_account: str | None = None, max_live_jobs: int | None = MAX_LIVE_JOBS_PER_USER,
                 lock_timeout_s: float = LOCK_TIMEOUT_S, max_finished_jobs: int = MAX_FINISHED_JOBS_PER_USER):
        """`data_roots`: directories a spec's data.path, data.val_path and model.init_from may lie under
        (None or empty: none; never around or inside the runs root, where other jobs' files and the store
        live). `quotas`: per owner (user name), the workers and jobs its jobs may hold, and each user's
        priority ceiling (`Quota.max_priority`). `shared`: schedule the jobs on one shared cluster.
        `resume_prefixes`: paths or object-store URLs under which any user's job may name its
        checkpoint.resume_from (shared base checkpoints), and no job may write; besides them, a user may
        name only places their own jobs hold. `object_stores`: object-store and HDFS URLs a job's
        checkpoint.dir may lie in (none: local paths only). `azure_account`: the account of an abfs:// URL
        that names none. `max_live_jobs`: a user's unfinished jobs at once (None: no limit).
        `lock_timeout_s`: how long a request waits for a job's lock. `max_finished_jobs`: a user's finished
        jobs kept; a submit forgets their oldest beyond it. Every place a request names is judged by
        service.server.admission."""
        self.store, self.launcher = store, launcher
        self.runs_root = Path(runs_root)
        self.sync_interval_s = sync_interval_s
        self.admission = Admission(runs_root=self.runs_root, data_roots=data_roots or (), object_stores=object_stores,
                                   resume_prefixes=resume_prefixes, reserved=store.files(),
                                   azure_account=azure_account)
        self.coordinators = Coordinators(launcher)
        self.locks = JobLocks(lock_timeout_s)
        self.scheduling = Scheduling(store, launcher, self.coordinators, quotas=quotas, shared=shared)
        self.syncer = StoreSync(store, self.coordinators, self.locks, sync_interval_s=sync_interval_s,
                                stop_timeout_s=stop_timeout_s, clock=clock)
        self.views = OwnerViews(store, launcher, clock=clock)
        self.submissions = Submissions(store, self.admission, self.coordinators, self.locks, self.scheduling,
                                       clock=clock, max_live_jobs=max_live_jobs, max_finished_jobs=max_finished_jobs)
        self.commands = JobCommands(store, self.coordinators, self.locks, self.syncer, self.views,
                                    stop_timeout_s=stop_timeout_s)
        self.submissions.record_old_claims()
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set to run the next sync and scheduling round now rather than at the next interval."""
        self._thread: threading.Thread | None = None

    # -- jobs ----------------------------------------------------------------------------------------------
    def submit(self, spec: dict, *, steps: int | None = None, workers: int | None = None,
               run_dir: str | None = None, owner: str | None = None, idempotency_key: str | None = None) -> str:
        """Check and start a job (service.server.submissions); its id. A scheduling round follows."""
        done = self.submissions.submit(spec, steps=steps, workers=workers, run_dir=run_dir, owner=owner,
                                       idempotency_key=idempotency_key)
        for job_id in done.forgotten:
            self.syncer.forget(job_id)
        self._schedule_soon()  # admitted at once if its workers are free, after the answer
        return done.job_id

    def free_places(self, job_id: str) -> dict:
        return self.submissions.free_places(job_id)

    def list(self, *, owner: str | None = None, limit: int | None = None, offset: int = 0) -> list[JobRecord]:
        return self.views.list(owner=owner, limit=limit, offset=offset)

    def count(self) -> int:
        return self.store.count()

    def get(self, job_id: str, *, owner: str | None = None) -> JobRecord:
        """The job as last stored (the background sync keeps it fresh; no coordinator is asked)."""
        return self.views.get(job_id, owner=owner)

    def events(self, job_id: str, since: int = 0, limit: int | None = None, *, owner: str | None = None) -> list[dict]:
        return self.views.events(job_id, since, limit, owner=owner)

    def metrics(self, job_id: str, since: int = 0, limit: int | None = 10_000, stride: int = 1, *,
                owner: str | None = None) -> list[dict]:
        return self.views.metrics(job_id, since, limit, stride, owner=owner)

    def checkpoints(self, job_id: str, *, owner: str | None = None) -> dict:
        return self.views.checkpoints(job_id, owner=owner)

    def where(self) -> str:
        return self.launcher.where()

    def cluster(self, *, owner: str | None = None) -> dict:
        return self.views.cluster(owner=owner)

    def quota_usage(self, *, owner: str | None = None) -> list[dict]:
        return self.scheduling.quota_usage(owner=owner)

    def command(self, job_id: str, cmd: SetWorkers | Pause | Resume | Stop, *, owner: str | None = None) -> dict:
        return self.commands.command(job_id, cmd, owner=owner)

    def delete(self, job_id: str, *, owner: str | None = None, force: bool = False) -> dict:
        return self.commands.delete(job_id, owner=owner, force=force)

    def sync(self, job_id: str) -> JobRecord:
        """Pull the job's status, events and metrics from its coordinator into the store now."""
        return self.syncer.sync(job_id)

    def schedule_round(self) -> Round | None:
        """One scheduling round now (None when jobs are not scheduled)."""
        return self.scheduling.round()

    @property
    def last_round(self) -> Round | None:
        return self.scheduling.last_round

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach to the coordinators of unfinished jobs (or record how they ended), then keep syncing."""
        self.syncer.open()
        self.syncer.round()
        self.syncer.wait()  # sync_quietly logs and swallows a job's sync errors
        self.scheduling.round_quietly()
        self._stop.clear()
        self._wake.clear()
        self._thread = threading.Thread(target=self._loop, name="JobManager-sync", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop syncing. The jobs go on: their coordinators do not belong to this process."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        self.syncer.close()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.sync_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.syncer.round(self._stop)
            # The scheduling round decides on the statuses this sync round brings (a shrink that just
            # ended frees the workers a queued job waits for), not on the previous round's.
            self.syncer.wait(timeout=self.sync_interval_s)
            self.scheduling.round_quietly()

    def _schedule_soon(self) -> None:
        """A scheduling round now on the background thread (a request is not held up by the coordinators
        it tells), or here when none runs."""
        if self._thread is not None and self._thread.is_alive():
            self._wake.set()
        else:
            self.scheduling.round_quietly()
