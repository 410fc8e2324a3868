"""The job manager: the one thing the API talks to. Submits, lists, looks up and commands jobs, and keeps
the store in step with the jobs' coordinators (`sync`: reads are served from the store; a background
thread syncs).

Each job's coordinator runs apart from the API (a named detached Ray actor, via a launcher), so the API
can restart without the jobs noticing. Re-attach (`start()`): every job the store has as not finished
is looked up by name through the launcher; a job whose coordinator is not found is UNKNOWN until that
is confirmed (see `sync`).

Jobs have an owner (the user whose token submitted them, None without users). Every call takes
`owner`: None sees every job (an admin, or a server without users); a user sees only their own jobs,
and another user's job is JobNotFound, as if it did not exist.

Knows nothing of HTTP: errors are named exceptions (JobNotFound, JobConflict, SpecError,
JobUnavailable) that the API turns into status codes.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from pathlib import Path
from typing import Any

from parallel.planner import size_for
from service.control.run_files import iter_metrics, list_checkpoints, read_job_events
from service.control.commands import CommandError, Grant, Pause, Resume, SetWorkers, Stop
from service.control.job import Job, worker_range
from service.control.state import TERMINAL
from service.control.status import JobStatus
from service.server.admission import Admission, Claim, Place, place_of
from service.server.job_types import (JobConflict, JobForbidden, JobGone, JobHandle, JobNotFound, JobRecord,
                                      JobUnavailable, Launcher, Store)
from service.server.specs import SpecError, check_text, safe_name, validate_spec
from service.sharing.ledger import WorkerShape
from service.sharing.rounds import JobView, Round, Tell, plan_round
from service.sharing.scheduler import Quota
from workers.config import JobConfig, job_constraints

logger = logging.getLogger(__name__)

SYNC_THREADS = 8
"""Coordinators synced at the same time."""
SYNC_THREADS_PER_OWNER = 2
"""Of those, at most this many may be held by one owner's slow jobs (whose last sync, or the one running,
took longer than a sync interval): one user's stuck coordinators cannot hold every sync thread and leave
other users' statuses stale."""
MAX_LIVE_JOBS_PER_USER = 32
"""Default for a user's unfinished jobs at once (`max_live_jobs`)."""
MAX_FINISHED_JOBS_PER_USER = 100
"""Default for a user's finished jobs kept in the store (`max_finished_jobs`)."""
LOCK_TIMEOUT_S = 30.0
"""Default for how long a request waits for a job's lock (`lock_timeout_s`) before a 503."""
TRACEBACK_EVERY_S = 60.0
"""A job whose sync keeps failing logs its traceback at most this often (one line otherwise)."""
UNKNOWN = "UNKNOWN"
"""The state shown for a job whose coordinator this server cannot find and cannot confirm gone."""

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
        live). `quotas`: per owner (user name), the workers and jobs its jobs may hold. `shared`: schedule
        the jobs on one shared cluster. `resume_prefixes`: paths or object-store URLs under which any
        user's job may name its checkpoint.resume_from (shared base checkpoints), and no job may write;
        besides them, a user may name only places their own jobs hold. `object_stores`: object-store and
        HDFS URLs a job's checkpoint.dir may lie in (none: local paths only). `azure_account`: the account
        of an abfs:// URL that names none. `max_live_jobs`: a user's unfinished jobs at once (None: no
        limit). `lock_timeout_s`: how long a request waits for a job's lock. `max_finished_jobs`: a user's
        finished jobs kept; a submit prunes their oldest beyond it (`_prune_finished`). `quotas` also give
        each user's priority ceiling (`Quota.max_priority`). Every place a request names is judged by
        service.server.admission."""
        self.store, self.launcher = store, launcher
        self.runs_root = Path(runs_root)
        self.admission = Admission(runs_root=self.runs_root, data_roots=data_roots or (), object_stores=object_stores,
                                   resume_prefixes=resume_prefixes, reserved=store.files(),
                                   azure_account=azure_account)
        self.sync_interval_s, self.stop_timeout_s, self.clock = sync_interval_s, stop_timeout_s, clock
        self.max_live_jobs, self.lock_timeout_s = max_live_jobs, lock_timeout_s
        if not isinstance(max_finished_jobs, int) or max_finished_jobs < 0:
            raise ValueError(f"max_finished_jobs must be a whole number >= 0, got {max_finished_jobs!r}")
        self.max_finished_jobs = max_finished_jobs
        self._submit_lock = threading.Lock()  # area checks + insert, atomically
        self._record_old_claims()
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
        check_text({"spec": spec, "run_dir": run_dir})
        self.admission.check(spec, run_dir=run_dir, default_name="job", owner=owner, claims=self.store.claims())
        cfg = validate_spec(spec, steps=steps, workers=workers)
        self._check_priority(cfg.scheduling.priority, owner)
        job_id = uuid.uuid4().hex[:12]
        places = self.admission.check(spec, run_dir=run_dir, default_name=f"{safe_name(cfg.name)}-{job_id}",
                                      owner=None, claims=())  # the places, judged above with the owner
        rd = places["run_dir"].path
        job = Job.of(cfg, job_id=job_id, run_dir=rd, steps=steps, workers=workers)
        now = self.clock()
        grant = self.first_grant()
        status = JobStatus.submitted(total_steps=job.total_steps, now=now)
        if grant is not None:
            status = queued_status(status, "waiting for the shared-cluster scheduler's first round")
        request = {"spec": spec, "steps": steps, "workers": workers, "run_dir": run_dir}
        # The job lock: the sync thread must not look for the coordinator before it is launched.
        lock = self._lock_of(job_id)
        with lock:
            try:
                with self._submit_lock:
                    if idempotency_key is not None and (first := self.store.find_idempotent(owner, idempotency_key)):
                        if first.request != request:
                            raise JobConflict(f"Idempotency-Key {idempotency_key!r} was used for another request "
                                              f"(job {first.id}); use a new key for a new job")
                        self._forget_lock(job_id, lock)
                        return first.id
                    self._check_live_jobs(owner)
                    self._prune_finished(owner)
                    self._check_claims(places, owner)
                    self._check_quota(job, owner)
                    self.store.create(JobRecord(
                        id=job_id, name=cfg.name, spec=spec, steps=steps, workers=workers, run_dir=str(rd),
                        created=now, updated=now, owner=owner, idempotency_key=idempotency_key, request=request,
                        status=status), [Claim(job_id=job_id, owner=owner, field=f, place=p) for f, p in places.items()])
                    if self.shared:
                        self._cfgs[job_id] = cfg
            except BaseException:  # no job was recorded: its lock goes too
                self._forget_lock(job_id, lock)
                raise
            try:
                shared = {} if grant is None else {"grant": grant}  # a launcher for unscheduled jobs needs none
                self._handles[job_id] = self.launcher.launch(job, **shared)
            except Exception as e:
                logger.warning("job %s: could not start its coordinator; it is recorded as FAILED", job_id,
                               exc_info=True)
                self.store.set_status(job_id, JobStatus.not_started(e, total_steps=job.total_steps, now=now))
                self.store.mark_released(job_id)
        self._schedule_soon()  # admitted at once if its workers are free, after the answer
        return job_id

    def _check_claims(self, places: dict[str, Place], owner: str | None) -> None:
        """JobConflict when one of the new job's places (run_dir, checkpoint.dir) is, contains or lies in
        a place another job holds: any job of another owner, deleted or not (its files stay its owner's
        until an admin frees them), or a kept job of the same owner. Another user's job is not named."""
        for c in self.store.claims():
            for field, p in places.items():
                if not p.overlaps(c.place) or (c.owner == owner and c.deleted):
                    continue
                if c.owner != owner:
                    raise JobConflict(f"{field} {p} is held by another user's job: each job's run and checkpoint "
                                      f"directories must be its own (choose another {field})")
                how = "is" if p == c.place else "lies inside" if p.within(c.place) else "contains"
                raise JobConflict(f"{field} {p} {how} the {c.field} of job {c.job_id}, which is in use by job "
                                  f"{c.job_id} until it is deleted: each job's run and checkpoint directories must "
                                  f"be its own (delete job {c.job_id} first, or choose another {field})")

    def _check_live_jobs(self, owner: str | None) -> None:
        """JobConflict when a user already has max_live_jobs unfinished jobs."""
        if owner is None or self.max_live_jobs is None:
            return
        live = sum(1 for r in self.store.list(owner=owner) if r.state not in TERMINAL)
        if live >= self.max_live_jobs:
            raise JobConflict(f"you have {live} unfinished jobs, this server's limit per user "
                              f"(ELASTRON_MAX_LIVE_JOBS={self.max_live_jobs}): stop or delete one first")

    def _check_priority(self, priority: int, owner: str | None) -> None:
        """JobForbidden when a user asks for a priority above their ceiling (`Quota.max_priority`, 0 for a
        user the operator lists nowhere); the admin (owner None) has none."""
        if owner is None:
            return
        top = self.quotas.get(owner, Quota()).max_priority
        if top is not None and priority > top:
            raise JobForbidden(f"scheduling.priority {priority} is above your ceiling of {top} (set by the "
                               f"operator in ELASTRON_QUOTAS, NAME=WORKERS:JOBS:PRIORITY): ask for at most {top}")

    def _prune_finished(self, owner: str | None) -> list[str]:
        """Forget a user's oldest finished (and released) jobs beyond max_finished_jobs: their records,
        events and metrics. Their run directories stay, and so do
        their places (tombstones, as after DELETE). Returns the ids forgotten."""
        if owner is None:
            return []
        done = [r.id for r in self.store.list(owner=owner) if r.state in TERMINAL and r.released]
        gone = done[:max(0, len(done) - self.max_finished_jobs)]
        for job_id in gone:  # oldest first (the store lists by creation time)
            self.store.delete(job_id)
            self._forget_lock(job_id)
            self._last_traceback.pop(job_id, None)
        if gone:
            logger.info("user %s: forgot %d finished job(s) beyond ELASTRON_MAX_FINISHED_JOBS=%d: %s", owner, len(gone),
                        self.max_finished_jobs, ", ".join(gone))
        return gone

    def _record_old_claims(self) -> None:
        """Places of jobs the store kept from before it recorded them, recorded now (as they were stored)."""
        held = {c.job_id for c in self.store.claims()}
        old = []
        for r in self.store.list():
            if r.id in held:
                continue
            for field, where in (("run_dir", r.run_dir), ("checkpoint.dir", r.checkpoint_dir)):
                if where and (p := place_of(where, azure_account=self.admission.azure_account)) is not None:
                    old.append(Claim(job_id=r.id, owner=r.owner, field=field, place=p))
        self.store.add_claims(old)

    def free_places(self, job_id: str) -> dict:
        """Forget the tombstones a deleted job left (an admin's act): its places may be claimed again by
        anyone. JobNotFound when it left none."""
        if self.store.get(job_id) is not None:
            raise JobConflict(f"job {job_id} is not deleted: delete it first; its places are freed after")
        if not (n := self.store.free_claims(job_id)):
            raise JobNotFound(job_id)
        return {"id": job_id, "freed": n}

    def _check_quota(self, job: Job, owner: str | None) -> None:
        """On a shared cluster, a job its owner's quota could never run is refused now instead of queued
        forever: its minimum above the quota's workers, or a quota of no jobs."""
        if not self.shared or owner is None:
            return
        q = self.quotas.get(owner, Quota())
        if q.max_jobs == 0:
            raise SpecError(("spec",), f"owner {owner}'s quota allows no jobs (max_jobs=0): ask an admin for a quota")
        if q.max_workers is not None and job.min_workers > q.max_workers:
            forced = job.layout or job.cfg.parallel.layout
            loc, what = (("spec", "parallel", "layout"), f"layout {forced} runs on exactly {job.min_workers} workers") \
                if forced else (("spec", "parallel", "min_workers"), f"min_workers={job.min_workers}")
            raise SpecError(loc, f"{what}, but owner {owner}'s quota allows {q.max_workers} workers, so the job "
                                 f"could never start: ask for at most {q.max_workers} workers, or a larger quota")

    def list(self, *, owner: str | None = None, limit: int | None = None, offset: int = 0) -> list[JobRecord]:
        rows = self.store.list(owner=owner, limit=limit, offset=offset)
        return rows if owner is None else [self._as_seen_by(r, owner) for r in rows]

    def count(self) -> int:
        return self.store.count()

    def get(self, job_id: str, *, owner: str | None = None) -> JobRecord:
        """The job as last stored (the background sync keeps it fresh; no coordinator is asked);
        JobNotFound if `owner` may not see it. A user's view names no other user's job."""
        row = self._mine(job_id, owner)
        return row if owner is None else self._as_seen_by(row, owner)

    def events(self, job_id: str, since: int = 0, limit: int | None = None, *, owner: str | None = None) -> list[dict]:
        """The job's stored events; a user's view names no other user's job (the scheduler's reasons
        name the job a capacity went to: "another job" instead)."""
        self._mine(job_id, owner)
        events = self.store.events(job_id, since, limit)
        return events if owner is None else _redacted(events, self._ids_of(owner))

    def _ids_of(self, owner: str) -> set[str]:
        return {r.id for r in self.store.list(owner=owner)}

    def _as_seen_by(self, row: JobRecord, owner: str) -> JobRecord:
        if not _OTHER_JOB.search(row.status.reason or ""):
            return row
        return replace(row, status=replace(row.status, reason=_redacted(row.status.reason, self._ids_of(owner))))

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

    def cluster(self, *, owner: str | None = None) -> dict:
        """The cluster's nodes; for a user (`owner` given) only counts: which machines run the service is
        the operator's to see."""
        out = self._cluster()
        if owner is None:
            return out
        nodes = out["nodes"]
        return {"time": out["time"], "nodes": [], "usable_workers": out["usable_workers"],
                "node_count": sum(n["alive"] for n in nodes), "draining_nodes": sum(n["draining"] for n in nodes),
                "cpus": sum(n["cpus"] for n in nodes if n["alive"]), "gpus": sum(n["gpus"] for n in nodes if n["alive"])}

    def _cluster(self) -> dict:
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
    def command(self, job_id: str, cmd: SetWorkers | Pause | Resume | Stop, *, owner: str | None = None) -> dict:
        """Send a user's command (built and checked where the request entered) to the job's coordinator;
        JobConflict when the job's state rules it out, SpecError naming the field when the coordinator
        cannot apply it (e.g. a range below its current minimum)."""
        action = {SetWorkers: "resize", Pause: "pause", Resume: "resume", Stop: "stop"}[type(cmd)]
        self._mine(job_id, owner)
        with self._one_command(job_id, action), self._locked_row(job_id):
            row = self.sync(job_id)
            if why := _conflict(cmd, row.state):
                raise JobConflict(f"cannot {action} job {job_id}: it is {row.state}; {why}")
            h = self._handles.get(job_id)
            if h is None:
                raise JobConflict(f"cannot {action} job {job_id}: its coordinator is not running"
                                  + (f" on {self.launcher.where()}" if row.state == UNKNOWN else ""))
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
        self._mine(job_id, owner)
        with self._one_command(job_id, "delete"), self._locked_row(job_id) as lock_row:
            row = self.sync(job_id) if lock_row.state != UNKNOWN else lock_row
            if row.state not in TERMINAL and (h := self._handles.get(job_id)) is not None:
                try:
                    h.send(Stop())
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

    # -- helpers -------------------------------------------------------------------------------------------
    def _mine(self, job_id: str, owner: str | None) -> JobRecord:
        """The job's record, if `owner` may see it (None: every job); JobNotFound otherwise."""
        row = self._row(job_id)
        if owner is not None and row.owner != owner:
            raise JobNotFound(job_id)
        return row

    # -- keeping the store in step with the coordinators ------------------------------------------------
    def _init_sync(self) -> None:
        self._handles: dict[str, JobHandle] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._commanding: set[str] = set()
        """Jobs a command is being delivered to (`_one_command`)."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set to run the next sync and scheduling round now rather than at the next interval."""
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}
        self._sync_started: dict[str, float] = {}
        self._slow: set[str] = set()
        """Jobs whose last sync took longer than a sync interval (`_sync_round`)."""
        """When each job's sync in flight was handed to the pool (time.monotonic)."""
        self._last_traceback: dict[str, float] = {}

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach to the coordinators of unfinished jobs (or record how they ended), then keep syncing."""
        self._pool = ThreadPoolExecutor(max_workers=SYNC_THREADS, thread_name_prefix="JobManager-sync")
        self._inflight = {}  # futures of an earlier start() were cancelled by its close()
        self._sync_round()
        for f in list(self._inflight.values()):
            f.result()  # _sync_quietly logs and swallows a job's sync errors
        self._schedule_quietly()
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
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._inflight = {}

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.sync_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._sync_round()
            # The scheduling round decides on the statuses this sync round brings (a shrink that just
            # ended frees the workers a queued job waits for), not on the previous round's.
            wait_futures(list(self._inflight.values()), timeout=self.sync_interval_s)
            self._schedule_quietly()

    def _schedule_soon(self) -> None:
        """A scheduling round now on the background thread (a request is not held up by the coordinators
        it tells), or here when none runs."""
        if self._thread is not None and self._thread.is_alive():
            self._wake.set()
        else:
            self._schedule_quietly()

    def _schedule_quietly(self) -> None:
        """A scheduling round (`schedule_round`, service.sharing.rounds), its errors logged (the traceback at most every
        TRACEBACK_EVERY_S): the next round tries again."""
        try:
            self.schedule_round()
        except Exception as e:
            now = time.monotonic()
            loud = now - self._last_traceback.get("", -TRACEBACK_EVERY_S) >= TRACEBACK_EVERY_S
            if loud:
                self._last_traceback[""] = now
            logger.warning("the scheduling round failed (%s: %s); the next one tries again", type(e).__name__, e,
                           exc_info=loud)

    def _sync_round(self) -> None:
        """Sync every unsettled job, each on a pool thread; a job whose last sync is still running is
        skipped this round, and so is a slow job (its last sync took longer than a sync interval) of an
        owner whose slow jobs already hold SYNC_THREADS_PER_OWNER pool threads: a thread left waiting on a
        stuck coordinator is one fewer for everyone, so one owner's stuck jobs may hold only a few."""
        rows = self.store.unsettled()
        owner_of = {r.id: r.owner for r in rows}
        slow: dict[str | None, int] = {}
        now = time.monotonic()
        for job_id, f in self._inflight.items():
            if not f.done() and job_id in owner_of and (
                    job_id in self._slow or now - self._sync_started.get(job_id, now) > self.sync_interval_s):
                slow[owner_of[job_id]] = slow.get(owner_of[job_id], 0) + 1
        for row in rows:
            if self._stop.is_set():
                return
            busy = self._inflight.get(row.id)
            if busy is not None and not busy.done():
                continue
            if row.id in self._slow:
                if slow.get(row.owner, 0) >= SYNC_THREADS_PER_OWNER:
                    continue
                slow[row.owner] = slow.get(row.owner, 0) + 1
            self._sync_started[row.id] = now
            self._inflight[row.id] = self._pool.submit(self._sync_quietly, row.id)
        for job_id in [j for j, f in self._inflight.items() if f.done()]:
            del self._inflight[job_id]  # settled or deleted jobs leave no trace
            self._sync_started.pop(job_id, None)
            if self.store.get(job_id) is None or job_id not in owner_of:
                self._slow.discard(job_id)

    def _sync_quietly(self, job_id: str) -> None:
        t0 = time.monotonic()
        try:
            self.sync(job_id)
        except JobNotFound:
            pass  # deleted meanwhile
        except Exception as e:
            now = time.monotonic()
            last = self._last_traceback.get(job_id)
            loud = last is None or now - last >= TRACEBACK_EVERY_S
            if loud:
                self._last_traceback[job_id] = now
            logger.warning("job %s: sync with its coordinator failed (%s: %s); will retry every %.1f s%s", job_id,
                           type(e).__name__, e, self.sync_interval_s,
                           "" if loud else f" (traceback logged at most every {TRACEBACK_EVERY_S:.0f} s)",
                           exc_info=loud)
        else:
            self._last_traceback.pop(job_id, None)
        finally:
            if time.monotonic() - t0 > self.sync_interval_s:
                self._slow.add(job_id)
            else:
                self._slow.discard(job_id)

    # -- the job lock ----------------------------------------------------------------------------------------
    def _lock_of(self, job_id: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks.setdefault(job_id, threading.RLock())

    def _forget_lock(self, job_id: str, lock: threading.RLock | None = None) -> None:
        with self._locks_guard:
            if lock is None or self._locks.get(job_id) is lock:
                self._locks.pop(job_id, None)

    @contextmanager
    def _one_command(self, job_id: str, action: str):
        """At most one command per job waits for its lock (held while its coordinator is asked, which a
        stuck coordinator may make slow): the others are JobUnavailable at once (503, retry), so that one
        job's commands cannot take every request thread and leave other users' reads waiting."""
        with self._locks_guard:
            if job_id in self._commanding:
                raise JobUnavailable(f"cannot {action} job {job_id} now: another command for it is still being "
                                     "delivered to its coordinator; retry in a moment")
            self._commanding.add(job_id)
        try:
            yield
        finally:
            with self._locks_guard:
                self._commanding.discard(job_id)

    def _locked_row(self, job_id: str):
        """Context manager: the job's lock, held, yielding its stored record. An id the store does not have
        is JobNotFound *before* any lock is made for it: requests for random ids must not grow memory."""
        return _Locked(self, job_id)

    # -- sync ----------------------------------------------------------------------------------------------
    def sync(self, job_id: str) -> JobRecord:
        """Pull status, new events and new metrics from the job's coordinator into the store; returns
        the stored record. A finished job is synced one last time, then its coordinator is released."""
        with self._locked_row(job_id) as row:
            if row.state in TERMINAL and row.released:
                return row
            h = self._handles.get(job_id)
            if h is None:
                h = self.launcher.attach(job_id)
                if h is None:
                    return self._not_found(row)
                logger.info("job %s: re-attached to its coordinator", job_id)
                self._handles[job_id] = h
            try:
                st = h.status()  # first, so that a terminal status means the events below are complete
                events = h.events_since(self.store.event_count(job_id))
                rows = h.metrics_since(self.store.last_step(job_id))
            except JobGone as e:
                self._handles.pop(job_id, None)
                return self._finalize_from_run_dir(row, str(e))
            except JobUnavailable as e:
                logger.info("job %s: %s; showing the last known status", job_id, e)
                return row
            self.store.add_events(job_id, self.store.event_count(job_id), events)
            self.store.add_metrics(job_id, self._fill_gap(row, rows))
            if st.mfu is None:  # the coordinator reports loss and tokens/s of the last step, not MFU
                st = replace(st, mfu=self._mfu_at(job_id, st.step))
            self.store.set_status(job_id, st)
            if st.is_terminal:
                self.launcher.release(job_id, self.stop_timeout_s)
                self._handles.pop(job_id, None)
                self.store.mark_released(job_id)
            return self._row(job_id)

    def _not_found(self, row: JobRecord) -> JobRecord:
        """No coordinator for the job where this server looks: finalised if that is known for sure (its
        events end in a final state, or the launcher confirms the coordinator is gone), else UNKNOWN."""
        job_id = row.id
        events = read_job_events(Path(row.run_dir) / "events.jsonl", job_id)
        last = next((e for e in reversed(events) if e["kind"] == "transition"), None)
        if (last is not None and last["to_state"] in TERMINAL) or self.launcher.gone(job_id):
            return self._finalize_from_run_dir(row, "no coordinator is running for it", events)
        if row.state != UNKNOWN:
            where = self.launcher.where()
            logger.warning("job %s: no coordinator found on %s; shown as %s until it is found or confirmed "
                           "gone (is this server connected to the Ray cluster that runs it?)", job_id, where, UNKNOWN)
            st = row.status
            self.store.set_status(job_id, replace(
                st, state=UNKNOWN, since=self.clock(), world_size=0, running=None,
                reason=f"no coordinator found on {where}; last known state {st.state} at step {st.step or 0}. "
                       "It may run on another Ray cluster: connect this server to that one"))
        return self._row(job_id)

    def _fill_gap(self, row: JobRecord, rows: list[dict]) -> list[dict]:
        """`rows` from the coordinator, preceded by the steps between the store's last one and the
        first of `rows`, read from RUN_DIR/metrics.jsonl. A gap appears when a coordinator dies after
        its workers trained steps the store had not pulled yet, and its successor resumes from a
        checkpoint at or after them (it does not train them again, so it never reports them)."""
        last = self.store.last_step(row.id)
        if not rows or rows[0]["step"] <= last + 1:
            return rows
        logged: dict[int, dict] = {}
        for m in iter_metrics(Path(row.run_dir) / "metrics.jsonl", after=last, before=rows[0]["step"]):
            logged[m["step"]] = m  # the last time a step was trained is the run as it stands
        return [logged[s] for s in sorted(logged)] + rows

    def _finalize_from_run_dir(self, row: JobRecord, why: str, events: list[dict] | None = None) -> JobRecord:
        """The coordinator is gone: take the final state from the events it wrote."""
        job_id, run_dir = row.id, Path(row.run_dir)
        path = run_dir / "events.jsonl"
        if events is None:
            events = read_job_events(path, job_id)
        n = self.store.event_count(job_id)
        self.store.add_events(job_id, n, events[n:])
        after = self.store.last_step(job_id)
        for chunk in _chunks(iter_metrics(run_dir / "metrics.jsonl", after=after)):
            self.store.add_metrics(job_id, chunk)
        st = row.status.finalized(events, why=why, now=self.clock())
        st = replace(st, mfu=self._mfu_at(job_id, st.step))
        logger.info("job %s: no coordinator; final state %s from %s", job_id, st.state, path)
        self.store.set_status(job_id, st)
        self.store.mark_released(job_id)
        return self._row(job_id)

    # -- helpers -------------------------------------------------------------------------------------------
    def _row(self, job_id: str) -> JobRecord:
        row = self.store.get(job_id)
        if row is None:
            raise JobNotFound(job_id)
        return row

    def _mfu_at(self, job_id: str, step: Any) -> float | None:
        """The MFU of the stored metrics row of `step` (None without one, or where it was not computed)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            return None
        rows = self.store.metrics(job_id, step - 1, 1)
        v = rows[0].get("mfu") if rows and rows[0].get("step") == step else None
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    # -- sharing one cluster among the jobs --------------------------------------------------------------
    def _init_scheduling(self, quotas: Mapping[str, Quota] | None, shared: bool) -> None:
        self.quotas = dict(quotas or {})
        self.shared = shared
        """Whether jobs are scheduled: `elastron serve` does (Settings.schedule); in-process tests choose."""
        self._cfgs: dict[str, JobConfig] = {}
        self._told: dict[str, Tell] = {}
        """The last command each job was sent (not sent again)."""
        self._sizers: dict = {}
        self._granted: dict[str, dict[str, int]] = {}
        """The last grant each job was sent: its grant, whether or not its status shows it yet."""
        self._standby_caps: dict[str, int | None] = {}
        """The standby cap each job was last sent with its grant."""
        self._round_lock = threading.Lock()
        self.last_round: Round | None = None

    def first_grant(self) -> dict[str, int] | None:
        """The grant a new job is launched with: none yet (it starts QUEUED) when jobs are scheduled."""
        return {} if self.shared else None

    # -- one round -------------------------------------------------------------------------------------------
    def schedule_round(self) -> Round | None:
        """Decide and tell the coordinators; the round (None when jobs are not scheduled)."""
        if not self.shared:
            return None
        with self._round_lock:
            snap = self.launcher.cluster()
            if snap is None:
                return None
            views = [v for row in self.store.unsettled() if (v := self._job_view(row)) is not None]
            for gone in {*self._told, *self._granted, *self._sizers, *self._standby_caps} - {v.job_id for v in views}:
                for memo in (self._told, self._granted, self._sizers, self._cfgs, self._standby_caps):
                    memo.pop(gone, None)
            r = plan_round(snap, views, self.quotas, in_use=self.launcher.in_use(snap))
            for a in r.actions:
                self._carry_out(a)
            self.last_round = r
            return r

    def _carry_out(self, a: Tell) -> None:
        h = self._handles.get(a.job_id)
        if h is None or self._told.get(a.job_id) == a:
            return
        try:
            h.send(a.command)
        except (JobGone, JobUnavailable, ValueError) as e:
            logger.info("job %s: could not tell it %s (%s); the next round tries again", a.job_id,
                        type(a.command).__name__, e)
            return
        logger.info("job %s: %s", a.job_id, a.command)
        self._told[a.job_id] = a
        if isinstance(a.command, Grant):
            self._granted[a.job_id] = dict(a.command.nodes)
            self._standby_caps[a.job_id] = a.command.standby

    def _job_view(self, row: JobRecord) -> JobView | None:
        cfg = self._cfg_of(row)
        if cfg is None:
            return None
        st = row.status
        lo, hi = worker_range(cfg, row.workers)
        return JobView(job_id=row.id, owner=row.owner or "", priority=cfg.scheduling.priority,
                       weight=cfg.scheduling.weight, min_workers=st.min_workers or lo,
                       max_workers=st.max_workers or hi, submitted=row.created,
                       shape=WorkerShape(cpus=cfg.resources.cpus_per_worker, gpus=cfg.resources.gpus_per_worker),
                       state=st.state, cause=st.cause, held=dict(st.held),
                       grant=self._granted.get(row.id, st.grant),  # sent, perhaps not in its status yet
                       standby_per_node=0 if cfg.resources.gpus_per_worker else cfg.resources.standby_per_node,
                       standby_cap=self._standby_caps.get(row.id),
                       queue_position=st.queue_position, reason=st.reason, size_for=self._sizer(row.id, cfg))

    def _sizer(self, job_id: str, cfg: JobConfig):
        """The job's planner answer, cached: the most of n workers it can use."""
        if job_id not in self._sizers:
            model, constraints, memo = cfg.model.build(), job_constraints(cfg), {}

            def sizer(n: int) -> int | None:
                if n not in memo:
                    memo[n] = size_for(n, model, constraints)
                return memo[n]

            self._sizers[job_id] = sizer
        return self._sizers[job_id]

    def _cfg_of(self, row: JobRecord) -> JobConfig | None:
        cfg = self._cfgs.get(row.id)
        if cfg is None:
            try:
                cfg = validate_spec(row.spec, steps=row.steps, workers=row.workers)
            except Exception as e:
                logger.warning("job %s: its spec no longer parses (%s); it is not scheduled", row.id, e)
                return None
            self._cfgs[row.id] = cfg
        return cfg

    # -- what the API shows -------------------------------------------------------------------------------------
    def quota_usage(self, *, owner: str | None = None) -> list[dict]:
        """Per owner: the quota and what the owner's jobs hold now (a user sees only their own).
        `workers_held` counts the members the last round saw and the standby workers the jobs' statuses
        report (idle processes, which count against the quota: `service.sharing.rounds.standby_caps`)."""
        r = self.last_round
        held: dict[str, int] = {}
        running: dict[str, int] = {}
        if r is not None:
            rows = {row.id: row for row in self.store.unsettled()}
            for h in r.ledger.holdings:
                if h.job_id in rows:
                    o = rows[h.job_id].owner or ""
                    held[o] = held.get(o, 0) + h.workers + rows[h.job_id].status.standby
                    running[o] = running.get(o, 0) + 1
        names = sorted({*self.quotas, *held} - {""}) if owner is None else [owner]
        return [{"owner": o, "max_workers": self.quotas.get(o, Quota()).max_workers,
                 "max_jobs": self.quotas.get(o, Quota()).max_jobs, "workers_held": held.get(o, 0),
                 "jobs_running": running.get(o, 0)} for o in names]


_OTHER_JOB = re.compile(r"\bjob ([0-9a-f]{12})\b(?: \(priority -?\d+\))?")


def _redacted(v: Any, mine: set[str]) -> Any:
    """`v` (an event, a reason) with each "job ID (priority N)" of a job not in `mine` as "another job"."""
    if isinstance(v, str):
        return _OTHER_JOB.sub(lambda m: m.group(0) if m.group(1) in mine else "another job", v)
    if isinstance(v, dict):
        return {k: _redacted(x, mine) for k, x in v.items()}
    if isinstance(v, list):
        return [_redacted(x, mine) for x in v]
    return v


def _chunks(it, n: int = 10_000):
    """`it` in lists of at most n (a long metrics.jsonl is stored without holding it all)."""
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf


class _Locked:
    def __init__(self, owner: JobManager, job_id: str):
        self.owner, self.job_id = owner, job_id
        self.lock: threading.RLock | None = None

    def __enter__(self) -> JobRecord:
        o = self.owner
        o._row(self.job_id)  # JobNotFound before a lock exists for an unknown id
        self.lock = o._lock_of(self.job_id)
        if not self.lock.acquire(timeout=o.lock_timeout_s):
            raise JobUnavailable(f"job {self.job_id} is busy (its coordinator is slow to answer): nothing was done; "
                                 "retry in a moment")
        row = o.store.get(self.job_id)
        if row is None:  # deleted while this waited for the lock
            self.lock.release()
            o._forget_lock(self.job_id, self.lock)
            raise JobNotFound(self.job_id)
        return row

    def __exit__(self, *exc) -> None:
        self.lock.release()


def queued_status(st: JobStatus, reason: str) -> JobStatus:
    """A just-submitted job's stored status when jobs are scheduled: QUEUED until its first round."""
    return replace(st, state="QUEUED", reason=reason)


def _conflict(cmd: SetWorkers | Pause | Resume | Stop, state: str) -> str | None:
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
