"""The coordinators this server holds handles to: launched or re-attached through the launcher, let go
when their jobs end.

A job's coordinator runs apart from this server (a named detached Ray actor, via a launcher), so a
restarted server holds no handles: `attach` finds a coordinator again by its job id. `release` lets it go
(its process ends); `drop` only forgets the handle (the coordinator may still run, e.g. a gone one).
"""

from __future__ import annotations

import threading

from service.control.job import Job
from service.server.job_types import JobHandle, Launcher


class Coordinators:
    def __init__(self, launcher: Launcher):
        self.launcher = launcher
        self._handles: dict[str, JobHandle] = {}
        self._guard = threading.Lock()

    def launch(self, job: Job, grant: dict[str, int] | None) -> JobHandle:
        """Start the job's coordinator (with `grant` when jobs are scheduled: a launcher for unscheduled
        jobs takes none) and hold its handle."""
        h = self.launcher.launch(job) if grant is None else self.launcher.launch(job, grant=grant)
        with self._guard:
            self._handles[job.id] = h
        return h

    def get(self, job_id: str) -> JobHandle | None:
        """The handle held for the job (None: none held; `attach` may find one)."""
        with self._guard:
            return self._handles.get(job_id)

    def attach(self, job_id: str) -> JobHandle | None:
        """The held handle, else the coordinator found by the launcher (then held); None when none is found."""
        if (h := self.get(job_id)) is not None:
            return h
        if (h := self.launcher.attach(job_id)) is not None:
            with self._guard:
                self._handles[job_id] = h
        return h

    def drop(self, job_id: str) -> None:
        """Forget the job's handle; its coordinator is not told."""
        with self._guard:
            self._handles.pop(job_id, None)

    def drop_all(self) -> None:
        """Forget every handle, as a freshly started server holds none."""
        with self._guard:
            self._handles.clear()

    def release(self, job_id: str, timeout_s: float) -> None:
        """Let the job's coordinator go (the launcher ends it) and forget its handle."""
        self.launcher.release(job_id, timeout_s)
        self.drop(job_id)

    def gone(self, job_id: str) -> bool:
        return self.launcher.gone(job_id)

    def where(self) -> str:
        return self.launcher.where()
