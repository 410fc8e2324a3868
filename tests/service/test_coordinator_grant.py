"""Tier 1: a coordinator on a shared cluster plans onto its grant, not onto the whole cluster (issue 16,
deliverable 1), with the fake group and cluster of tests/fakes.py."""

from __future__ import annotations

from tests.fakes import advance, make_coordinator
from service.control.commands import Grant, Pause, Resume


def test_a_coordinator_places_only_on_its_grant_and_follows_it_with_planned_resizes(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, steps=40, settle=3600.0)
    c.grant = {"b": 2}  # node a belongs to another job
    advance(c, lambda c: c.step_done >= 3)
    assert c.group.size == 2 and set(c.group.nodes()) == {"b"}

    c.grant = {"b": 1}  # shrunk by the scheduler to admit another job: planned, no step redone
    advance(c, lambda c: c.group.size == 1 and c.step_done >= 6)
    shrink = c.reconfigs[1]
    assert shrink.cause == "planned" and shrink.steps_lost == 0

    c.grant = {"a": 2, "b": 2}  # given back: grows at once, although settle_seconds is an hour
    advance(c, lambda c: len(c.reconfigs) == 3, limit=20)  # recorded once the first step after it ran
    assert c.group.size == 4 and c.reconfigs[-1].cause == "grow" and c.reconfigs[-1].steps_lost == 0


def test_a_grant_below_min_workers_is_queued_and_says_the_scheduler_is_why(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, min_workers=2)
    c.grant = {"a": 1}
    advance(c, lambda c: str(c.state.name) == "QUEUED")
    assert c.state.reason == "the scheduler grants 1 workers < min_workers=2"
    c.grant = {"a": 2}
    advance(c, lambda c: str(c.state.name) == "RUNNING")
    assert set(c.group.nodes()) == {"a"}


def test_grants_come_as_commands_with_their_reason_as_an_event_and_the_queue_in_the_status(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, min_workers=2, steps=40, settle=3600.0)
    c.grant = {}  # launched by the service: nothing granted yet
    c.send(Grant(nodes={}, reason="needs 2 workers; 0 can be granted", queue_position=3))
    advance(c, lambda c: str(c.state.name) == "QUEUED")
    st = c.status()
    assert (st.state, st.queue_position, st.reason) == ("QUEUED", 3, "needs 2 workers; 0 can be granted")
    assert st.grant == {} and st.held == {}

    c.send(Grant(nodes={"b": 2}, reason="admitted on 2 workers (min 2, priority 0)"))
    advance(c, lambda c: c.step_done >= 2)
    st = c.status()
    assert (st.state, st.queue_position, st.held, st.grant) == ("RUNNING", None, {"b": 2}, {"b": 2})
    told = [e.reason for e in c.events.events if e.kind == "schedule"]
    assert told == ["needs 2 workers; 0 can be granted", "admitted on 2 workers (min 2, priority 0)"]

    c.send(Pause(by="scheduler", reason="paused (checkpoint first, was 2 workers) to admit job h (priority 9)"))
    advance(c, lambda c: str(c.state.name) == "PAUSED")
    assert c.state.cause == "scheduler" and c.state.reason.startswith("paused (checkpoint first") and c.group is None
    assert c.committed_step == c.step_done  # checkpoint first: nothing to redo
    c.send(Grant(nodes={"a": 2}, reason="resumed on 2 workers: capacity given back in priority order (priority 0)"))
    c.send(Resume(by="scheduler"))
    advance(c, lambda c: str(c.state.name) == "RUNNING")
    assert set(c.group.nodes()) == {"a"} and c.state.cause is not None


def test_a_job_the_whole_cluster_cannot_fit_waits_in_the_schedulers_queue_with_its_place_and_reason(tmp_path):
    # min_workers above the whole cluster: the cluster is too small *and* the scheduler gives nothing; the
    # scheduler's queue is where it waits, so its place and its reason are what the status shows
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, min_workers=6, max_workers=8)
    c.grant = {}
    why = "needs 6 workers of 1 CPU; the whole cluster fits 4"
    c.send(Grant(nodes={}, reason=why, queue_position=2))
    advance(c, lambda c: str(c.state.name) != "PENDING")
    for _ in range(5):  # and stays there
        c.watcher.poll()
        c.step()
    st = c.status()
    assert (st.state, st.queue_position, st.reason) == ("QUEUED", 2, why)


def test_bad_grants_and_pausers_are_refused_at_once(tmp_path):
    import pytest

    c, _, _ = make_coordinator(tmp_path, {"a": 2})
    with pytest.raises(ValueError, match="a grant is"):
        c.send(Grant(nodes={"a": 0}, reason="x"))
    with pytest.raises(ValueError, match="needs its reason"):
        c.send(Grant(nodes={"a": 1}, reason=""))
    with pytest.raises(ValueError, match="pause by must be one of"):
        c.send(Pause(by="someone"))
