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

import json
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from service.events import read_events
from service.job_actor import JobGone, JobUnavailable, degrees
from workers.config import JobConfig

logger = logging.getLogger(__name__)

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})

__all__ = ["JobConflict", "JobManager", "JobNotFound", "JobUnavailable", "SpecError", "TERMINAL",
           "resolve_run_dir", "validate_spec"]


class JobNotFound(KeyError):
    def __str__(self) -> str:
        return f"no job with id {self.args[0]!r}"


class JobConflict(RuntimeError):
    """The action does not fit the job's state (e.g. resume of a running job); the message says why."""


class SpecError(ValueError):
    """A job request that cannot run. `loc` is the field path in the request body, e.g.
    ("spec", "train", "steps") or ("run_dir",)."""

    def __init__(self, loc: Iterable[str | int], msg: str):
        super().__init__(msg)
        self.loc, self.msg = tuple(loc), msg


# -- validation --------------------------------------------------------------------------------------------

_TOP = ("name", "model", "data", "train", "parallel", "checkpoint", "resources")
_PATH = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*)")


def config_error_loc(msg: str) -> tuple[str | int, ...]:
    """The spec field a ConfigError message names, as a path ("train.steps must be > 0" -> (train, steps))."""
    m = _PATH.match(msg)
    loc: list[str | int] = []
    if m and m.group(1).split(".")[0].split("[")[0] in _TOP:
        for part in re.findall(r"[A-Za-z_]\w*|\[\d+\]", m.group(1)):
            loc.append(int(part[1:-1]) if part.startswith("[") else part)
    if unknown := re.search(r"unknown field '([^']+)'", msg):
        loc.append(unknown.group(1))
    elif loc == ["model"] and "preset" in msg:
        loc.append("preset")
    elif loc == ["model"]:
        loc.append("overrides")
    return tuple(loc)


