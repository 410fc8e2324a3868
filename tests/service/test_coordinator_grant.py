"""Tier 1: a coordinator on a shared cluster plans onto its grant, not onto the whole cluster (issue 16,
deliverable 1), with the fake group and cluster of tests/fakes.py."""

from __future__ import annotations

from tests.fakes import advance, make_coordinator


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


def test_a_grant_below_min_workers_waits_and_says_the_scheduler_is_why(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, min_workers=2)
    c.grant = {"a": 1}
    advance(c, lambda c: str(c.sm.state) == "WAITING_FOR_CAPACITY")
    assert c.sm.reason == "the scheduler grants 1 workers < min_workers=2"
    c.grant = {"a": 2}
    advance(c, lambda c: str(c.sm.state) == "RUNNING")
    assert set(c.group.nodes()) == {"a"}
