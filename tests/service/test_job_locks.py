"""The per-job locks (service.server.job_locks.JobLocks) alone, over a dict of records: no lock for an
unknown id, a job deleted during the wait, a busy lock, and one command at a time."""

from __future__ import annotations

import threading

import pytest

from service.server.job_locks import JobLocks
from service.server.job_types import JobNotFound, JobUnavailable


def test_an_unknown_id_is_not_found_and_leaves_no_lock():
    locks = JobLocks(lock_timeout_s=1.0)
    with pytest.raises(JobNotFound):
        with locks.held("nope", {}.get):
            pass
    assert locks.known() == frozenset()


def test_the_record_is_yielded_under_the_lock_and_read_again_after_the_wait():
    records = {"a": "record of a"}
    locks = JobLocks(lock_timeout_s=5.0)
    lock = locks.lock_of("a")
    lock.acquire()  # another request holds the job
    seen: list = []

    def wait_for_it():
        try:
            with locks.held("a", records.get) as row:
                seen.append(row)
        except JobNotFound as e:
            seen.append(e)

    t = threading.Thread(target=wait_for_it)
    t.start()
    del records["a"]  # deleted while the other request waits
    lock.release()
    t.join(10)
    assert len(seen) == 1 and isinstance(seen[0], JobNotFound)
    assert "a" not in locks.known()  # the lock of a deleted job is dropped


def test_a_busy_lock_is_unavailable_after_the_timeout():
    locks = JobLocks(lock_timeout_s=0.05)
    held, done = threading.Event(), threading.Event()

    def hold():
        with locks.lock_of("a"):
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        with pytest.raises(JobUnavailable, match="busy"):
            with locks.held("a", {"a": 1}.get):
                pass
    finally:
        done.set()
        holder.join(10)
    with locks.held("a", {"a": 1}.get) as row:  # let go: the next request gets it
        assert row == 1


def test_a_second_command_for_the_same_job_is_refused_at_once():
    locks = JobLocks()
    with locks.one_command("a", "pause"):
        with pytest.raises(JobUnavailable, match="another command"):
            with locks.one_command("a", "stop"):
                pass
        with locks.one_command("b", "stop"):  # another job's command goes ahead
            pass
    with locks.one_command("a", "stop"):  # the first one is done
        pass
