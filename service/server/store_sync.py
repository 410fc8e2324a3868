"""The store sync: keeps each job's stored status, events and metrics in step with its coordinator.

Reads are served from the store; `sync(job_id)` pulls one job (status first, so that a terminal status
means the events after it are complete), releases a finished job's coordinator, and finalises from the run
directory a job whose coordinator is gone. A job whose coordinator this server cannot find and cannot
confirm gone is UNKNOWN until either is known. `round()` syncs every unsettled job, each on a pool thread,
so that one stuck coordinator holds up no other job; a slow owner's jobs may hold only a few threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from pathlib import Path
from typing import Any

from service.control.run_files import iter_metrics, read_job_events
from service.control.state import TERMINAL
from service.server.coordinators import Coordinators
from service.server.job_locks import JobLocks
from service.server.job_types import JobGone, JobNotFound, JobRecord, JobUnavailable, Store

logger = logging.getLogger(__name__)

SYNC_THREADS = 8
"""Coordinators synced at the same time."""
SYNC_THREADS_PER_OWNER = 2
"""Of those, at most this many may be held by one owner's slow jobs (whose last sync, or the one running,
took longer than a sync interval): one user's stuck coordinators cannot hold every sync thread and leave
other users' statuses stale."""
TRACEBACK_EVERY_S = 60.0
"""A job whose sync keeps failing logs its traceback at most this often (one line otherwise)."""
UNKNOWN = "UNKNOWN"
"""The state shown for a job whose coordinator this server cannot find and cannot confirm gone."""


class StoreSync:
    def __init__(self, store: Store, coordinators: Coordinators, locks: JobLocks, *, sync_interval_s: float,
                 stop_timeout_s: float, clock: Callable[[], float]):
        self.store, self.coordinators, self.locks = store, coordinators, locks
        self.sync_interval_s, self.stop_timeout_s, self.clock = sync_interval_s, stop_timeout_s, clock
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}
        self._sync_started: dict[str, float] = {}
        """When each job's sync in flight was handed to the pool (time.monotonic)."""
        self._slow: set[str] = set()
        """Jobs whose last sync took longer than a sync interval."""
        self._last_traceback: dict[str, float] = {}

    # -- the pool ------------------------------------------------------------------------------------------
    def open(self) -> None:
        """Start the pool the rounds sync on."""
        self._pool = ThreadPoolExecutor(max_workers=SYNC_THREADS, thread_name_prefix="JobManager-sync")
        self._inflight = {}  # futures of an earlier open() were cancelled by its close()

    def close(self) -> None:
        """Stop the pool: syncs not begun are cancelled, running ones finish."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._inflight = {}

    def wait(self, timeout: float | None = None) -> None:
        """Until the syncs in flight end, or `timeout` seconds."""
        wait_futures(list(self._inflight.values()), timeout=timeout)

    def forget(self, job_id: str) -> None:
        """Forget what is kept about a deleted job's syncs."""
        self._last_traceback.pop(job_id, None)

    # -- one round -----------------------------------------------------------------------------------------
    def round(self, stop: threading.Event | None = None) -> None:
        """Sync every unsettled job on the pool (`open` first), handing out none once `stop` is set; a job whose last sync is still running is
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
            if stop is not None and stop.is_set():
                return
            busy = self._inflight.get(row.id)
            if busy is not None and not busy.done():
                continue
            if row.id in self._slow:
                if slow.get(row.owner, 0) >= SYNC_THREADS_PER_OWNER:
                    continue
                slow[row.owner] = slow.get(row.owner, 0) + 1
            self._sync_started[row.id] = now
            self._inflight[row.id] = self._pool.submit(self.sync_quietly, row.id)
        for job_id in [j for j, f in self._inflight.items() if f.done()]:
            del self._inflight[job_id]  # settled or deleted jobs leave no trace
            self._sync_started.pop(job_id, None)
            if self.store.get(job_id) is None or job_id not in owner_of:
                self._slow.discard(job_id)

    def sync_quietly(self, job_id: str) -> None:
        """`sync`, its errors logged (the traceback at most every TRACEBACK_EVERY_S per job): the next round
        tries again. A sync that took longer than a sync interval marks the job slow."""
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

    # -- one job -------------------------------------------------------------------------------------------
    def sync(self, job_id: str) -> JobRecord:
        """Pull status, new events and new metrics from the job's coordinator into the store; returns
        the stored record. A finished job is synced one last time, then its coordinator is released."""
        with self.locks.held(job_id, self.store.get) as row:
            if row.state in TERMINAL and row.released:
                return row
            h = self.coordinators.get(job_id)
            if h is None:
                h = self.coordinators.attach(job_id)
                if h is None:
                    return self._not_found(row)
                logger.info("job %s: re-attached to its coordinator", job_id)
            try:
                st = h.status()  # first, so that a terminal status means the events below are complete
                events = h.events_since(self.store.event_count(job_id))
                rows = h.metrics_since(self.store.last_step(job_id))
            except JobGone as e:
                self.coordinators.drop(job_id)
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
                self.coordinators.release(job_id, self.stop_timeout_s)
                self.store.mark_released(job_id)
            return self._row(job_id)

    def _not_found(self, row: JobRecord) -> JobRecord:
        """No coordinator for the job where this server looks: finalised if that is known for sure (its
        events end in a final state, or the launcher confirms the coordinator is gone), else UNKNOWN."""
        job_id = row.id
        events = read_job_events(Path(row.run_dir) / "events.jsonl", job_id)
        last = next((e for e in reversed(events) if e["kind"] == "transition"), None)
        if (last is not None and last["to_state"] in TERMINAL) or self.coordinators.gone(job_id):
            return self._finalize_from_run_dir(row, "no coordinator is running for it", events)
        if row.state != UNKNOWN:
            where = self.coordinators.where()
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


def _chunks(it: Iterable, n: int = 10_000) -> Iterator[list]:
    """`it` in lists of at most n (a long metrics.jsonl is stored without holding it all)."""
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf
