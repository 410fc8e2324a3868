"""The job manager: the one thing the API talks to. Submits, lists, looks up and commands jobs, and keeps
the store in step with the jobs' coordinators.

Each job's coordinator runs apart from the API (a named detached Ray actor, via a launcher), so the API
can restart without the jobs noticing. The store holds what the API shows: spec, last status, events
and metrics. `sync(id)` pulls what is new from the coordinator into the store; a background thread does
it for every live job, and reads of one job do it first so they are fresh.

Re-attach (`start()`): every job the store has as not finished is looked up by name through the
launcher. Found: it is synced and watched again. Gone: the job ended (or died) while the API was down,
so its final state is read from the run directory's events.jsonl (the coordinator writes every
transition there before acting on it), and metrics.jsonl fills in metrics the store missed.

Knows nothing of HTTP: errors are named exceptions (JobNotFound, JobConflict, SpecError,
JobUnavailable) that the API turns into status codes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from service.job_actor import JobGone, JobUnavailable
from service.run_files import list_checkpoints, read_job_events, read_metrics
from service.specs import SpecError, check_paths, resolve_run_dir, safe_name, validate_spec
from service.state import TERMINAL
from service.status import JobStatus
from workers.config import JobConfig

logger = logging.getLogger(__name__)

__all__ = ["JobConflict", "JobHandle", "JobManager", "JobNotFound", "JobUnavailable", "Launcher", "Store",
           "TERMINAL"]


class JobNotFound(KeyError):
    def __str__(self) -> str:
        return f"no job with id {self.args[0]!r}"


class JobConflict(RuntimeError):
    """The action does not fit the job's state (e.g. resume of a running job); the message says why."""


# -- the seams: where jobs run and where they are recorded ------------------------------------------------

class JobHandle(Protocol):
    def status(self) -> JobStatus: ...
    def events_since(self, index: int = 0) -> list[dict]: ...
    def metrics_since(self, step: int = 0) -> list[dict]: ...
    def resize(self, **kw) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self) -> None: ...


class Launcher(Protocol):
    """Starts a job's coordinator and finds it again by job id (service.job_actor has a Ray one and an
    in-process one)."""

    def launch(self, job_id: str, cfg: JobConfig, *, run_dir: str, steps: int | None,
               workers: int | None) -> JobHandle: ...
    def attach(self, job_id: str) -> JobHandle | None: ...
    def release(self, job_id: str, timeout_s: float = 10.0) -> None: ...
    def cluster(self) -> Any: ...


class Store(Protocol):
    """What the manager needs of a store (api.store.JobStore is one)."""

    def create(self, job: dict) -> None: ...
    def get(self, job_id: str) -> dict | None: ...
    def list(self) -> list[dict]: ...
    def set_status(self, job_id: str, status: dict) -> None: ...
    def add_events(self, job_id: str, start: int, events: list[dict]) -> None: ...
    def add_metrics(self, job_id: str, rows: list[dict]) -> None: ...
    def events(self, job_id: str, since: int = 0) -> list[dict]: ...
    def metrics(self, job_id: str, since: int = 0, limit: int | None = None) -> list[dict]: ...
    def event_count(self, job_id: str) -> int: ...
    def last_step(self, job_id: str) -> int: ...
    def mark_released(self, job_id: str) -> None: ...
    def delete(self, job_id: str) -> None: ...


# -- the manager -------------------------------------------------------------------------------------------

SYNC_THREADS = 8
"""Coordinators synced at the same time."""


