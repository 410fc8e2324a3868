"""The scheduling rounds on a shared cluster: each round reads every unsettled job from the store, asks
service.sharing.rounds what to tell the coordinators, and tells them.

Every input is read again each round (the jobs' stored statuses, the cluster), so a restarted server
loses nothing; what is remembered between rounds is only what was sent (a command is not sent twice, and
a grant sent counts before the job's status shows it) and each job's parsed spec and planner answers.
Off (`shared=False`), there are no rounds: each job plans onto what it finds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from parallel.planner import size_for
from service.control.commands import Grant
from service.control.job import worker_range
from service.server.coordinators import Coordinators
from service.server.job_types import JobGone, JobRecord, JobUnavailable, Launcher, Store
from service.server.specs import validate_spec
from service.sharing.decisions import JobRequest
from service.sharing.ledger import WorkerShape
from service.sharing.rounds import JobView, Round, Tell, plan_round
from service.sharing.scheduler import Quota
from workers.config import JobConfig, job_constraints

logger = logging.getLogger(__name__)

TRACEBACK_EVERY_S = 60.0
"""A round that keeps failing logs its traceback at most this often (one line otherwise)."""


class Scheduling:
    def __init__(self, store: Store, launcher: Launcher, coordinators: Coordinators, *,
                 quotas: Mapping[str, Quota] | None = None, shared: bool = False):
        """`launcher` shows the cluster and what is in use on it; `coordinators` are told."""
        self.store, self.launcher, self.coordinators = store, launcher, coordinators
        self.quotas: dict[str, Quota] = dict(quotas or {})
        self.shared = shared
        """Whether jobs are scheduled: `elastron serve` does (Settings.schedule); in-process tests choose."""
        self.last_round: Round | None = None
        self._cfgs: dict[str, JobConfig] = {}
        self._told: dict[str, Tell] = {}
        """The last command each job was sent (not sent again)."""
        self._sizers: dict[str, Callable[[int], int | None]] = {}
        self._granted: dict[str, dict[str, int]] = {}
        """The last grant each job was sent: its grant, whether or not its status shows it yet."""
        self._standby_caps: dict[str, int | None] = {}
        """The standby cap each job was last sent with its grant."""
        self._lock = threading.Lock()
        self._last_traceback = -TRACEBACK_EVERY_S

    def first_grant(self) -> dict[str, int] | None:
        """The grant a new job is launched with: none yet (it starts QUEUED) when jobs are scheduled."""
        return {} if self.shared else None

    def admitted(self, job_id: str, cfg: JobConfig) -> None:
        """A job just recorded, with the config its spec parsed to (not parsed again for its rounds)."""
        if self.shared:
            self._cfgs[job_id] = cfg

    def round(self) -> Round | None:
        """Decide and tell the coordinators; the round (None when jobs are not scheduled, or the launcher
        sees no cluster)."""
        if not self.shared:
            return None
        with self._lock:
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

    def round_quietly(self) -> Round | None:
        """`round`, its errors logged (the traceback at most every TRACEBACK_EVERY_S): the next one tries again."""
        try:
            return self.round()
        except Exception as e:
            now = time.monotonic()
            loud = now - self._last_traceback >= TRACEBACK_EVERY_S
            if loud:
                self._last_traceback = now
            logger.warning("the scheduling round failed (%s: %s); the next one tries again", type(e).__name__, e,
                           exc_info=loud)
            return None

    def _carry_out(self, a: Tell) -> None:
        h = self.coordinators.get(a.job_id)
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
        request = JobRequest(job_id=row.id, owner=row.owner or "", priority=cfg.scheduling.priority,
                             weight=cfg.scheduling.weight, min_workers=st.min_workers or lo,
                             max_workers=st.max_workers or hi, submitted=row.created,
                             shape=WorkerShape(cpus=cfg.resources.cpus_per_worker, gpus=cfg.resources.gpus_per_worker))
        return JobView(request=request, state=st.state, cause=st.cause, held=dict(st.held),
                       grant=self._granted.get(row.id, st.grant),  # sent, perhaps not in its status yet
                       standby_per_node=0 if cfg.resources.gpus_per_worker else cfg.resources.standby_per_node,
                       standby_cap=self._standby_caps.get(row.id),
                       queue_position=st.queue_position, reason=st.reason, size_for=self._sizer(row.id, cfg))

    def _sizer(self, job_id: str, cfg: JobConfig) -> Callable[[int], int | None]:
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
