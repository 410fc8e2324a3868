"""The job store on every backend it supports (a SQLite file, SQLite in memory, a real PostgreSQL): round
trips, upserts, persistence across instances, values JSON cannot carry, concurrency, and URL handling."""

from __future__ import annotations

import sqlite3
import threading

import pytest
import sqlalchemy as sa

from api.store import SCHEMA_VERSION, JobStore, filesystem_type, journal_mode, network_filesystem, redact, store_url
from service.server.job_record import JobRecord
from service.control.status import JobStatus

BACKENDS = ["sqlite-file", "sqlite-memory", "postgresql"]
PERSISTENT = ["sqlite-file", "postgresql"]


def job(job_id: str, created: float = 1.0, **kw) -> JobRecord:
    return JobRecord(**{"id": job_id, "name": "tiny", "spec": {"train": {"steps": 3}}, "steps": 3, "workers": None,
                        "run_dir": f"/runs/{job_id}", "created": created, "updated": created,
                        "status": JobStatus(state="PENDING", reason="submitted", step=0), **kw})


@pytest.fixture
def url(request, tmp_path):
    """The URL of an empty store on the backend named by the test's parameter."""
    kind = request.param
    if kind == "sqlite-file":
        return str(tmp_path / "sub" / "jobs.db")
    if kind == "sqlite-memory":
        return ":memory:"
    return request.getfixturevalue("pg_url")


def each(backends):
    return pytest.mark.parametrize("url", backends, indirect=True)


@each(PERSISTENT)
def test_round_trip_and_persistence_across_instances(url):
    s = JobStore(url)
    s.create(job("a", 1.0))
    s.create(job("b", 2.0))
    s.set_status("a", JobStatus(state="RUNNING", reason="training", step=2, loss=1.5))
    s.add_events("a", 0, [{"time": 1.0, "kind": "transition", "to_state": "STARTING"},
                          {"time": 2.0, "kind": "transition", "to_state": "RUNNING"}])
    s.add_metrics("a", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    s.mark_released("b")
    s.close()

    s = JobStore(url if "://" in url else f"sqlite:///{url}")
    a = s.get("a")
    assert a.state == "RUNNING" and a.status.reason == "training" and a.status.loss == 1.5 and a.status.step == 2
    assert a.spec == {"train": {"steps": 3}} and a.released is False and s.get("b").released is True
    assert a.updated > a.created == 1.0 and a.steps == 3 and a.workers is None and a.owner is None
    assert a.status == JobStatus(state="RUNNING", reason="training", step=2, loss=1.5)  # every field round trips
    assert [j.id for j in s.list()] == ["a", "b"]
    assert s.event_count("a") == 2 and [e["to_state"] for e in s.events("a", 1)] == ["RUNNING"]
    assert s.last_step("a") == 2 and s.last_step("b") == 0
    assert [m["step"] for m in s.metrics("a", 1)] == [2]
    assert s.get("missing") is None
    s.close()


@each(BACKENDS)
def test_a_redone_step_or_event_replaces_its_row(url):
    s = JobStore(url)
    s.create(job("a"))
    s.add_metrics("a", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}])
    s.add_metrics("a", [{"step": 2, "loss": 2.5}, {"step": 3, "loss": 2.4}])
    assert [(m["step"], m["loss"]) for m in s.metrics("a")] == [(1, 3.0), (2, 2.5), (3, 2.4)]
    assert [m["step"] for m in s.metrics("a", 0, limit=1)] == [1] and s.last_step("a") == 3
    s.add_events("a", 0, [{"time": 1.0, "kind": "info", "n": 0}, {"time": 2.0, "kind": "info", "n": 1}])
    s.add_events("a", 1, [{"time": 3.0, "kind": "failure", "n": 9}])
    assert [(e["kind"], e["n"]) for e in s.events("a")] == [("info", 0), ("failure", 9)] and s.event_count("a") == 2
    s.close()


