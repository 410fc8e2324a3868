"""Issue 15 on the store and the run files: bounded reads (pages of jobs and events, a strided metrics
curve, metrics.jsonl read from its end or streamed, for a synthetic 1,000,000-step history), a version-1
store upgraded in place, SQLite refused on a network filesystem, and checkpoint listing that survives
retention deleting under it."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import tracemalloc
from pathlib import Path

import pytest

from api.store import JobStore, filesystem_type
from service.server.job_record import JobRecord
from service.control.status import JobStatus
from service.control.run_files import iter_metrics, last_logged_step, list_checkpoints

STEPS = 1_000_000


def job(job_id: str, created: float, owner: str | None = None, **kw) -> JobRecord:
    return JobRecord(id=job_id, name="t", spec={}, run_dir=f"/r/{job_id}", created=created, updated=created,
                     owner=owner, status=JobStatus(state="PENDING", step=0), **kw)


@pytest.fixture(scope="module")
def million(tmp_path_factory) -> Path:
    """RUN_DIR/metrics.jsonl of a 1,000,000-step run (~40 MB), with a torn last line."""
    run_dir = tmp_path_factory.mktemp("million")
    with (run_dir / "metrics.jsonl").open("w") as f:
        for s in range(1, STEPS + 1):
            f.write(f'{{"step": {s}, "loss": {1.0 / s:.6f}}}\n')
        f.write('{"step": 1000001, "lo')
    return run_dir


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_last_step_of_a_million_step_log_is_read_from_its_end(million):
    step, peak = _peak(lambda: last_logged_step(million))
    assert step == STEPS
    assert peak < 1 << 20  # the file is ~40 MB


def test_metrics_after_a_step_are_streamed_in_bounded_memory(million):
    rows, peak = _peak(lambda: list(iter_metrics(million / "metrics.jsonl", after=STEPS - 5)))
    assert [r["step"] for r in rows] == list(range(STEPS - 4, STEPS + 1))
    assert peak < 1 << 20
    assert [r["step"] for r in iter_metrics(million / "metrics.jsonl", after=10, before=13)] == [11, 12]


def test_a_long_history_is_read_in_pages_and_strides(tmp_path):
    """200,000 stored steps (a million costs ~25 s to insert on a shared CI core; paging is the point)."""
    n = 200_000
    s = JobStore(tmp_path / "j.db")
    s.create(job("a", 1.0))
    for start in range(1, n + 1, 50_000):
        s.add_metrics("a", [{"step": i, "loss": 1.0} for i in range(start, start + 50_000)])
    page = s.metrics("a", 0, 10_000)
    assert len(page) == 10_000 and page[-1]["step"] == 10_000
    curve = s.metrics("a", 0, 2000, stride=n // 1000)
    assert len(curve) == 1000 and curve[-1]["step"] == n
    assert s.last_step("a") == n


def test_jobs_and_events_come_in_pages(tmp_path):
    s = JobStore(tmp_path / "j.db")
    for i in range(30):
        s.create(job(f"j{i:02d}", float(i), owner="alice" if i % 3 == 0 else "bob"))
    assert [j.id for j in s.list(limit=5, offset=10)] == [f"j{i}" for i in range(10, 15)]
    assert [j.id for j in s.list(owner="alice", limit=3)] == ["j00", "j03", "j06"]
    assert s.count() == 30 and len(s.unsettled()) == 30
    s.add_events("j00", 0, [{"time": float(i), "kind": "x", "i": i} for i in range(50)])
    assert [e["i"] for e in s.events("j00", 10, 5)] == [10, 11, 12, 13, 14]


def test_a_version_1_store_gains_the_new_columns_and_keeps_its_rows(tmp_path):
    db = sqlite3.connect(tmp_path / "v1.db")
    db.executescript("""
    CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, steps INTEGER, workers INTEGER,
        run_dir TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, state TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '', status TEXT NOT NULL, released INTEGER NOT NULL DEFAULT 0);
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    INSERT INTO meta VALUES ('schema_version', '1');
    INSERT INTO jobs VALUES ('old', 't', '{}', NULL, NULL, '/r/old', 1.0, 1.0, 'RUNNING', '', '{"state": "RUNNING"}', 0);
    """)
    db.close()
    s = JobStore(tmp_path / "v1.db")
    old = s.get("old")
    assert old.owner is None and old.state == "RUNNING" and old.request is None and s.list(owner="alice") == []
    s.create(job("new", 2.0, owner="alice", idempotency_key="k", request={"spec": {}}))
    new = s.find_idempotent("alice", "k")
    assert new.id == "new" and new.request == {"spec": {}} and s.find_idempotent(None, "k") is None
    s.close()
    assert sqlite3.connect(tmp_path / "v1.db").execute(
        "SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "2"


@pytest.mark.parametrize("kind", ["nfs4", "nfs", "cifs", "fuse.glusterfs", "lustre"])
def test_sqlite_on_a_network_filesystem_is_refused(tmp_path, kind):
    with pytest.raises(ValueError, match=f"lies on a {kind} filesystem.*PostgreSQL"):
        JobStore(tmp_path / "j.db", fs_type=lambda d: kind)
    JobStore(tmp_path / "ok.db", fs_type=lambda d: "ext4").close()
    JobStore(":memory:", fs_type=lambda d: kind).close()  # no file: nothing shared


def test_the_filesystem_type_is_the_longest_mount_that_holds_the_path(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/export {tmp_path}/shared nfs4 rw 0 0\n")
    (tmp_path / "shared" / "db").mkdir(parents=True)
    assert filesystem_type(tmp_path / "shared" / "db", mounts=str(mounts)) == "nfs4"
    assert filesystem_type(tmp_path / "sharedx", mounts=str(mounts)) == "ext4"
    assert filesystem_type(tmp_path, mounts=str(tmp_path / "missing")) is None


def test_listing_checkpoints_while_retention_deletes_them_never_fails(tmp_path):
    ck = tmp_path / "checkpoints"
    stop = threading.Event()

    def churn():  # retention: new checkpoints commit, old ones go
        i = 0
        while not stop.is_set():
            d = ck / f"step-{i:08d}"
            (d / "shards").mkdir(parents=True)
            for k in range(20):
                (d / "shards" / f"{k}.bin").write_bytes(b"x" * 10)
            (d / "manifest.json").write_text(json.dumps({"step": i}))
            (ck / "latest").write_text(d.name)
            if i >= 2:
                shutil.rmtree(ck / f"step-{i - 2:08d}", ignore_errors=True)
            i += 1

    t = threading.Thread(target=churn, daemon=True)
    ck.mkdir()
    t.start()
    try:
        for _ in range(300):
            got = list_checkpoints(str(ck), str(tmp_path))
            assert all(e["name"].startswith("step-") for e in got["entries"])
    finally:
        stop.set()
        t.join(10)