class JobManager:
    def __init__(self, store: Store, launcher: Launcher, *, runs_root: str | Path, sync_interval_s: float = 0.5,
                 stop_timeout_s: float = 10.0, clock: Callable[[], float] = time.time,
                 data_roots: Sequence[str | Path] | None = None):
        """`data_roots`: directories a spec's data.path may lie under (None: the runs root only)."""
        self.store, self.launcher = store, launcher
        self.runs_root = Path(runs_root)
        self.data_roots = [Path(r) for r in data_roots] if data_roots is not None else [self.runs_root]
        self.sync_interval_s, self.stop_timeout_s, self.clock = sync_interval_s, stop_timeout_s, clock
        self._handles: dict[str, JobHandle] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._submit_lock = threading.Lock()  # run_dir check + insert, atomically
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach to the coordinators of unfinished jobs (or record how they ended), then keep syncing."""
        self._pool = ThreadPoolExecutor(max_workers=SYNC_THREADS, thread_name_prefix="JobManager-sync")
        self._inflight = {}  # futures of an earlier start() were cancelled by its close()
        self._sync_round()
        for f in list(self._inflight.values()):
            f.result()  # _sync_quietly logs and swallows a job's sync errors
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

    def _sync_round(self) -> None:
        """Sync every unfinished job, each on a pool thread, so that one coordinator that answers slowly
        (up to the launcher's timeout) does not hold up the others; a job whose last sync is still
        running is skipped this round."""
        for row in self.store.list():
            if self._stop.is_set():
                return
            busy = self._inflight.get(row["id"])
            if (row["state"] not in TERMINAL or not row["released"]) and (busy is None or busy.done()):
                self._inflight[row["id"]] = self._pool.submit(self._sync_quietly, row["id"])

    def _sync_quietly(self, job_id: str) -> None:
        try:
            self.sync(job_id)
        except JobNotFound:
            pass  # deleted meanwhile
        except Exception:
            logger.warning("job %s: sync with its coordinator failed; will retry in %.1f s", job_id,
                           self.sync_interval_s, exc_info=True)

    def _lock(self, job_id: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks.setdefault(job_id, threading.RLock())

    # -- jobs ----------------------------------------------------------------------------------------------
    def submit(self, spec: dict, *, steps: int | None = None, workers: int | None = None,
               run_dir: str | None = None) -> str:
        # Paths first, on the raw request: validate_spec looks at data.path on disk. The spec is parsed
        # here, once: the JobConfig it gives is what the coordinator and the workers get.
        check_paths(spec, run_dir=run_dir, runs_root=self.runs_root, data_roots=self.data_roots)
        cfg = validate_spec(spec, steps=steps, workers=workers)
        job_id = uuid.uuid4().hex[:12]
        rd = resolve_run_dir(run_dir, runs_root=self.runs_root, default_name=f"{safe_name(cfg.name)}-{job_id}")
        now = self.clock()
        total = steps or cfg.train.steps
        # The job lock: the sync thread must not look for the coordinator before it is launched.
        with self._lock(job_id):
            with self._submit_lock:
                for other in self.store.list():
                    if other["run_dir"] == str(rd) and other["state"] not in TERMINAL:
                        raise JobConflict(f"run_dir {rd} is in use by job {other['id']} ({other['state']}); "
                                          "wait for it to finish or choose another run_dir")
                self.store.create({
                    "id": job_id, "name": cfg.name, "spec": spec, "steps": steps, "workers": workers,
                    "run_dir": str(rd), "created": now,
                    "status": JobStatus.submitted(total_steps=total, now=now).to_dict(),
                })
            try:
                self._handles[job_id] = self.launcher.launch(job_id, cfg, run_dir=str(rd), steps=steps,
                                                             workers=workers)
            except Exception as e:
                logger.warning("job %s: could not start its coordinator; it is recorded as FAILED", job_id,
                               exc_info=True)
                self.store.set_status(job_id, JobStatus.not_started(e, total_steps=total, now=now).to_dict())
                self.store.mark_released(job_id)
        return job_id

    def list(self) -> list[dict]:
        return [self._view(r) for r in self.store.list()]

    def get(self, job_id: str) -> dict:
        return self._view(self.sync(job_id))

    def record(self, job_id: str) -> dict:
        """The job as last stored, without asking its coordinator."""
        return self._view(self._row(job_id))

    def events(self, job_id: str, since: int = 0) -> list[dict]:
        self.sync(job_id)
        return self.store.events(job_id, since)

    def metrics(self, job_id: str, since: int = 0, limit: int | None = 10_000) -> list[dict]:
        self.sync(job_id)
        return self.store.metrics(job_id, since, limit)

    def checkpoints(self, job_id: str) -> dict:
        """The checkpoints directory's entries (read-only; a remote checkpoint.dir is not listed)."""
        row = self._row(job_id)
        return list_checkpoints((row["spec"].get("checkpoint") or {}).get("dir"), row["run_dir"])

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
               max_workers: int | None = None) -> dict:
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

        return self._command(job_id, "resize", send, lambda s: "a finished job cannot be resized"
                             if s in TERMINAL else None)

    def pause(self, job_id: str) -> dict:
        return self._command(job_id, "pause", lambda h: h.pause(), lambda s: (
            "a finished job cannot be paused" if s in TERMINAL else "it is already paused" if s == "PAUSED" else None))

    def resume(self, job_id: str) -> dict:
        return self._command(job_id, "resume", lambda h: h.resume(), lambda s: (
            None if s == "PAUSED" else "only a PAUSED job can be resumed"))

    def stop(self, job_id: str) -> dict:
        return self._command(job_id, "stop", lambda h: h.stop(), lambda s: (
            "it has already finished" if s in TERMINAL else None))

    def delete(self, job_id: str) -> dict:
        """Stop the job (waiting up to stop_timeout_s for its final checkpoint), release its coordinator
        and forget it. The run directory and its checkpoints stay."""
        with self._lock(job_id):
            row = self.sync(job_id)
            if row["state"] not in TERMINAL and (h := self._handles.get(job_id)) is not None:
                try:
                    h.stop()
                    deadline = time.monotonic() + self.stop_timeout_s
                    while time.monotonic() < deadline and self.sync(job_id)["state"] not in TERMINAL:
                        time.sleep(0.05)
                except (JobGone, JobUnavailable):
                    logger.warning("job %s: coordinator did not take the stop; releasing it anyway", job_id)
                row = self._row(job_id)
            self.launcher.release(job_id, self.stop_timeout_s)
            self._handles.pop(job_id, None)
            self.store.delete(job_id)
        with self._locks_guard:
            self._locks.pop(job_id, None)
        return {"id": job_id, "state": row["state"], "deleted": True, "run_dir": row["run_dir"]}

    def _command(self, job_id: str, action: str, send: Callable[[JobHandle], None],
                 conflict: Callable[[str], str | None]) -> dict:
        with self._lock(job_id):
            row = self.sync(job_id)
            if why := conflict(row["state"]):
                raise JobConflict(f"cannot {action} job {job_id}: it is {row['state']}; {why}")
            h = self._handles.get(job_id)
            if h is None:
                raise JobConflict(f"cannot {action} job {job_id}: its coordinator is not running")
            try:
                send(h)
            except JobGone as e:
                raise JobUnavailable(f"cannot {action} job {job_id}: {e}") from None
            return {"id": job_id, "action": action, "accepted": True, "state": row["state"]}

    # -- sync ----------------------------------------------------------------------------------------------
    def sync(self, job_id: str) -> dict:
        """Pull status, new events and new metrics from the job's coordinator into the store; returns
        the stored row. A finished job is synced one last time, then its coordinator is released."""
        with self._lock(job_id):
            row = self._row(job_id)
            if row["state"] in TERMINAL and row["released"]:
                return row
            h = self._handles.get(job_id)
            if h is None:
                h = self.launcher.attach(job_id)
                if h is None:
                    return self._finalize_from_run_dir(row, "no coordinator is running for it")
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
            self.store.set_status(job_id, st.to_dict())
            if st.is_terminal:
                self.launcher.release(job_id, self.stop_timeout_s)
                self._handles.pop(job_id, None)
                self.store.mark_released(job_id)
            return self._row(job_id)

    def _fill_gap(self, row: dict, rows: list[dict]) -> list[dict]:
        """`rows` from the coordinator, preceded by the steps between the store's last one and the
        first of `rows`, read from RUN_DIR/metrics.jsonl. A gap appears when a coordinator dies after
        its workers trained steps the store had not pulled yet, and its successor resumes from a
        checkpoint at or after them (it does not train them again, so it never reports them)."""
        last = self.store.last_step(row["id"])
        if not rows or rows[0]["step"] <= last + 1:
            return rows
        logged: dict[int, dict] = {}
        for m in read_metrics(Path(row["run_dir"]) / "metrics.jsonl", after=last):
            if m["step"] < rows[0]["step"]:
                logged[m["step"]] = m  # the last time a step was trained is the run as it stands
        return [logged[s] for s in sorted(logged)] + rows

    def _finalize_from_run_dir(self, row: dict, why: str) -> dict:
        """The coordinator is gone: take the final state from the events it wrote."""
        job_id, run_dir = row["id"], Path(row["run_dir"])
        path = run_dir / "events.jsonl"
        events = read_job_events(path, job_id)
        n = self.store.event_count(job_id)
        self.store.add_events(job_id, n, events[n:])
        self.store.add_metrics(job_id, read_metrics(run_dir / "metrics.jsonl", after=self.store.last_step(job_id)))
        st = JobStatus.from_dict(row["status"]).finalized(events, why=why, now=self.clock())
        st = replace(st, mfu=self._mfu_at(job_id, st.step))
        logger.info("job %s: no coordinator; final state %s from %s", job_id, st.state, path)
        self.store.set_status(job_id, st.to_dict())
        self.store.mark_released(job_id)
        return self._row(job_id)

    # -- helpers -------------------------------------------------------------------------------------------
    def _row(self, job_id: str) -> dict:
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

    @staticmethod
    def _view(row: dict) -> dict:
        st = row["status"]
        return {**st, "id": row["id"], "name": row["name"], "state": row["state"], "run_dir": row["run_dir"],
                "created": row["created"], "updated": row["updated"], "spec": row["spec"],
                "steps": row["steps"], "workers": row["workers"]}