@each(BACKENDS)
def test_nan_infinity_and_nul_survive_as_json_can_carry_them(url):
    s = JobStore(url)
    s.create(job("a", name="nul\x00name"))
    s.add_metrics("a", [{"step": 1, "loss": float("nan"), "tokens_per_s": float("inf"), "note": "x\x00y"}])
    s.set_status("a", JobStatus(state="RUNNING", loss=float("-inf"), layout={"nested": [float("nan")]}, reason="r\x00"))
    assert s.metrics("a") == [{"step": 1, "loss": None, "tokens_per_s": None, "note": "x\x00y"}]
    a = s.get("a")
    assert a.status.loss is None and a.status.layout == {"nested": [None]} and a.status.reason == "r\x00"
    assert a.name == "nul\ufffdname"  # plain columns (name; reason, copied out of status): PostgreSQL has no NUL
    assert s.get("a\x00") is None and s.events("a\x00") == [] and s.last_step("a\x00") == 0
    s.close()


@each(BACKENDS)
def test_delete_removes_the_job_its_events_and_metrics(url):
    s = JobStore(url)
    for j in ("a", "b"):
        s.create(job(j))
        s.add_events(j, 0, [{"time": 1.0, "kind": "info"}])
        s.add_metrics(j, [{"step": 1}])
    s.delete("a")
    assert s.get("a") is None and s.event_count("a") == 0 and s.metrics("a") == []
    assert s.event_count("b") == 1 and s.metrics("b") == [{"step": 1}]
    s.close()


@each(PERSISTENT)
def test_schema_tables_and_a_newer_version_is_refused(url):
    JobStore(url).close()
    eng = sa.create_engine(store_url(url))
    try:
        assert set(sa.inspect(eng).get_table_names()) == {"jobs", "events", "metrics", "meta", "areas"}
        with eng.begin() as c:
            assert c.execute(sa.text("SELECT value FROM meta WHERE key='schema_version'")).scalar_one() == str(
                SCHEMA_VERSION)
            c.execute(sa.text("UPDATE meta SET value='99' WHERE key='schema_version'"))
    finally:
        eng.dispose()
    with pytest.raises(RuntimeError, match="schema version 99, newer"):
        JobStore(url)


