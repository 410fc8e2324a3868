"""The store sync (service.server.store_sync.StoreSync) alone, against a fake store and a fake launcher:
what one sync pulls, a finished job released once, a coordinator not found shown UNKNOWN, a gone one
finalised from its run directory, and a round that syncs every unsettled job on the pool."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

from service.control.status import JobStatus
from service.server.coordinators import Coordinators
from service.server.job_locks import JobLocks
from service.server.job_record import JobRecord
from service.server.job_types import JobGone
from service.server.store_sync import UNKNOWN, StoreSync


class FakeStore:
    """The part of the job store the sync uses, in dicts."""

    def __init__(self, *records: JobRecord):
        self.rows = {r.id: r for r in records}
        self.event_rows: dict[str, list[dict]] = {r.id: [] for r in records}
        self.metric_rows: dict[str, list[dict]] = {r.id: [] for r in records}

    def get(self, job_id):
        return self.rows.get(job_id)

    def unsettled(self):
        return [r for r in self.rows.values() if not r.released]

    def event_count(self, job_id):
        return len(self.event_rows[job_id])

    def last_step(self, job_id):
        return max((m["step"] for m in self.metric_rows[job_id]), default=0)

    def add_events(self, job_id, start, events):
        assert start == len(self.event_rows[job_id])
        self.event_rows[job_id] += events

    def add_metrics(self, job_id, rows):
        self.metric_rows[job_id] += rows

    def metrics(self, job_id, since=0, limit=None, stride=1):
        return [m for m in self.metric_rows[job_id] if m["step"] > since][:limit]

    def set_status(self, job_id, status):
        self.rows[job_id] = replace(self.rows[job_id], status=status)

    def mark_released(self, job_id):
        self.rows[job_id] = replace(self.rows[job_id], released=True)


class Handle:
    def __init__(self, state="RUNNING", step=0, gone=False):
        self.state, self.step, self.gone, self.calls = state, step, gone, 0

    def status(self):
        self.calls += 1
        if self.gone:
            raise JobGone("its actor died")
        return JobStatus(state=self.state, step=self.step, total_steps=10, world_size=1)

    def events_since(self, index=0):
        return [{"kind": "step", "time": 0.0, "step": s} for s in range(index, self.step)]

    def metrics_since(self, step=0):
        return [{"step": s, "loss": 1.0 / s, "mfu": 0.5} for s in range(step + 1, self.step + 1)]


class Launcher:
    def __init__(self, **live: Handle):
        self.live, self.dead, self.released = dict(live), set(), []

    def attach(self, job_id):
        return self.live.get(job_id)

    def gone(self, job_id):
        return job_id in self.dead

    def where(self):
        return "the test"

    def release(self, job_id, timeout_s=10.0):
        self.released.append(job_id)


def record(job_id: str, run_dir, state: str = "RUNNING") -> JobRecord:
    return JobRecord(id=job_id, name=job_id, spec={}, run_dir=str(run_dir), created=0.0, updated=0.0,
                     status=JobStatus(state=state, total_steps=10))


def sync_of(store, launcher) -> StoreSync:
    return StoreSync(store, Coordinators(launcher), JobLocks(1.0), sync_interval_s=0.05, stop_timeout_s=1.0,
                     clock=lambda: 100.0)


def test_a_sync_pulls_status_events_and_metrics_and_releases_a_finished_job_once(tmp_path):
    store, h = FakeStore(record("a", tmp_path)), Handle(step=3)
    launcher = Launcher(a=h)
    s = sync_of(store, launcher)
    row = s.sync("a")
    assert (row.state, row.status.step, row.status.mfu, row.released) == ("RUNNING", 3, 0.5, False)
    assert [e["step"] for e in store.event_rows["a"]] == [0, 1, 2]
    assert [m["step"] for m in store.metric_rows["a"]] == [1, 2, 3]
    h.state, h.step = "SUCCEEDED", 5
    row = s.sync("a")
    assert (row.state, row.released, launcher.released) == ("SUCCEEDED", True, ["a"])
    assert [m["step"] for m in store.metric_rows["a"]] == [1, 2, 3, 4, 5]
    calls = h.calls
    assert s.sync("a").state == "SUCCEEDED" and h.calls == calls  # released: its coordinator is not asked again
    assert s.coordinators.get("a") is None


def test_a_coordinator_not_found_is_unknown_until_the_launcher_confirms_it_gone(tmp_path):
    store, launcher = FakeStore(record("a", tmp_path)), Launcher()
    s = sync_of(store, launcher)
    row = s.sync("a")
    assert row.state == UNKNOWN and "no coordinator found on the test" in row.status.reason
    assert not row.released
    launcher.dead.add("a")
    row = s.sync("a")
    assert row.state == "FAILED" and row.released and "the coordinator is gone" in row.status.reason


def test_a_gone_coordinator_is_finalised_from_the_events_and_metrics_in_its_run_directory(tmp_path):
    (tmp_path / "events.jsonl").write_text(json.dumps(
        {"job_id": "a", "index": 0, "time": 5.0, "kind": "transition", "step": 4, "from_state": "RUNNING",
         "to_state": "STOPPED", "reason": "stopped by its user", "cause": "user", "new_layout": None}) + "\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    store = FakeStore(record("a", tmp_path))
    launcher = Launcher(a=Handle(gone=True))
    row = sync_of(store, launcher).sync("a")
    assert (row.state, row.status.step, row.released) == ("STOPPED", 4, True)
    assert [m["step"] for m in store.metric_rows["a"]] == [1, 2, 3, 4]
    assert [e["kind"] for e in store.event_rows["a"]] == ["transition"]


def test_a_round_syncs_every_unsettled_job_and_a_hung_one_holds_up_no_other(tmp_path):
    release = threading.Event()

    class Hung(Handle):
        def status(self):
            release.wait(10)
            return super().status()

    store = FakeStore(record("hung", tmp_path / "h"), record("b", tmp_path / "b"), record("c", tmp_path / "c"))
    launcher = Launcher(hung=Hung(step=1), b=Handle(step=2), c=Handle(step=3))
    s = sync_of(store, launcher)
    s.open()
    try:
        s.round()
        deadline = time.monotonic() + 10
        while (store.get("b").status.step, store.get("c").status.step) != (2, 3):
            assert time.monotonic() < deadline, "b and c were not synced while the hung job's sync waited"
            time.sleep(0.01)
        assert store.get("hung").status.step == 0  # its sync is still waiting for an answer
        release.set()
        s.wait()
        assert store.get("hung").status.step == 1
    finally:
        release.set()
        s.close()
