"""A coordinator that died after its workers trained steps the store had not pulled yet: its successor
resumes from a checkpoint at or after those steps and never reports them, so the job manager takes
them from RUN_DIR/metrics.jsonl. (The chaos run found step 128 missing from the API after a
coordinator kill.)"""

from __future__ import annotations

import json
from pathlib import Path

from api.store import JobStore
from service.server.job_manager import JobManager
from service.control.status import JobStatus

SPEC = {"name": "gap", "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 2}}


class Handle:
    def __init__(self):
        self.rows: list[dict] = []

    def status(self):
        return JobStatus(state="RUNNING", reason="", step=self.rows[-1]["step"] if self.rows else 0,
                         total_steps=10, world_size=1)

    def events_since(self, index=0):
        return []

    def metrics_since(self, step=0):
        return [r for r in self.rows if r["step"] > step]


class Launcher:
    def __init__(self):
        self.handle = Handle()

    def launch(self, job):
        return self.handle

    def attach(self, job_id):
        return self.handle

    def release(self, job_id, timeout_s=10.0):
        pass

    def cluster(self):
        return None


def row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "time": float(step)}


def test_steps_only_the_dead_coordinator_trained_come_from_metrics_jsonl(tmp_path):
    launcher = Launcher()
    mgr = JobManager(JobStore(tmp_path / "jobs.db"), launcher, runs_root=tmp_path / "runs")
    job_id = mgr.submit(SPEC)
    run_dir = Path(mgr.get(job_id).run_dir)
    launcher.handle.rows = [row(s, 10.0 - s) for s in (1, 2, 3)]
    mgr.sync(job_id)  # not started: no background sync
    assert [m["step"] for m in mgr.metrics(job_id)] == [1, 2, 3]
    # Rank 0 logged steps 4-6 (5 twice: a replay), then the coordinator died; the new one resumed
    # from a checkpoint at step 6 and reports 7 on.
    run_dir.mkdir(parents=True, exist_ok=True)
    logged = [row(s, 10.0 - s) for s in (1, 2, 3, 4, 5)] + [row(5, 4.5), row(6, 4.0)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged) + '{"step": 7, "lo')
    launcher.handle.rows = [row(7, 3.0), row(8, 2.0)]
    mgr.sync(job_id)
    got = mgr.metrics(job_id)
    assert [m["step"] for m in got] == list(range(1, 9))
    assert {m["step"]: m["loss"] for m in got}[5] == 4.5  # the replay: the run as it stands


def test_a_slow_coordinator_does_not_hold_up_the_other_jobs(tmp_path):
    import threading
    import time

    class Slow(Handle):
        hang = threading.Event()
        release = threading.Event()

        def status(self):
            if self.hang.is_set():
                self.release.wait(30)  # a coordinator that stops answering (until released)
            return super().status()

    handles = iter([Slow(), Handle()])

    class Two(Launcher):
        def launch(self, job):
            return next(handles)

    mgr = JobManager(JobStore(tmp_path / "jobs.db"), Two(), runs_root=tmp_path / "runs", sync_interval_s=0.05)
    slow_id, fast_id = mgr.submit(SPEC), mgr.submit(SPEC)
    slow, fast = mgr.coordinators.get(slow_id), mgr.coordinators.get(fast_id)
    mgr.start()
    try:
        slow.rows = [row(1, 9.0)]
        slow.hang.set()
        time.sleep(0.2)  # the slow job's sync is now stuck
        fast.rows = [row(1, 9.0), row(2, 8.0)]
        deadline = time.monotonic() + 5
        while mgr.get(fast_id).status.step != 2:
            assert time.monotonic() < deadline, "the fast job was not synced while the slow one hung"
            time.sleep(0.02)
        assert mgr.get(slow_id).status.step == 0  # its sync is still waiting for an answer
    finally:
        slow.release.set()
        mgr.close()


def test_a_manager_can_be_started_again_after_close(tmp_path, monkeypatch):
    """An app whose lifespan runs twice (tests, reloads) starts the same manager again; a sync that
    close() cancelled before it ran must not break the second start() (a CI-like run saw every request
    of the fuzz test fail with CancelledError)."""
    import time

    import service.server.job_manager as jm

    class Slow(Handle):
        def status(self):
            time.sleep(0.2)
            return super().status()

    class Two(Launcher):
        def launch(self, job):
            return Slow()

    monkeypatch.setattr(jm, "SYNC_THREADS", 1)  # one sync at a time: the second job's waits in the queue
    mgr = JobManager(JobStore(tmp_path / "jobs.db"), Two(), runs_root=tmp_path / "runs", sync_interval_s=0.01)
    ids = [mgr.submit(SPEC), mgr.submit(SPEC)]
    mgr.start()
    time.sleep(0.3)  # a round is under way: one sync running, the other queued
    mgr.close()  # cancels the queued one
    mgr.start()
    try:
        assert [mgr.get(i).state for i in ids] == ["RUNNING", "RUNNING"]
    finally:
        mgr.close()
