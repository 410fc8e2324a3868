"""The job store: specs, last statuses, events and metrics in SQLite (stdlib sqlite3).

Schema (version 1):
  jobs(id PK, name, spec JSON, steps, workers, run_dir, created, updated, state, reason, status JSON, released)
      `status` is the coordinator's last status (JobRunner.status()); `state`/`reason` are copied out
      of it so lists can filter without parsing JSON. `released` = 1 once the job is finished and its
      coordinator let go: nothing about it will change again.
  events(job_id, idx, time, kind, data JSON)  PK (job_id, idx): idx is the coordinator's event index
  metrics(job_id, step, time, data JSON)      PK (job_id, step): a redone step (after a failure) replaces
                                              the row; the chart shows the run as it stands
  meta(key PK, value)                          schema_version

One connection, serialised by a lock, in WAL mode: the API's request threads and its sync thread share
it, and a second server over the same file (a restart) can read while the first still writes.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, steps INTEGER, workers INTEGER,
    run_dir TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '', status TEXT NOT NULL, released INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (job_id, idx)
);
CREATE TABLE IF NOT EXISTS metrics (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, time REAL, data TEXT NOT NULL, PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def _path_of(url: str | Path) -> str:
    s = str(url)
    if s.startswith("sqlite:///"):
        return s[len("sqlite:///"):] or ":memory:"
    if "://" in s:
        raise ValueError(f"unsupported store URL {s!r}: use a file path or sqlite:///PATH")
    return s


class JobStore:
    """Thread-safe. `url` is a file path, ``sqlite:///PATH`` or ``:memory:``."""

    def __init__(self, url: str | Path):
        path = _path_of(url)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, timeout=30, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            if path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise RuntimeError(f"store {path} has schema version {row[0]}, newer than this server's "
                                   f"{SCHEMA_VERSION}; upgrade Elastron")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- jobs --------------------------------------------------------------------------------------------
    def create(self, job: dict) -> None:
        st = job["status"]
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, name, spec, steps, workers, run_dir, created, updated, state, reason, status)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job["id"], job["name"], _dumps(job["spec"]), job.get("steps"), job.get("workers"),
                 job["run_dir"], job["created"], job["created"], st["state"], st.get("reason") or "",
                 _dumps(st)))

    def get(self, job_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def list(self) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY created, id").fetchall()
        return [_job(r) for r in rows]

    def set_status(self, job_id: str, status: dict) -> None:
        with self._lock:
            self._db.execute("UPDATE jobs SET status = ?, state = ?, reason = ?, updated = ? WHERE id = ?",
                             (_dumps(status), status["state"], status.get("reason") or "",
                              time.time(), job_id))

    def mark_released(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("UPDATE jobs SET released = 1 WHERE id = ?", (job_id,))

    def delete(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            for table, col in (("events", "job_id"), ("metrics", "job_id"), ("jobs", "id")):
                self._db.execute(f"DELETE FROM {table} WHERE {col} = ?", (job_id,))
            self._db.execute("COMMIT")

    # -- events and metrics ------------------------------------------------------------------------------
    def add_events(self, job_id: str, start: int, events: list[dict]) -> None:
        if not events:
            return
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO events (job_id, idx, time, kind, data) VALUES (?, ?, ?, ?, ?)",
                [(job_id, start + i, e.get("time") or 0.0, e.get("kind") or "", _dumps(e))
                 for i, e in enumerate(events)])

    def events(self, job_id: str, since: int = 0) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT data FROM events WHERE job_id = ? AND idx >= ? ORDER BY idx",
                                    (job_id, max(0, since))).fetchall()
        return [json.loads(r[0]) for r in rows]

    def event_count(self, job_id: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM events WHERE job_id = ?", (job_id,)).fetchone()[0]

    def add_metrics(self, job_id: str, rows: list[dict]) -> None:
        if not rows:
            return
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO metrics (job_id, step, time, data) VALUES (?, ?, ?, ?)",
                [(job_id, int(m["step"]), m.get("time"), _dumps(m)) for m in rows])

    def metrics(self, job_id: str, since: int = 0, limit: int | None = None) -> list[dict]:
        q = "SELECT data FROM metrics WHERE job_id = ? AND step > ? ORDER BY step"
        args: tuple = (job_id, since)
        if limit is not None:
            q += " LIMIT ?"
            args += (limit,)
        with self._lock:
            rows = self._db.execute(q, args).fetchall()
        return [json.loads(r[0]) for r in rows]

    def last_step(self, job_id: str) -> int:
        with self._lock:
            v = self._db.execute("SELECT MAX(step) FROM metrics WHERE job_id = ?", (job_id,)).fetchone()[0]
        return v or 0


def _finite(v):
    """NaN and infinities as None: JSON has no such numbers, and a diverged loss must not break a response."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _dumps(v) -> str:
    return json.dumps(_finite(v), default=str)


def _job(row: sqlite3.Row) -> dict:
    d = dict(row)
    d["spec"] = json.loads(d["spec"])
    d["status"] = json.loads(d["status"])
    d["released"] = bool(d["released"])
    return d
