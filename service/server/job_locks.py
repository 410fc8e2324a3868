"""The per-job locks: one re-entrant lock per job, held while its coordinator is asked or its record written.

A lock is made on first use and forgotten with its job. `held(job_id, read)` takes the job's lock and
yields its record; an id the store does not have is JobNotFound *before* a lock is made for it, so
requests for random ids do not grow memory. `one_command(job_id, action)` lets at most one command per job
wait for its lock (a stuck coordinator makes the wait long): the others are JobUnavailable at once, so one
job's commands cannot take every request thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from service.server.job_types import JobNotFound, JobRecord, JobUnavailable

LOCK_TIMEOUT_S = 30.0
"""Default for how long a request waits for a job's lock (`lock_timeout_s`) before a 503."""


class JobLocks:
    def __init__(self, lock_timeout_s: float = LOCK_TIMEOUT_S):
        self.lock_timeout_s = lock_timeout_s
        self._locks: dict[str, threading.RLock] = {}
        self._guard = threading.Lock()
        self._commanding: set[str] = set()

    def lock_of(self, job_id: str) -> threading.RLock:
        with self._guard:
            return self._locks.setdefault(job_id, threading.RLock())

    def forget(self, job_id: str, lock: threading.RLock | None = None) -> None:
        """Drop the job's lock (only if it is still `lock`, when given)."""
        with self._guard:
            if lock is None or self._locks.get(job_id) is lock:
                self._locks.pop(job_id, None)

    def known(self) -> frozenset[str]:
        """The jobs that have a lock now."""
        with self._guard:
            return frozenset(self._locks)

    @contextmanager
    def held(self, job_id: str, read: Callable[[str], JobRecord | None]) -> Iterator[JobRecord]:
        """The job's lock, held, yielding its record as `read` gives it: JobNotFound when `read` has none
        (before a lock is made, or after the wait when the job was deleted meanwhile), JobUnavailable when
        the lock is not free within lock_timeout_s."""
        if read(job_id) is None:
            raise JobNotFound(job_id)
        lock = self.lock_of(job_id)
        if not lock.acquire(timeout=self.lock_timeout_s):
            raise JobUnavailable(f"job {job_id} is busy (its coordinator is slow to answer): nothing was done; "
                                 "retry in a moment")
        try:
            row = read(job_id)
            if row is None:  # deleted while this waited for the lock
                self.forget(job_id, lock)
                raise JobNotFound(job_id)
            yield row
        finally:
            lock.release()

    @contextmanager
    def one_command(self, job_id: str, action: str) -> Iterator[None]:
        """At most one command per job at a time; another one meanwhile is JobUnavailable (503, retry)."""
        with self._guard:
            if job_id in self._commanding:
                raise JobUnavailable(f"cannot {action} job {job_id} now: another command for it is still being "
                                     "delivered to its coordinator; retry in a moment")
            self._commanding.add(job_id)
        try:
            yield
        finally:
            with self._guard:
                self._commanding.discard(job_id)
