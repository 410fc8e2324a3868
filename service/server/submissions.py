"""The submissions: a job request checked, recorded with the places it claims, and its coordinator launched.

Checked in this order, nothing recorded until all pass: the text and every place the request names
(service.server.admission), the spec (parsed once, here: the JobConfig it gives is what the coordinator and
the workers get), the user's priority ceiling; then, atomically with the insert, an idempotent repeat, the
user's unfinished jobs, the places other jobs hold, and the user's quota on a shared cluster. A submit
also forgets the user's oldest finished jobs beyond max_finished_jobs.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.control.job import Job
from service.control.state import TERMINAL
from service.control.status import JobStatus
from service.server.admission import Admission, Claim, Place, place_of
from service.server.coordinators import Coordinators
from service.server.job_locks import JobLocks
from service.server.job_types import JobConflict, JobForbidden, JobNotFound, JobRecord, Store
from service.server.scheduling import Scheduling
from service.server.specs import SpecError, check_text, safe_name, validate_spec
from service.sharing.scheduler import Quota

logger = logging.getLogger(__name__)

MAX_LIVE_JOBS_PER_USER = 32
"""Default for a user's unfinished jobs at once (`max_live_jobs`)."""
MAX_FINISHED_JOBS_PER_USER = 100
"""Default for a user's finished jobs kept in the store (`max_finished_jobs`)."""


@dataclass(frozen=True, slots=True)
class Submitted:
    """What a submit did: the job's id (an earlier job's, for an idempotent repeat) and the ids of the
    owner's finished jobs it forgot to stay within max_finished_jobs."""
    job_id: str
    forgotten: tuple[str, ...] = ()


