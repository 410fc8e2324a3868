"""The SQLite job store: round trips, persistence across instances, and values JSON cannot carry."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from api.store import SCHEMA_VERSION, JobStore


def job(job_id: str, created: float = 1.0) -> dict:
    return {"id": job_id, "name": "tiny", "spec": {"train": {"steps": 3}}, "steps": 3, "workers": None,
            "run_dir": f"/runs/{job_id}", "created": created,
            "status": {"state": "PENDING", "reason": "submitted", "step": 0}}


def test_round_trip_and_persistence_across_instances(tmp_path):
    db = tmp_path / "sub" / "jobs.db"
    s = JobStore(db)
    s.create(job("a", 1.0))
    s.create(job("b", 2.0))
    s.set_status("a", {"state": "RUNNING", "reason": "training", "step": 2, "loss": 1.5})
    s.add_events("a", 0, [{"time": 1.0, "kind": "transition", "to_state": "STARTING"},
                          {"time": 2.0, "kind": "transition", "to_state": "RUNNING"}])
    s.add_metrics("a", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    s.mark_released("b")
    s.close()

    s = JobStore(f"sqlite:///{db}")
    a = s.get("a")
    assert a["state"] == "RUNNING" and a["reason"] == "training" and a["status"]["loss"] == 1.5
    assert a["spec"] == {"train": {"steps": 3}} and a["released"] is False and s.get("b")["released"] is True
    assert [j["id"] for j in s.list()] == ["a", "b"]
    assert s.event_count("a") == 2 and [e["to_state"] for e in s.events("a", 1)] == ["RUNNING"]
    assert s.last_step("a") == 2 and s.last_step("b") == 0
    assert [m["step"] for m in s.metrics("a", 1)] == [2]
    assert s.get("missing") is None


def test_a_redone_step_replaces_its_row(tmp_path):
    s = JobStore(tmp_path / "j.db")
    s.create(job("a"))
    s.add_metrics("a", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}])
    s.add_metrics("a", [{"step": 2, "loss": 2.5}])
    assert [(m["step"], m["loss"]) for m in s.metrics("a")] == [(1, 3.0), (2, 2.5)]
    assert [m["step"] for m in s.metrics("a", 0, limit=1)] == [1]


def test_nan_and_infinity_are_stored_as_null(tmp_path):
    s = JobStore(tmp_path / "j.db")
    s.create(job("a"))
    s.add_metrics("a", [{"step": 1, "loss": float("nan"), "tokens_per_s": float("inf")}])
    s.set_status("a", {"state": "RUNNING", "loss": float("-inf"), "nested": [float("nan")]})
    assert s.metrics("a") == [{"step": 1, "loss": None, "tokens_per_s": None}]
    assert s.get("a")["status"]["loss"] is None and s.get("a")["status"]["nested"] == [None]


def test_delete_removes_the_job_its_events_and_metrics(tmp_path):
    s = JobStore(tmp_path / "j.db")
    for j in ("a", "b"):
        s.create(job(j))
        s.add_events(j, 0, [{"time": 1.0, "kind": "info"}])
        s.add_metrics(j, [{"step": 1}])
    s.delete("a")
    assert s.get("a") is None and s.event_count("a") == 0 and s.metrics("a") == []
    assert s.event_count("b") == 1 and s.metrics("b") == [{"step": 1}]


def test_schema_tables_and_version(tmp_path):
    JobStore(tmp_path / "j.db").close()
    db = sqlite3.connect(tmp_path / "j.db")
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"jobs", "events", "metrics", "meta"}
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    with pytest.raises(RuntimeError, match="schema version 99, newer"):
        JobStore(tmp_path / "j.db")


def test_unsupported_urls_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unsupported store URL"):
        JobStore("postgresql://db/elastron")


def test_concurrent_writers_lose_nothing(tmp_path):
    s = JobStore(tmp_path / "j.db")
    errors = []

    def write(i: int) -> None:
        try:
            s.create(job(f"j{i:03d}", float(i)))
            s.add_metrics(f"j{i:03d}", [{"step": k} for k in range(1, 11)])
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(s.list()) == 40 and all(s.last_step(f"j{i:03d}") == 10 for i in range(40))
