"""The job manager: the one thing the API talks to. Submits, lists, looks up and commands jobs, and keeps
the store in step with the jobs' coordinators (service.job_sync: reads are served from the store; a
background thread syncs).

Each job's coordinator runs apart from the API (a named detached Ray actor, via a launcher), so the API
can restart without the jobs noticing. Re-attach (`start()`): every job the store has as not finished
is looked up by name through the launcher; a job whose coordinator is not found is UNKNOWN until that
is confirmed (see service.job_sync).

Jobs have an owner (the user whose token submitted them, None without users). Every call takes
`owner`: None sees every job (an admin, or a server without users); a user sees only their own jobs,
and another user's job is JobNotFound, as if it did not exist.

Knows nothing of HTTP: errors are named exceptions (JobNotFound, JobConflict, SpecError,
JobUnavailable) that the API turns into status codes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from service.areas import areas_of, overlap
from service.job_scheduling import JobScheduling, queued_status
from service.job_sync import SYNC_THREADS, UNKNOWN, JobSyncing
from service.job_types import (JobConflict, JobGone, JobHandle, JobNotFound, JobRecord, JobUnavailable, Launcher,
                               Store)
from service.run_files import list_checkpoints
from service.scheduler import Quota
from service.specs import SpecError, check_paths, resolve_run_dir, safe_name, validate_spec
from service.state import TERMINAL
from service.status import JobStatus

logger = logging.getLogger(__name__)

__all__ = ["JobConflict", "JobHandle", "JobManager", "JobNotFound", "JobUnavailable", "Launcher", "Store",
           "SYNC_THREADS", "TERMINAL", "UNKNOWN"]


class JobManager(JobSyncing, JobScheduling):
    def __init__(self, store: Store, launcher: Launcher, *, runs_root: str | Path, sync_interval_s: float = 0.5,
                 stop_timeout_s: float = 10.0, clock: Callable[[], float] = time.time,
                 data_roots: Sequence[str | Path] | None = None, quotas: Mapping[str, Quota] | None = None,
                 shared: bool = False):
        """`data_roots`: directories a spec's data.path may lie under (None or empty: none, so data.path
        is refused; never the runs root, where other jobs' files and the store live). `quotas`: per
        owner (user name), the workers and jobs its jobs may hold. `shared`: schedule the jobs on one
        shared cluster (service.job_scheduling)."""
        self.store, self.launcher = store, launcher
        self.runs_root = Path(runs_root)
        self.data_roots = [Path(r) for r in data_roots or ()]
        root = self.runs_root.resolve()
        for r in self.data_roots:
            if r.resolve() == root or r.resolve() in root.parents:
                raise ValueError(f"data root {r} holds the runs root {root}: a job could read other jobs' files "
                                 "and the job store; give data roots beside it")
        self.sync_interval_s, self.stop_timeout_s, self.clock = sync_interval_s, stop_timeout_s, clock
        self._submit_lock = threading.Lock()  # area checks + insert, atomically
        self._init_sync()
        self._init_scheduling(quotas, shared)

    # -- jobs ----------------------------------------------------------------------------------------------
    def submit(self, spec: dict, *, steps: int | None = None, workers: int | None = None,
               run_dir: str | None = None, owner: str | None = None, idempotency_key: str | None = None) -> str:
        """Check and start a job; its id. With `idempotency_key`, a repeat of the same request by the same
        owner returns the first one's id instead of starting a second job (JobConflict when the request
        differs)."""
        # Paths first, on the raw request: validate_spec looks at data.path on disk. The spec is parsed
        # here, once: the JobConfig it gives is what the coordinator and the workers get.
        check_paths(spec, run_dir=run_dir, runs_root=self.runs_root, data_roots=self.data_roots)
        cfg = validate_spec(spec, steps=steps, workers=workers)
        job_id = uuid.uuid4().hex[:12]
        rd = resolve_run_dir(run_dir, runs_root=self.runs_root, default_name=f"{safe_name(cfg.name)}-{job_id}")
        now = self.clock()
        total = steps or cfg.train.steps
        grant = self.first_grant()
        status = JobStatus.submitted(total_steps=total, now=now)
        if grant is not None:
            status = queued_status(status, "waiting for the shared-cluster scheduler's first round")
        request = {"spec": spec, "steps": steps, "workers": workers, "run_dir": run_dir}
        # The job lock: the sync thread must not look for the coordinator before it is launched.
        lock = self._lock_of(job_id)
        with lock:
            with self._submit_lock:
                if idempotency_key is not None and (first := self.store.find_idempotent(owner, idempotency_key)):
                    if first.request != request:
                        raise JobConflict(f"Idempotency-Key {idempotency_key!r} was used for another request "
                                          f"(job {first.id}); use a new key for a new job")
                    self._forget_lock(job_id, lock)
                    return first.id
                self._check_areas(str(rd), cfg.checkpoint.dir)
                self.store.create(JobRecord(
                    id=job_id, name=cfg.name, spec=spec, steps=steps, workers=workers, run_dir=str(rd),
                    created=now, updated=now, owner=owner, idempotency_key=idempotency_key, request=request,
                    status=status))
                if self.shared:
                    self._cfgs[job_id] = cfg
            try:
                shared = {} if grant is None else {"grant": grant}  # a launcher for unscheduled jobs needs none
                self._handles[job_id] = self.launcher.launch(job_id, cfg, run_dir=str(rd), steps=steps,
                                                             workers=workers, **shared)
            except Exception as e:
                logger.warning("job %s: could not start its coordinator; it is recorded as FAILED", job_id,
                               exc_info=True)
                self.store.set_status(job_id, JobStatus.not_started(e, total_steps=total, now=now))
                self.store.mark_released(job_id)
        self._schedule_quietly()  # admitted now if its workers are free
        return job_id

    def _check_areas(self, run_dir: str, checkpoint_dir: str | None) -> None:
        """JobConflict when the new job's run or checkpoint directory is, contains or lies in one of a
        job the server keeps (a deleted job's directories are free again)."""
        mine = areas_of(run_dir, checkpoint_dir)
        others = ((r.id, areas_of(r.run_dir, r.checkpoint_dir)) for r in self.store.list())
        if hit := overlap(mine, others):
            field, other, their_field, how = hit
            where = run_dir if field == "run_dir" else checkpoint_dir
            raise JobConflict(f"{field} {where} {how} the {their_field} of job {other}, which is in use by job "
                              f"{other} until it is deleted: each job's run and checkpoint directories must be "
                              f"its own (delete job {other} first, or choose another {field})")

    def list(self, *, owner: str | None = None, limit: int | None = None, offset: int = 0) -> list[JobRecord]:
        return self.store.list(owner=owner, limit=limit, offset=offset)

    def count(self) -> int:
        return self.store.count()

    def get(self, job_id: str, *, owner: str | None = None) -> JobRecord:
        """The job as last stored (the background sync keeps it fresh; no coordinator is asked);
        JobNotFound if `owner` may not see it."""
        return self._mine(job_id, owner)

    def events(self, job_id: str, since: int = 0, limit: int | None = None, *, owner: str | None = None) -> list[dict]:
        self._mine(job_id, owner)
        return self.store.events(job_id, since, limit)

    def metrics(self, job_id: str, since: int = 0, limit: int | None = 10_000, stride: int = 1, *,
                owner: str | None = None) -> list[dict]:
        self._mine(job_id, owner)
        return self.store.metrics(job_id, since, limit, stride)

    def checkpoints(self, job_id: str, *, owner: str | None = None) -> dict:
        """The checkpoints directory's entries (read-only; a remote checkpoint.dir is not listed)."""
        row = self._mine(job_id, owner)
        return list_checkpoints(row.checkpoint_dir, row.run_dir)

    def where(self) -> str:
        return self.launcher.where()

    def cluster(self) -> dict:
        try:
            snap = self.launcher.cluster()
        except Exception as e:
            logger.warning("cannot read the cluster", exc_info=True)
            raise JobUnavailable(f"cannot read the cluster: {type(e).__name__}: {e}") from None
        if snap is None:
            return {"time": self.clock(), "nodes": [], "usable_workers": 0}
        now = self.clock()
        nodes = [{"node_id": n.node_id, "alive": n.alive, "cpus": n.cpus, "gpus": n.gpus, "draining": n.draining,
                  "drain_deadline": n.drain_deadline, "is_head": n.is_head, "death_reason": n.death_reason,
                  "seconds_left": None if n.drain_deadline is None else max(0.0, n.drain_deadline - now)}
                 for n in snap.nodes]
        return {"time": snap.time, "nodes": nodes, "usable_workers": snap.usable_workers()}

    # -- commands ------------------------------------------------------------------------------------------
    def resize(self, job_id: str, *, workers: int | None = None, min_workers: int | None = None,
               max_workers: int | None = None, owner: str | None = None) -> dict:
        given = {k: v for k, v in (("workers", workers), ("min_workers", min_workers),
                                   ("max_workers", max_workers)) if v is not None}
        if not given:
            raise SpecError((), "give workers, or min_workers and/or max_workers")
        for k, v in given.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError((k,), f"{k} must be an integer >= 1, got {v!r}")
        if min_workers is not None and max_workers is not None and min_workers > max_workers:
            raise SpecError(("min_workers",), f"min_workers={min_workers} is greater than max_workers={max_workers}")

        def send(h: JobHandle) -> None:
            try:
                h.resize(**given)
            except ValueError as e:
                raise SpecError((next((k for k in given if k in str(e)), next(iter(given))),), str(e)) from None

        return self._command(job_id, owner, "resize", send, lambda s: "a finished job cannot be resized"
                             if s in TERMINAL else None)

    def pause(self, job_id: str, *, owner: str | None = None) -> dict:
        return self._command(job_id, owner, "pause", lambda h: h.pause(), lambda s: (
            "a finished job cannot be paused" if s in TERMINAL else "it is already paused" if s == "PAUSED" else None))

    def resume(self, job_id: str, *, owner: str | None = None) -> dict:
        return self._command(job_id, owner, "resume", lambda h: h.resume(), lambda s: (
            None if s == "PAUSED" else "only a PAUSED job can be resumed"))

    def stop(self, job_id: str, *, owner: str | None = None) -> dict:
        return self._command(job_id, owner, "stop", lambda h: h.stop(), lambda s: (
            "it has already finished" if s in TERMINAL else None))

    def delete(self, job_id: str, *, owner: str | None = None, force: bool = False) -> dict:
        """Stop the job, wait up to stop_timeout_s for its final checkpoint, release its coordinator and
        forget it. The run directory and its checkpoints stay. A coordinator still saving when the time
        is up is left alone (JobConflict: retry, or `force` to release it whatever it is doing)."""
        self._mine(job_id, owner)
        with self._locked_row(job_id) as lock_row:
            row = self.sync(job_id) if lock_row.state != UNKNOWN else lock_row
            if row.state not in TERMINAL and (h := self._handles.get(job_id)) is not None:
                try:
                    h.stop()
                    deadline = time.monotonic() + self.stop_timeout_s
                    while time.monotonic() < deadline and self.sync(job_id).state not in TERMINAL:
                        time.sleep(0.05)
                except (JobGone, JobUnavailable):
                    logger.warning("job %s: coordinator did not take the stop; releasing it anyway", job_id)
                else:
                    if self._row(job_id).state not in TERMINAL and not force:
                        raise JobConflict(
                            f"job {job_id} is stopping but has not finished its final checkpoint within "
                            f"{self.stop_timeout_s:.0f} s; it was left running so that the save completes: "
                            "retry DELETE once it is STOPPED, or add ?force=true to release it now")
                row = self._row(job_id)
            self.launcher.release(job_id, self.stop_timeout_s)
            self._handles.pop(job_id, None)
            self.store.delete(job_id)
        self._forget_lock(job_id)
        self._last_traceback.pop(job_id, None)
        return {"id": job_id, "state": row.state, "deleted": True, "run_dir": row.run_dir}

    def _command(self, job_id: str, owner: str | None, action: str, send: Callable[[JobHandle], None],
                 conflict: Callable[[str], str | None]) -> dict:
        self._mine(job_id, owner)
        with self._locked_row(job_id):
            row = self.sync(job_id)
            if why := conflict(row.state):
                raise JobConflict(f"cannot {action} job {job_id}: it is {row.state}; {why}")
            h = self._handles.get(job_id)
            if h is None:
                raise JobConflict(f"cannot {action} job {job_id}: its coordinator is not running"
                                  + (f" on {self.launcher.where()}" if row.state == UNKNOWN else ""))
            try:
                send(h)
            except JobGone as e:
                raise JobUnavailable(f"cannot {action} job {job_id}: {e}") from None
            return {"id": job_id, "action": action, "accepted": True, "state": row.state}

    # -- helpers -------------------------------------------------------------------------------------------
    def _mine(self, job_id: str, owner: str | None) -> JobRecord:
        """The job's record, if `owner` may see it (None: every job); JobNotFound otherwise."""
        row = self._row(job_id)
        if owner is not None and row.owner != owner:
            raise JobNotFound(job_id)
        return row
