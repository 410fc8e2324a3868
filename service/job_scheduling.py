"""The job manager's third part: sharing one cluster among its jobs (issue 16).

When jobs are scheduled (`shared`; `elastron serve` does by default), every job is launched QUEUED with an
empty grant, and a scheduling round (service.shared_cluster.plan_round) runs after each sync round and
after each submit: it reads every job's last status, decides with the pure policy (service.scheduler)
and tells the coordinators (grant, pause, resume). Otherwise (in-process tests, ELASTRON_SCHEDULE=0) jobs
are not scheduled and each plans onto what it finds.

What was told is remembered (`_told`, `_granted`) while the job is unfinished, so that a round that runs
before the next sync neither repeats a command nor gives the same workers twice. After an API restart
nothing is remembered and nothing needs to be: the grants are read back from the coordinators' statuses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import replace

from service.job_types import JobGone, JobRecord, JobUnavailable, Launcher, Store
from service.ledger import WorkerShape
from service.scheduler import Quota
from service.shared_cluster import Action, JobView, PauseJob, ResumeJob, Round, SetGrant, plan_round
from service.specs import validate_spec, worker_range
from service.status import JobStatus
from parallel.planner import size_for
from workers.config import JobConfig, job_constraints

logger = logging.getLogger("service.job_manager")


class JobScheduling:
    """Mixin of service.job_manager.JobManager (which sets `store`, `launcher` and `_handles`)."""

    store: Store
    launcher: Launcher

    def _init_scheduling(self, quotas: Mapping[str, Quota] | None, shared: bool) -> None:
        self.quotas = dict(quotas or {})
        self.shared = shared
        """Whether jobs are scheduled: `elastron serve` does (Settings.schedule); in-process tests choose."""
        self._cfgs: dict[str, JobConfig] = {}
        self._told: dict[str, Action] = {}
        """The last command each job was sent (not sent again)."""
        self._sizers: dict = {}
        self._granted: dict[str, dict[str, int]] = {}
        """The last grant each job was sent: its grant, whether or not its status shows it yet."""
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
            for gone in {*self._told, *self._granted, *self._sizers} - {v.job_id for v in views}:
                for memo in (self._told, self._granted, self._sizers, self._cfgs):
                    memo.pop(gone, None)
            r = plan_round(snap, views, self.quotas, in_use=self.launcher.in_use(snap))
            for a in r.actions:
                self._carry_out(a)
            self.last_round = r
            return r

    def _carry_out(self, a: Action) -> None:
        h = self._handles.get(a.job_id)
        if h is None or self._told.get(a.job_id) == a:
            return
        try:
            match a:
                case SetGrant():
                    h.set_grant(a.nodes, a.reason, a.queue_position)
                case PauseJob():
                    h.pause(by="scheduler", reason=a.reason)
                case ResumeJob():
                    h.resume(by="scheduler")
        except (JobGone, JobUnavailable, ValueError) as e:
            logger.info("job %s: could not tell it %s (%s); the next round tries again", a.job_id,
                        type(a).__name__, e)
            return
        logger.info("job %s: %s", a.job_id, a)
        self._told[a.job_id] = a
        if isinstance(a, SetGrant):
            self._granted[a.job_id] = dict(a.nodes)

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
        """Per owner: the quota and what the owner's jobs hold now (a user sees only their own)."""
        r = self.last_round
        held: dict[str, int] = {}
        running: dict[str, int] = {}
        if r is not None:
            owners = {row.id: row.owner or "" for row in self.store.unsettled()}
            for h in r.ledger.holdings:
                if h.job_id in owners:
                    o = owners[h.job_id]
                    held[o] = held.get(o, 0) + h.workers
                    running[o] = running.get(o, 0) + 1
        names = sorted({*self.quotas, *held} - {""}) if owner is None else [owner]
        return [{"owner": o, "max_workers": self.quotas.get(o, Quota()).max_workers,
                 "max_jobs": self.quotas.get(o, Quota()).max_jobs, "workers_held": held.get(o, 0),
                 "jobs_running": running.get(o, 0)} for o in names]


def queued_status(st: JobStatus, reason: str) -> JobStatus:
    """A just-submitted job's stored status when jobs are scheduled: QUEUED until its first round."""
    return replace(st, state="QUEUED", reason=reason)