def validate_spec(spec: Any, *, steps: int | None = None, workers: int | None = None) -> JobConfig:
    """The JobConfig of `spec`, or SpecError naming the field: the YAML rules (JobConfig.from_dict), plus
    what would only fail once the job runs: a readable data path and a layout that fits the model on
    the allowed worker counts (e.g. a tp that does not divide the heads)."""
    try:
        cfg = JobConfig.from_dict(spec)
    except ValueError as e:  # ConfigError, or a ValueError from a check deeper down (e.g. a NUL in a path)
        raise SpecError(("spec", *config_error_loc(str(e))), str(e)) from None
    except OSError as e:  # data.path that cannot even be looked at (name too long, ...)
        raise SpecError(("spec", "data", "path"), f"data.path cannot be checked: {e.strerror or e}") from None
    for name, v in (("steps", steps), ("workers", workers)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise SpecError((name,), f"{name} must be an integer >= 1, got {v!r}")
    d = cfg.data
    if d.path is not None and d.source != "synthetic":
        p = Path(d.path).expanduser()
        if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
            raise SpecError(("spec", "data", "path"), f"data.path {d.path!r} is not readable by the server")
    _check_layout(cfg, workers)
    return cfg


MAX_WORKERS = 100_000
"""Largest worker count a request may name (keeps the layout check below a few milliseconds)."""
MAX_GLOBAL_BATCH = 1 << 24


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _check_layout(cfg: JobConfig, workers: int | None) -> None:
    """Some worker count the job may run on must have a valid layout. Candidates are the sizes dp*tp*pp
    with dp dividing the global batch, tp the head/vocab/ffn sizes and pp <= layers and <= the samples
    per rank (what the planner can accept at all), largest first; the planner judges the first few. Catches a tp that does not divide the heads,
    a forced layout that does not fit the model or batch, and ranges with no usable size."""
    from parallel.layout import Layout
    from parallel.planner import plan
    from workers.train import constraints_for

    pc, mc, gbs = cfg.parallel, cfg.model.build(), cfg.train.global_batch_size
    if gbs > MAX_GLOBAL_BATCH:
        raise SpecError(("spec", "train", "global_batch_size"),
                        f"train.global_batch_size={gbs} is more than this server accepts ({MAX_GLOBAL_BATCH})")
    if pc.layout:
        lay = Layout.parse(pc.layout, dp_mode=pc.dp_mode)
        loc, lo, hi, tps, pp_max = ("spec", "parallel", "layout"), lay.world_size, lay.world_size, [lay.tp], None
        forced = {"tp": lay.tp, "pp": lay.pp}
    else:
        hi = workers or pc.max_workers
        lo = min(pc.min_workers, hi)
        loc = ("spec", "parallel") + (("tp",) if pc.tp else ("pp",) if pc.pp else ("max_workers",))
        tp_ok = math.gcd(mc.n_heads, mc.n_kv_heads, mc.vocab_size, mc.ffn_hidden)
        tps = [pc.tp] if pc.tp else [t for t in _divisors(tp_ok) if pc.max_tp is None or t <= pc.max_tp]
        pp_max, forced = pc.max_pp, {"tp": pc.tp, "pp": pc.pp}
    if hi > MAX_WORKERS:
        raise SpecError(loc, f"{hi} workers is more than this server accepts ({MAX_WORKERS})")
    sizes: set[int] = set()
    for dp in _divisors(gbs):
        for tp in tps:
            if forced["pp"]:
                pps = [forced["pp"]]
            else:
                # a pipeline of pp stages needs >= pp microbatches of the gbs // dp samples per rank
                pps = range(1, min(mc.n_layers, pp_max or mc.n_layers, hi // (dp * tp), gbs // dp) + 1)
            sizes.update(w for pp in pps if lo <= (w := dp * tp * pp) <= hi)
    if not sizes:
        raise SpecError(loc, f"no worker count from {lo} to {hi} can be split as dp x tp x pp with dp dividing "
                             f"train.global_batch_size={gbs}, tp in {tps} and pp <= n_layers={mc.n_layers}")
    why = ""
    for w in sorted(sizes, reverse=True)[:16]:
        try:
            plan(w, mc, constraints_for(cfg, min_workers=w, max_workers=w,
                                        **{k: v for k, v in forced.items() if v}))
            return
        except ValueError as e:  # PlanError is a ValueError
            why = str(e)
    raise SpecError(loc, f"no parallel layout can run this job: {why}")


def resolve_run_dir(run_dir: str | None, *, runs_root: Path, default_name: str, loc=("run_dir",)) -> Path:
    """`run_dir` (relative to runs_root, or absolute inside it) as an absolute path inside runs_root.
    '..' and symlinks that lead out are rejected: the API must not write outside the root it was given."""
    root = Path(runs_root).resolve()
    if run_dir is None:
        return root / default_name
    p = Path(run_dir)
    if not str(run_dir).strip() or ".." in p.parts or "\x00" in str(run_dir):
        raise SpecError(loc, f"{'.'.join(loc)} {run_dir!r} must be a path inside the runs root without '..'")
    full = (p if p.is_absolute() else root / p).resolve()
    if full == root or root not in full.parents:
        raise SpecError(loc, f"{'.'.join(loc)} {run_dir!r} must be a directory inside the runs root {root}")
    return full


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".")[:64] or "job"


# -- the seams: where jobs run and where they are recorded ------------------------------------------------

class JobHandle(Protocol):
    def status(self) -> dict: ...
    def events_since(self, index: int = 0) -> list[dict]: ...
    def metrics_since(self, step: int = 0) -> list[dict]: ...
    def resize(self, **kw) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self) -> None: ...


class Launcher(Protocol):
    """Starts a job's coordinator and finds it again by job id (service.job_actor has a Ray one and an
    in-process one)."""

    def launch(self, job_id: str, spec: dict, *, run_dir: str, steps: int | None,
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

class JobManager:
    def __init__(self, store: Store, launcher: Launcher, *, runs_root: str | Path, sync_interval_s: float = 0.5,
                 stop_timeout_s: float = 10.0, clock: Callable[[], float] = time.time):
        self.store, self.launcher = store, launcher
        self.runs_root = Path(runs_root)
        self.sync_interval_s, self.stop_timeout_s, self.clock = sync_interval_s, stop_timeout_s, clock
        self._handles: dict[str, JobHandle] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._submit_lock = threading.Lock()  # run_dir check + insert, atomically
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach to the coordinators of unfinished jobs (or record how they ended), then keep syncing."""
        for row in self.store.list():
            if row["state"] not in TERMINAL or not row["released"]:
                self._sync_quietly(row["id"])
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="JobManager-sync", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop syncing. The jobs go on: their coordinators do not belong to this process."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.sync_interval_s):
            for row in self.store.list():
                if self._stop.is_set():
                    return
                if row["state"] not in TERMINAL or not row["released"]:
                    self._sync_quietly(row["id"])

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
        cfg = validate_spec(spec, steps=steps, workers=workers)
        job_id = uuid.uuid4().hex[:12]
        rd = resolve_run_dir(run_dir, runs_root=self.runs_root, default_name=f"{_safe_name(cfg.name)}-{job_id}")
        ck = cfg.checkpoint.dir
        if ck is not None and "://" not in ck:
            if not Path(ck).is_absolute():
                raise SpecError(("spec", "checkpoint", "dir"), f"checkpoint.dir {ck!r} must be a URL or an absolute "
                                f"path inside the runs root {self.runs_root.resolve()}")
            resolve_run_dir(ck, runs_root=self.runs_root, default_name="", loc=("spec", "checkpoint", "dir"))
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
                    "status": {"state": "PENDING", "reason": "submitted", "step": 0, "total_steps": total,
                               "world_size": 0, "since": now},
                })
            try:
                self._handles[job_id] = self.launcher.launch(job_id, spec, run_dir=str(rd), steps=steps,
                                                             workers=workers)
            except Exception as e:
                logger.warning("job %s: could not start its coordinator; it is recorded as FAILED", job_id,
                               exc_info=True)
                self.store.set_status(job_id, {"state": "FAILED", "reason": f"could not start the coordinator: {e}",
                                               "step": 0, "total_steps": total, "world_size": 0, "since": now})
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
        ck = (row["spec"].get("checkpoint") or {}).get("dir")
        if ck and "://" in ck:
            return {"dir": ck, "latest": None, "entries": [], "note": "remote checkpoint dirs are not listed"}
        d = Path(ck) if ck else Path(row["run_dir"]) / "checkpoints"
        entries = []
        latest = None
        if d.is_dir():
            for p in sorted(d.iterdir()):
                if p.name == "latest" and p.is_file():
                    latest = p.read_text(errors="replace").strip() or None
                    continue
                m = re.fullmatch(r"step-(\d+)", p.name)
                entries.append({
                    "name": p.name, "step": int(m.group(1)) if m else None, "is_dir": p.is_dir(),
                    "committed": p.is_dir() and (p / "manifest.json").is_file(),
                    "bytes": sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size,
                    "modified": p.stat().st_mtime,
                })
        return {"dir": str(d), "latest": latest, "entries": entries}

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
            self.store.add_metrics(job_id, rows)
            self.store.set_status(job_id, st)
            if st["state"] in TERMINAL:
                self.launcher.release(job_id, self.stop_timeout_s)
                self._handles.pop(job_id, None)
                self.store.mark_released(job_id)
            return self._row(job_id)

    def _finalize_from_run_dir(self, row: dict, why: str) -> dict:
        """The coordinator is gone: take the final state from the events it wrote."""
        job_id, run_dir = row["id"], Path(row["run_dir"])
        events: list[dict] = []
        path = run_dir / "events.jsonl"
        if path.exists():
            try:
                events = [e.to_dict() for e in read_events(path) if e.job_id == job_id]
            except (OSError, ValueError):
                logger.warning("job %s: cannot read %s; its final state is unknown", job_id, path, exc_info=True)
        n = self.store.event_count(job_id)
        self.store.add_events(job_id, n, events[n:])
        self.store.add_metrics(job_id, _read_metrics(run_dir / "metrics.jsonl", after=self.store.last_step(job_id)))
        st = dict(row["status"])
        last = next((e for e in reversed(events) if e["kind"] == "transition"), None)
        if last is not None:
            st.update(state=last["to_state"], reason=last["reason"], cause=last["cause"], since=last["time"],
                      layout=last["new_layout"], degrees=degrees(last["new_layout"]))
        if events and events[-1]["step"] is not None:
            st["step"] = events[-1]["step"]
        if st["state"] not in TERMINAL:
            st.update(reason=f"the coordinator is gone ({why}); last recorded state {st['state']} at step "
                             f"{st.get('step') or 0}", state="FAILED", since=self.clock())
        st.update(world_size=0, running=False)
        logger.info("job %s: no coordinator; final state %s from %s", job_id, st["state"], path)
        self.store.set_status(job_id, st)
        self.store.mark_released(job_id)
        return self._row(job_id)

    # -- helpers -------------------------------------------------------------------------------------------
    def _row(self, job_id: str) -> dict:
        row = self.store.get(job_id)
        if row is None:
            raise JobNotFound(job_id)
        return row

    @staticmethod
    def _view(row: dict) -> dict:
        st = row["status"]
        return {**st, "id": row["id"], "name": row["name"], "state": row["state"], "run_dir": row["run_dir"],
                "created": row["created"], "updated": row["updated"], "spec": row["spec"],
                "steps": row["steps"], "workers": row["workers"]}


def _read_metrics(path: Path, *, after: int) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(m, dict) and isinstance(m.get("step"), int) and m["step"] > after:
            out.append(m)
    return out