def test_a_sqlite_file_is_in_wal_mode(tmp_path):
    JobStore(tmp_path / "j.db").close()
    assert sqlite3.connect(tmp_path / "j.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("kind", ["ext4", "xfs", "tmpfs", "overlay", "btrfs", "zfs"])
def test_wal_on_local_filesystem_types(kind):
    assert journal_mode(kind) == "wal" and not network_filesystem(kind)


@pytest.mark.parametrize("kind", ["fuse.rclone", "fuse.blobfuse2", "nfs4", "cifs", "fuse.some-new-fs", "fuse",
                                  "fuseblk", "virtiofs", "somethingfs", None])
def test_no_wal_on_any_other_type(kind):
    assert journal_mode(kind) == "delete"


def test_object_store_mounts_are_known_network_filesystems():
    assert all(network_filesystem(k) for k in ("fuse.rclone", "fuse.blobfuse2", "nfs4", "smb3"))
    assert not any(network_filesystem(k) for k in ("fuse.some-new-fs", "ext4", None))


def test_the_type_comes_from_the_mount_table_with_escaped_names(tmp_path):
    (tmp_path / "my disk" / "db").mkdir(parents=True)
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nremote: {tmp_path}/my\\040disk fuse.rclone rw 0 0\n")
    assert journal_mode(filesystem_type(tmp_path / "my disk" / "db", mounts=str(mounts))) == "delete"
    assert journal_mode(filesystem_type(tmp_path, mounts=str(mounts))) == "wal"


def test_a_store_on_a_fuse_mount_has_a_rollback_journal_and_says_why(tmp_path, caplog):
    JobStore(tmp_path / "j.db", fs_type=lambda d: "ext4").close()  # once in WAL: the mode stays in the file
    with caplog.at_level("WARNING", logger="api.store"):
        s = JobStore(tmp_path / "j.db", fs_type=lambda d: "fuse.some-new-fs")
    s.create(job("a", 1.0))
    assert s.get("a").id == "a"
    s.close()
    assert sqlite3.connect(tmp_path / "j.db").execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    said = [r.getMessage() for r in caplog.records if r.name == "api.store"]
    assert len(said) == 1 and "no WAL on a fuse.some-new-fs filesystem" in said[0] and "\n" not in said[0]


OLD_SCHEMA = """
CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, steps INTEGER, workers INTEGER,
    run_dir TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '', status TEXT NOT NULL, released INTEGER NOT NULL DEFAULT 0);
CREATE TABLE events (job_id TEXT NOT NULL, idx INTEGER NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL,
    data TEXT NOT NULL, PRIMARY KEY (job_id, idx));
CREATE TABLE metrics (job_id TEXT NOT NULL, step INTEGER NOT NULL, time REAL, data TEXT NOT NULL,
    PRIMARY KEY (job_id, step));
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO jobs VALUES ('old', 'tiny', '{}', NULL, NULL, '/runs/old', 1.0, 1.0, 'SUCCEEDED', '', '{"state": "SUCCEEDED"}', 1);
INSERT INTO metrics VALUES ('old', 1, NULL, '{"step": 1, "loss": 2.0}');
"""


def test_a_store_written_by_the_sqlite3_version_still_opens(tmp_path):
    db = sqlite3.connect(tmp_path / "old.db")
    db.executescript(OLD_SCHEMA)
    db.close()
    s = JobStore(tmp_path / "old.db")
    assert s.get("old").released is True and s.get("old").state == "SUCCEEDED" and s.metrics("old") == [{"step": 1, "loss": 2.0}]
    s.add_metrics("old", [{"step": 1, "loss": 1.0}])
    assert s.metrics("old") == [{"step": 1, "loss": 1.0}]


@pytest.mark.parametrize("given,want", [
    ("runs/elastron.db", "sqlite:///runs/elastron.db"),
    ("/abs/j.db", "sqlite:////abs/j.db"),
    (":memory:", "sqlite://"),
    ("sqlite:///x.db", "sqlite:///x.db"),
    ("postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
    ("postgres://u@h:5433/db", "postgresql+psycopg://u@h:5433/db"),
    ("postgresql+psycopg://u:pw@h/db", "postgresql+psycopg://u:***@h/db"),
])
def test_paths_and_urls_map_to_sqlalchemy_urls(given, want):
    assert redact(store_url(given)) == want


@pytest.mark.parametrize("url,match", [
    ("mysql://u:sekrit@db/elastron", "unsupported store URL 'mysql://u:\\*\\*\\*@db/elastron'"),
    ("oracle://db", "unsupported store URL"),
    ("", "must not be empty"),
    ("postgresql://u:sekrit@db:port/x", "cannot be parsed"),
    ("postgresql+nosuchdriver://u:sekrit@db/x", "needs a database driver that is not installed"),
])
def test_unsupported_urls_are_one_clear_line_without_the_password(url, match):
    with pytest.raises(ValueError, match=match) as e:
        JobStore(url)
    assert "\n" not in str(e.value) and "sekrit" not in str(e.value) and "sqlite:///PATH" in str(e.value)


def test_an_unreachable_database_is_one_clear_line_without_the_password(tmp_path):
    with pytest.raises(RuntimeError, match="cannot open the job store postgresql\\+psycopg://u:\\*\\*\\*@") as e:
        JobStore(f"postgresql://u:sekrit@/elastron?host={tmp_path}/no-server-here")
    assert "\n" not in str(e.value) and "sekrit" not in str(e.value)


@each(BACKENDS)
def test_concurrent_writers_lose_nothing(url):
    s = JobStore(url)
    errors = []

    def write(i: int) -> None:
        try:
            s.create(job(f"j{i:03d}", float(i)))
            s.add_metrics(f"j{i:03d}", [{"step": k} for k in range(1, 11)])
            s.add_events(f"j{i:03d}", 0, [{"time": 1.0, "kind": "info"}])
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(s.list()) == 40 and all(s.last_step(f"j{i:03d}") == 10 and s.event_count(f"j{i:03d}") == 1
                                       for i in range(40))
    s.close()
