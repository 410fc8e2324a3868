"""Issue 15, the job manager: reads never wait for a coordinator, requests for unknown ids leave no
trace, a coordinator that is merely not found is UNKNOWN (not FAILED), jobs cannot share directories,
submits can be retried, delete waits for the final save, and a failing sync does not flood the log."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path

import pytest

from api.store import JobStore
from service.server.job_manager import JobConflict, JobManager, JobNotFound
from service.server.job_manager import UNKNOWN
from service.control.status import JobStatus
from service.control.commands import Pause, SetWorkers, Stop

SPEC = {"name": "h", "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 2}}


class Handle:
    def __init__(self):
        self.state, self.step = "RUNNING", 0
        self.hang = threading.Event()
        self.release = threading.Event()
        self.fail: Exception | None = None
        self.stops = 0

    def status(self):
        if self.hang.is_set():
            self.release.wait(30)  # a coordinator that stops answering (until released)
        if self.fail is not None:
            raise self.fail
        return JobStatus(state=self.state, reason="", step=self.step, total_steps=10, world_size=1)

    def events_since(self, index=0):
        return []

    def metrics_since(self, step=0):
        return [{"step": s, "loss": 1.0} for s in range(step + 1, self.step + 1)]

    def send(self, cmd):
        if not isinstance(cmd, SetWorkers):  # a stop, pause or resume
            self.stops += 1


class Launcher:
    """attach() finds only what `live` holds; gone() says what `dead` says."""

    def __init__(self):
        self.live: dict[str, Handle] = {}
        self.dead: set[str] = set()
        self.released: list[str] = []

    def launch(self, job):
        self.live[job.id] = Handle()
        return self.live[job.id]

    def attach(self, job_id):
        return self.live.get(job_id)

    def gone(self, job_id):
        return job_id in self.dead

    def where(self):
        return "the Ray cluster at 10.0.0.1:6379"

    def release(self, job_id, timeout_s=10.0):
        self.released.append(job_id)

    def cluster(self):
        return None


@pytest.fixture
def mgr(tmp_path):
    m = JobManager(JobStore(tmp_path / "jobs.db"), Launcher(), runs_root=tmp_path / "runs", sync_interval_s=0.02,
                   stop_timeout_s=0.3, object_stores=("s3://bucket", "gs://bucket"))
    yield m
    m.close()


# -- item 5: no lock (no memory) for ids that do not exist ----------------------------------------------------

def test_requests_for_unknown_ids_leave_nothing_behind(mgr):
    mgr.submit(SPEC)
    before = len(mgr.locks.known())
    for _ in range(500):
        bad = uuid.uuid4().hex[:12]
        for call in (mgr.get, mgr.events, mgr.metrics, mgr.checkpoints, mgr.sync, lambda j: mgr.command(j, Pause()),
                     lambda j: mgr.command(j, Stop()), mgr.delete):
            with pytest.raises(JobNotFound):
                call(bad)
    assert len(mgr.locks.known()) == before


def test_deleting_a_job_drops_its_lock(mgr):
    job_id = mgr.submit(SPEC)
    mgr.launcher.live[job_id].state = "SUCCEEDED"
    mgr.sync(job_id)
    mgr.delete(job_id)
    assert job_id not in mgr.locks.known()


# -- item 6: reads are served from the store --------------------------------------------------------------------

def test_reads_do_not_wait_for_a_coordinator_that_hangs(mgr):
    job_id = mgr.submit(SPEC)
    h = mgr.launcher.live[job_id]
    h.step = 2
    mgr.start()
    try:
        assert mgr.get(job_id).status.step == 2
        h.hang.set()
        time.sleep(0.1)  # the background sync is now stuck in status(), holding the job's lock
        t0 = time.monotonic()
        for _ in range(20):
            assert mgr.get(job_id).status.step == 2
            assert [m["step"] for m in mgr.metrics(job_id)] == [1, 2]
            mgr.events(job_id)
            mgr.list()
        assert time.monotonic() - t0 < 2.0, "reads waited for the hung coordinator"
    finally:
        h.release.set()


# -- item 9: not found is UNKNOWN until confirmed -------------------------------------------------------------

def test_a_coordinator_that_is_not_found_makes_the_job_unknown_not_failed(mgr):
    job_id = mgr.submit(SPEC)
    h = mgr.launcher.live[job_id]
    h.step = 3
    mgr.sync(job_id)
    mgr.coordinators.drop_all()  # a new server...
    del mgr.launcher.live[job_id]  # ... connected to a Ray that does not know the job
    for _ in range(3):
        mgr.sync(job_id)
    j = mgr.get(job_id).status
    assert j.state == UNKNOWN and "10.0.0.1:6379" in j.reason and "last known state RUNNING" in j.reason
    assert job_id not in mgr.launcher.released and not mgr.store.get(job_id).released
    mgr.launcher.live[job_id] = h  # connected to the right Ray again
    h.step = 4
    mgr.sync(job_id)
    assert mgr.get(job_id).state == "RUNNING" and mgr.get(job_id).status.step == 4


def test_a_job_confirmed_gone_is_finalised(mgr):
    job_id = mgr.submit(SPEC)
    mgr.coordinators.drop_all()
    del mgr.launcher.live[job_id]
    mgr.sync(job_id)
    assert mgr.get(job_id).state == UNKNOWN
    mgr.launcher.dead.add(job_id)  # the launcher's Ray knows the actor as dead
    mgr.sync(job_id)
    j = mgr.get(job_id).status
    assert j.state == "FAILED" and "coordinator is gone" in j.reason and mgr.store.get(job_id).released


def test_a_job_whose_events_end_in_a_final_state_is_finalised_without_confirmation(mgr):
    job_id = mgr.submit(SPEC)
    run_dir = Path(mgr.get(job_id).run_dir)
    run_dir.mkdir(parents=True)
    ev = {"time": 1.0, "job_id": job_id, "kind": "transition", "from_state": "RUNNING", "to_state": "SUCCEEDED",
          "reason": "reached step 10", "old_layout": None, "new_layout": None, "step": 10, "cause": None,
          "details": {}}
    (run_dir / "events.jsonl").write_text(json.dumps(ev) + "\n")
    mgr.coordinators.drop_all()
    del mgr.launcher.live[job_id]
    mgr.sync(job_id)
    assert mgr.get(job_id).state == "SUCCEEDED"


# -- item 1: each job's directories are its own -----------------------------------------------------------------

@pytest.mark.parametrize("second", [
    {"run_dir": "a"},                                        # the same run_dir
    {"run_dir": "a/inner"},                                  # inside the other's run_dir
    {"run_dir": "b", "ck": "a/checkpoints"},                 # checkpoints in the other's checkpoints
    {"run_dir": "b", "ck": "a"},                             # checkpoints in the other's run_dir
    {"run_dir": "ck-area/x"},                                # run_dir inside the other's checkpoint.dir
])
def test_directories_that_overlap_another_kept_jobs_are_refused(mgr, tmp_path, second):
    runs = (tmp_path / "runs").resolve()
    first = mgr.submit({**SPEC, "checkpoint": {"dir": str(runs / "ck-area")}}, run_dir="a")
    mgr.launcher.live[first].state = "SUCCEEDED"
    mgr.sync(first)  # finished, but kept: its checkpoints are still its own
    spec = SPEC if "ck" not in second else {**SPEC, "checkpoint": {"dir": str(runs / second["ck"])}}
    with pytest.raises(JobConflict, match=f"in use by job {first}"):
        mgr.submit(spec, run_dir=second["run_dir"])
    mgr.delete(first)  # forgotten: the directories are free again
    mgr.submit(spec, run_dir=second["run_dir"])


def test_remote_checkpoint_dirs_overlap_by_prefix(mgr):
    mgr.submit({**SPEC, "checkpoint": {"dir": "s3://bucket/team/a"}})
    with pytest.raises(JobConflict):
        mgr.submit({**SPEC, "checkpoint": {"dir": "s3://bucket/team/a/b"}})
    with pytest.raises(JobConflict):
        mgr.submit({**SPEC, "checkpoint": {"dir": "s3://bucket/team"}})
    mgr.submit({**SPEC, "checkpoint": {"dir": "s3://bucket/team/ab"}})
    mgr.submit({**SPEC, "checkpoint": {"dir": "gs://bucket/team/a"}})


# -- low items --------------------------------------------------------------------------------------------------

def test_a_submit_with_an_idempotency_key_is_safe_to_retry(mgr):
    a = mgr.submit(SPEC, idempotency_key="k1", owner="alice")
    assert mgr.submit(SPEC, idempotency_key="k1", owner="alice") == a
    assert len(mgr.list()) == 1 and len(mgr.launcher.live) == 1
    with pytest.raises(JobConflict, match="another request"):
        mgr.submit({**SPEC, "name": "other"}, idempotency_key="k1", owner="alice")
    assert mgr.submit(SPEC, idempotency_key="k1", owner="bob") != a  # keys are per user


def test_delete_does_not_release_a_coordinator_still_saving(mgr):
    job_id = mgr.submit(SPEC)
    h = mgr.launcher.live[job_id]  # takes the stop but never reaches STOPPED within stop_timeout_s
    with pytest.raises(JobConflict, match="final checkpoint"):
        mgr.delete(job_id)
    assert h.stops == 1 and job_id not in mgr.launcher.released and mgr.get(job_id).state == "RUNNING"
    h.state = "STOPPED"
    assert mgr.delete(job_id)["deleted"] is True and job_id in mgr.launcher.released
    other = mgr.submit(SPEC)
    assert mgr.delete(other, force=True)["deleted"] is True  # force: released whatever it is doing


def test_a_failing_sync_logs_its_traceback_once_a_minute_not_every_round(mgr, caplog):
    job_id = mgr.submit(SPEC)
    mgr.launcher.live[job_id].fail = RuntimeError("boom")
    with caplog.at_level(logging.WARNING, logger="service.server.store_sync"):
        for _ in range(20):
            mgr.syncer.sync_quietly(job_id)
    mine = [r for r in caplog.records if job_id in r.getMessage()]
    assert len(mine) == 20 and all("boom" in r.getMessage() for r in mine)
    assert sum(bool(r.exc_info) for r in mine) == 1


def test_a_ray_without_a_state_api_is_asked_once_a_minute_and_its_traceback_logged_once(monkeypatch, caplog):
    """Issue 29 item 7: with 10 UNKNOWN jobs on a Ray whose state API does not answer (no dashboard),
    every sync round asked it for every job and logged a traceback each time (~98 KB/s of log)."""
    import ray.util.state

    from service.server.job_actor import RayLauncher

    asked = []

    def no_answer(**kw):
        asked.append(kw)
        raise ConnectionError("no dashboard")

    monkeypatch.setattr(ray.util.state, "list_actors", no_answer)
    launcher = RayLauncher()
    with caplog.at_level(logging.INFO, logger="service.server.job_actor"):
        for _ in range(20):  # 20 sync rounds
            assert not any(launcher.gone(f"job{i}") for i in range(10))
    assert len(asked) == 1
    assert sum(r.exc_info is not None for r in caplog.records) == 1 and len(caplog.records) == 1
