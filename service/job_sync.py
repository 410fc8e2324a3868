"""The job manager's other half: keeping the store in step with the jobs' coordinators.

Reads never wait for a coordinator: they are served from the store, and a background thread pulls
status, new events and new metrics from every unsettled job's coordinator (`sync`), each on a pool
thread, so one slow coordinator holds up neither the others nor any request.

A coordinator that cannot be found is not taken for dead: this server may be connected to another Ray
cluster than the one the job runs on (`elastron serve` without an address starts a private one). Its
job is shown as UNKNOWN, and synced again every round, until the coordinator is found, the run
directory's events.jsonl shows that the job finished, or the launcher confirms that the coordinator
ended for good (`Launcher.gone`): only then is the job finalised, as FAILED when its events do not
end in a final state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from pathlib import Path
from typing import Any

from service.job_types import JobGone, JobHandle, JobNotFound, JobRecord, JobUnavailable, Launcher, Store
from service.run_files import iter_metrics, read_job_events
from service.state import TERMINAL

logger = logging.getLogger("service.job_manager")

SYNC_THREADS = 8
"""Coordinators synced at the same time."""
TRACEBACK_EVERY_S = 60.0
"""A job whose sync keeps failing logs its traceback at most this often (one line otherwise)."""
UNKNOWN = "UNKNOWN"
"""The state shown for a job whose coordinator this server cannot find and cannot confirm gone."""


class JobSyncing:
    """Background syncing for JobManager (which sets the attributes named in __init__)."""

    store: Store
    launcher: Launcher
    sync_interval_s: float
    stop_timeout_s: float
    clock: Callable[[], float]

    def _init_sync(self) -> None:
        self._handles: dict[str, JobHandle] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}
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
        self._thread = threading.Thread(target=self._loop, name="JobManager-sync", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop syncing. The jobs go on: their coordinators do not belong to this process."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._inflight = {}

    def _loop(self) -> None:
        while not self._stop.wait(self.sync_interval_s):
            self._sync_round()
            # The scheduling round decides on the statuses this sync round brings (a shrink that just
            # ended frees the workers a queued job waits for), not on the previous round's.
            wait_futures(list(self._inflight.values()), timeout=self.sync_interval_s)
            self._schedule_quietly()

    def _schedule_quietly(self) -> None:
        """A scheduling round (service.job_scheduling), its errors logged (the traceback at most every
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
        skipped this round."""
        for row in self.store.unsettled():
            if self._stop.is_set():
                return
            busy = self._inflight.get(row.id)
            if busy is None or busy.done():
                self._inflight[row.id] = self._pool.submit(self._sync_quietly, row.id)
        for job_id in [j for j, f in self._inflight.items() if f.done()]:
            del self._inflight[job_id]  # settled or deleted jobs leave no trace

    def _sync_quietly(self, job_id: str) -> None:
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

    # -- the job lock ----------------------------------------------------------------------------------------
    def _lock_of(self, job_id: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks.setdefault(job_id, threading.RLock())

    def _forget_lock(self, job_id: str, lock: threading.RLock | None = None) -> None:
        with self._locks_guard:
            if lock is None or self._locks.get(job_id) is lock:
                self._locks.pop(job_id, None)

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
    def __init__(self, owner: JobSyncing, job_id: str):
        self.owner, self.job_id = owner, job_id
        self.lock: threading.RLock | None = None

    def __enter__(self) -> JobRecord:
        o = self.owner
        o._row(self.job_id)  # JobNotFound before a lock exists for an unknown id
        self.lock = o._lock_of(self.job_id)
        self.lock.acquire()
        row = o.store.get(self.job_id)
        if row is None:  # deleted while this waited for the lock
            self.lock.release()
            o._forget_lock(self.job_id, self.lock)
            raise JobNotFound(self.job_id)
        return row

    def __exit__(self, *exc) -> None:
        self.lock.release()
