"""A coordinator that lives through thousands of reconfigurations holds a bounded history in memory:
its event log keeps the newest events (the file keeps every one, and serves the older), its
reconfiguration records the newest (with totals over all of them)."""

from __future__ import annotations

from service.control.events import Event, EventLog
from service.control.reconfiguration import Reconfig, Reconfigs
from service.control.run_files import job_events


def _ev(i: int, job: str = "j") -> Event:
    return Event(time=float(i), job_id=job, kind="info", reason=f"event {i}", step=i)


def test_an_event_log_with_a_file_keeps_the_newest_in_memory_and_reads_older_ones_back(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", keep=3)
    assert [log.append(_ev(i)) for i in range(10)] == list(range(10))
    assert len(log) == 10
    assert len(log._events) == 3  # what the process holds
    assert [e.step for e in log.since(8)] == [8, 9]  # from memory
    assert [e.step for e in log.since(2)] == list(range(2, 10))  # older ones from the file
    assert [e.step for e in log.events] == list(range(10))


def test_a_reloaded_log_keeps_its_jobs_events_only_and_reads_them_back_from_a_shared_file(tmp_path):
    path = tmp_path / "events.jsonl"
    first = EventLog(path, keep=2)
    for i in range(3):
        first.append(_ev(i, job="old"))
    for i in range(5):
        first.append(_ev(100 + i, job="j"))
    log = job_events(path, "j")
    log.keep = 2
    log.append(_ev(105))
    log.append(_ev(106))
    assert len(log) == 7
    assert [e.step for e in log.since(0)] == list(range(100, 107))
    assert {e.job_id for e in log.events} == {"j"}


def test_an_event_log_without_a_file_keeps_everything():
    log = EventLog(keep=2)
    for i in range(5):
        log.append(_ev(i))
    assert [e.step for e in log.since(0)] == list(range(5))


def test_reconfiguration_records_are_bounded_and_their_totals_count_every_one():
    recs = Reconfigs(keep=2)
    for i, cause in enumerate(["user", "failure", "user", "grow", "failure"]):
        r = Reconfig(cause=cause, detected=float(i), step_before=10 * i)
        r = r.formed(new_layout={}, resumed_step=10 * i - (3 if cause == "failure" else 0), started=0, stopped=0,
                 world_size=1)
        recs.append(r)
    assert [r.cause for r in recs] == ["grow", "failure"]
    assert recs.totals() == ({"user": 2, "failure": 2, "grow": 1}, 6)
