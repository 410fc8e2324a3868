"""The owner views: what one caller may read of the jobs and the cluster.

`owner` None sees every job (an admin, or a server without users); a user sees only their own jobs, and
another user's job is JobNotFound, as if it did not exist. A user's view names no other user's job: the
scheduler's reasons ("shrunk to admit job ID (priority N)") say "another job" instead, and the cluster is
shown as counts (which machines run the service is the operator's to see). Reads come from the store; no
coordinator is asked.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from service.control.run_files import list_checkpoints
from service.server.job_types import JobNotFound, JobRecord, JobUnavailable, Launcher, Store

logger = logging.getLogger(__name__)

_OTHER_JOB = re.compile(r"\bjob ([0-9a-f]{12})\b(?: \(priority -?\d+\))?")


class OwnerViews:
    def __init__(self, store: Store, launcher: Launcher, *, clock: Callable[[], float]):
        self.store, self.launcher, self.clock = store, launcher, clock

    def mine(self, job_id: str, owner: str | None) -> JobRecord:
        """The job's record, if `owner` may see it (None: every job); JobNotFound otherwise."""
        row = self.store.get(job_id)
        if row is None or (owner is not None and row.owner != owner):
            raise JobNotFound(job_id)
        return row

    def list(self, *, owner: str | None = None, limit: int | None = None, offset: int = 0) -> list[JobRecord]:
        rows = self.store.list(owner=owner, limit=limit, offset=offset)
        return rows if owner is None else [self._as_seen_by(r, owner) for r in rows]

    def get(self, job_id: str, *, owner: str | None = None) -> JobRecord:
        """The job as last stored; JobNotFound if `owner` may not see it."""
        row = self.mine(job_id, owner)
        return row if owner is None else self._as_seen_by(row, owner)

    def events(self, job_id: str, since: int = 0, limit: int | None = None, *, owner: str | None = None) -> list[dict]:
        """The job's stored events, each "job ID" of another user's job as "another job" for a user."""
        self.mine(job_id, owner)
        events = self.store.events(job_id, since, limit)
        return events if owner is None else redacted(events, self._ids_of(owner))

    def metrics(self, job_id: str, since: int = 0, limit: int | None = 10_000, stride: int = 1, *,
                owner: str | None = None) -> list[dict]:
        self.mine(job_id, owner)
        return self.store.metrics(job_id, since, limit, stride)

    def checkpoints(self, job_id: str, *, owner: str | None = None) -> dict:
        """The checkpoints directory's entries (read-only; a remote checkpoint.dir is not listed)."""
        row = self.mine(job_id, owner)
        return list_checkpoints(row.checkpoint_dir, row.run_dir)

    def cluster(self, *, owner: str | None = None) -> dict:
        """The cluster's nodes; for a user (`owner` given) only counts. JobUnavailable when the launcher
        cannot read it."""
        out = self._cluster()
        if owner is None:
            return out
        nodes = out["nodes"]
        return {"time": out["time"], "nodes": [], "usable_workers": out["usable_workers"],
                "node_count": sum(n["alive"] for n in nodes), "draining_nodes": sum(n["draining"] for n in nodes),
                "cpus": sum(n["cpus"] for n in nodes if n["alive"]), "gpus": sum(n["gpus"] for n in nodes if n["alive"])}

    def _cluster(self) -> dict:
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

    def _ids_of(self, owner: str) -> set[str]:
        return {r.id for r in self.store.list(owner=owner)}

    def _as_seen_by(self, row: JobRecord, owner: str) -> JobRecord:
        if not _OTHER_JOB.search(row.status.reason or ""):
            return row
        return replace(row, status=replace(row.status, reason=redacted(row.status.reason, self._ids_of(owner))))


def redacted(v: Any, mine: set[str]) -> Any:
    """`v` (an event, a reason) with each "job ID (priority N)" of a job not in `mine` as "another job"."""
    if isinstance(v, str):
        return _OTHER_JOB.sub(lambda m: m.group(0) if m.group(1) in mine else "another job", v)
    if isinstance(v, dict):
        return {k: redacted(x, mine) for k, x in v.items()}
    if isinstance(v, list):
        return [redacted(x, mine) for x in v]
    return v
