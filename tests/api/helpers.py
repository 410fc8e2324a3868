"""Shared pieces of the API tests: an in-process coordinator over the fakes of tests/fakes.py, a
JobManager on an in-process launcher, and polling with deadlines."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import uvicorn

from api.app import create_app
from api.deps import Settings
from api.store import JobStore
from service.server.job_actor import LocalLauncher
from service.server.job_manager import JobManager
from tests.fakes import Disk, FakeCluster, Gate, GatedGroup, PollingCoordinator

SPEC = {
    "name": "tiny",
    "data": {"source": "synthetic", "seq_len": 16},
    "train": {"steps": 20, "global_batch_size": 8, "micro_batch_size": 2},
    "parallel": {"min_workers": 1, "max_workers": 4},
    "checkpoint": {"interval_steps": 5},
}


def fake_factory(cluster: FakeCluster, *, gate: Gate | None = None, step_s: float = 0.0,
                 mfu_per_step: float | None = 0.001):
    """A coordinator factory for JobRunner: fake group on `cluster`, no settle time, short chunks."""

    def factory(job, *, options):
        group = type("G", (GatedGroup,), {"disk": Disk(job.cfg.checkpoint.interval_steps), "cluster": cluster,
                                          "fail_next": [], "resharded": [], "gate": gate, "step_s": step_s,
                                          "mfu_per_step": mfu_per_step})
        c = PollingCoordinator(job, options=replace(options, settle_seconds=0.0, chunk_seconds=0.05),
                               watcher=cluster.watcher())
        c.worker_group_cls = group
        return c

    return factory


def make_launcher(nodes: dict[str, int] | None = None, **kw) -> tuple[LocalLauncher, FakeCluster]:
    cluster = FakeCluster(nodes if nodes is not None else {"a": 2, "b": 2})
    return LocalLauncher(coordinator_factory=fake_factory(cluster, **kw), cluster_fn=cluster.watcher().poll), cluster


def make_app(tmp_path: Path, launcher: LocalLauncher, *, token: str | None = None, db: Path | str | None = None,
             **settings):
    s = Settings(runs_root=tmp_path / "runs", store_url=str(db or tmp_path / "jobs.db"), token=token,
                 sync_interval_s=0.05, stop_timeout_s=10.0, **{"schedule": False, **settings})
    mgr = JobManager(JobStore(s.store_url), launcher, runs_root=s.runs_root, data_roots=s.data_roots,
                     sync_interval_s=s.sync_interval_s, stop_timeout_s=s.stop_timeout_s, quotas=s.quotas,
                     shared=s.schedule, resume_prefixes=s.resume_prefixes, object_stores=s.object_stores,
                     azure_account=s.azure_account, max_live_jobs=s.max_live_jobs, lock_timeout_s=s.lock_timeout_s,
                     max_finished_jobs=s.max_finished_jobs)
    return create_app(jobs=mgr, settings=s)


def stop_all(launcher: LocalLauncher) -> None:
    """End every coordinator thread the launcher still holds (test teardown)."""
    for job_id in launcher.job_ids():
        launcher.release(job_id, timeout_s=10.0)


@contextmanager
def live_server(app):
    """Serve `app` with uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout=30, what="uvicorn start")
        assert server.started, "uvicorn did not start (see its log above)"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def wait_for(fn, *, timeout: float = 20.0, interval: float = 0.02, what: str = "condition"):
    """Poll fn() until it returns something truthy; return it. Fails with the last value at the deadline."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s; last value: {last!r}")


class HandleLauncher:
    """A launcher without Ray whose coordinator for `job` is `make_handle(job)` (a test's fake with
    `status`, `events_since`, `metrics_since` and `send`): the job manager's seam, for tests of how the
    service waits on coordinators that answer slowly or never."""

    def __init__(self, make_handle):
        self.make_handle, self.live = make_handle, {}

    def launch(self, job):
        self.live[job.id] = self.make_handle(job)
        return self.live[job.id]

    def attach(self, job_id):
        return self.live.get(job_id)

    def gone(self, job_id):
        return False

    def where(self):
        return "here"

    def release(self, job_id, timeout_s=10.0):
        pass

    def cluster(self):
        return None