class Submissions:
    def __init__(self, store: Store, admission: Admission, coordinators: Coordinators, locks: JobLocks,
                 scheduling: Scheduling, *, clock: Callable[[], float],
                 max_live_jobs: int | None = MAX_LIVE_JOBS_PER_USER,
                 max_finished_jobs: int = MAX_FINISHED_JOBS_PER_USER):
        if not isinstance(max_finished_jobs, int) or max_finished_jobs < 0:
            raise ValueError(f"max_finished_jobs must be a whole number >= 0, got {max_finished_jobs!r}")
        self.store, self.admission, self.coordinators, self.locks = store, admission, coordinators, locks
        self.scheduling, self.clock = scheduling, clock
        self.max_live_jobs, self.max_finished_jobs = max_live_jobs, max_finished_jobs
        self._insert_lock = threading.Lock()  # area checks + insert, atomically

    def submit(self, spec: dict, *, steps: int | None = None, workers: int | None = None,
               run_dir: str | None = None, owner: str | None = None, idempotency_key: str | None = None) -> Submitted:
        """Check and start a job. With `idempotency_key`, a repeat of the same request by the same owner
        gives the first one's id instead of starting a second job (JobConflict when the request differs).
        A coordinator that cannot be launched leaves the job recorded as FAILED."""
        # Paths first, on the raw request: validate_spec looks at data.path on disk.
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
        grant = self.scheduling.first_grant()
        status = JobStatus.submitted(total_steps=job.total_steps, now=now)
        if grant is not None:
            status = queued_status(status, "waiting for the shared-cluster scheduler's first round")
        request = {"spec": spec, "steps": steps, "workers": workers, "run_dir": run_dir}
        # The job lock: the sync thread must not look for the coordinator before it is launched.
        lock = self.locks.lock_of(job_id)
        with lock:
            try:
                with self._insert_lock:
                    if idempotency_key is not None and (first := self.store.find_idempotent(owner, idempotency_key)):
                        if first.request != request:
                            raise JobConflict(f"Idempotency-Key {idempotency_key!r} was used for another request "
                                              f"(job {first.id}); use a new key for a new job")
                        self.locks.forget(job_id, lock)
                        return Submitted(first.id)
                    self._check_live_jobs(owner)
                    forgotten = self._prune_finished(owner)
                    self._check_claims(places, owner)
                    self._check_quota(job, owner)
                    self.store.create(JobRecord(
                        id=job_id, name=cfg.name, spec=spec, steps=steps, workers=workers, run_dir=str(rd),
                        created=now, updated=now, owner=owner, idempotency_key=idempotency_key, request=request,
                        status=status), [Claim(job_id=job_id, owner=owner, field=f, place=p) for f, p in places.items()])
                    self.scheduling.admitted(job_id, cfg)
            except BaseException:  # no job was recorded: its lock goes too
                self.locks.forget(job_id, lock)
                raise
            try:
                self.coordinators.launch(job, grant)
            except Exception as e:
                logger.warning("job %s: could not start its coordinator; it is recorded as FAILED", job_id,
                               exc_info=True)
                self.store.set_status(job_id, JobStatus.not_started(e, total_steps=job.total_steps, now=now))
                self.store.mark_released(job_id)
        return Submitted(job_id, forgotten)

    def record_old_claims(self) -> list[Claim]:
        """Places of jobs the store kept from before it recorded them, recorded now (as they were stored);
        the claims recorded."""
        held = {c.job_id for c in self.store.claims()}
        old = []
        for r in self.store.list():
            if r.id in held:
                continue
            for field, where in (("run_dir", r.run_dir), ("checkpoint.dir", r.checkpoint_dir)):
                if where and (p := place_of(where, azure_account=self.admission.azure_account)) is not None:
                    old.append(Claim(job_id=r.id, owner=r.owner, field=field, place=p))
        self.store.add_claims(old)
        return old

    def free_places(self, job_id: str) -> dict:
        """Forget the tombstones a deleted job left (an admin's act): its places may be claimed again by
        anyone. JobNotFound when it left none."""
        if self.store.get(job_id) is not None:
            raise JobConflict(f"job {job_id} is not deleted: delete it first; its places are freed after")
        if not (n := self.store.free_claims(job_id)):
            raise JobNotFound(job_id)
        return {"id": job_id, "freed": n}

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
        top = self.scheduling.quotas.get(owner, Quota()).max_priority
        if top is not None and priority > top:
            raise JobForbidden(f"scheduling.priority {priority} is above your ceiling of {top} (set by the "
                               f"operator in ELASTRON_QUOTAS, NAME=WORKERS:JOBS:PRIORITY): ask for at most {top}")

    def _check_quota(self, job: Job, owner: str | None) -> None:
        """On a shared cluster, a job its owner's quota could never run is refused now instead of queued
        forever: its minimum above the quota's workers, or a quota of no jobs."""
        if not self.scheduling.shared or owner is None:
            return
        q = self.scheduling.quotas.get(owner, Quota())
        if q.max_jobs == 0:
            raise SpecError(("spec",), f"owner {owner}'s quota allows no jobs (max_jobs=0): ask an admin for a quota")
        if q.max_workers is not None and job.min_workers > q.max_workers:
            forced = job.layout or job.cfg.parallel.layout
            loc, what = (("spec", "parallel", "layout"), f"layout {forced} runs on exactly {job.min_workers} workers") \
                if forced else (("spec", "parallel", "min_workers"), f"min_workers={job.min_workers}")
            raise SpecError(loc, f"{what}, but owner {owner}'s quota allows {q.max_workers} workers, so the job "
                                 f"could never start: ask for at most {q.max_workers} workers, or a larger quota")

    def _prune_finished(self, owner: str | None) -> tuple[str, ...]:
        """Forget a user's oldest finished (and released) jobs beyond max_finished_jobs: their records,
        events, metrics and locks. Their run directories stay, and so do their places (tombstones, as after
        DELETE). Returns the ids forgotten."""
        if owner is None:
            return ()
        done = [r.id for r in self.store.list(owner=owner) if r.state in TERMINAL and r.released]
        gone = tuple(done[:max(0, len(done) - self.max_finished_jobs)])
        for job_id in gone:  # oldest first (the store lists by creation time)
            self.store.delete(job_id)
            self.locks.forget(job_id)
        if gone:
            logger.info("user %s: forgot %d finished job(s) beyond ELASTRON_MAX_FINISHED_JOBS=%d: %s", owner, len(gone),
                        self.max_finished_jobs, ", ".join(gone))
        return gone


def queued_status(st: JobStatus, reason: str) -> JobStatus:
    """A just-submitted job's stored status when jobs are scheduled: QUEUED until its first round."""
    return replace(st, state="QUEUED", reason=reason)
