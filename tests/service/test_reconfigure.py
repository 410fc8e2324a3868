"""Reconfigure on its own (service.control.reconfigure), over a fake group and no coordinator: each
source `choose_source` can answer is carried out, and the state returned is the outcome."""

from __future__ import annotations

import time

from service.control.policy import Resize, Wait
from service.control.source import Heal
from service.control.state import JobState
from service.control.states import Ended, Recovering, Running, Waiting
from tests.fakes import make_parts


def carry_out(parts, d, *, group=None, sound=None, survivors=None, cause="planned"):
    return parts.reconfigure.carry_out(d, parts.watcher.poll(), group=group, sound=sound, survivors=survivors,
                                       cause=cause, detected=time.time(), record=None)


def test_a_wait_decision_flushes_the_sound_group_and_releases_every_worker(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2})
    g, p = parts.holding(2, ["a", "b"], step=7)

    out = carry_out(parts, Wait("fewer usable workers than min_workers"), group=g, sound=p, cause="failure")

    assert out == Waiting(reason="fewer usable workers than min_workers")  # holding no group
    assert g.members == [] and parts.progress.committed_step == 7  # nothing redone on return
    assert [e.step for e in parts.notes("checkpoint")] == [7]


def test_a_start_with_no_group_restores_from_the_last_committed_checkpoint(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2})
    parts.group_cls.disk.committed = 5
    parts.progress.step_done = 7

    out = carry_out(parts, Resize(workers=2, cause="planned", reason="starting"))

    assert isinstance(out, Running) and not out.durable_due
    assert out.record.transfer.path == "storage" and out.record.resumed_step == 5 and out.record.steps_lost == 2
    assert out.plan == parts.reconfigure.plan_for(2) and parts.progress.step_done == 5
    assert out.group.size == 2


def test_a_growth_of_a_sound_group_moves_its_state_live_and_asks_for_a_durable_checkpoint(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2})
    g, p = parts.holding(2, ["a", "b"], step=7)

    out = carry_out(parts, Resize(workers=4, cause="grow", reason="2 more workers"), group=g, sound=p, cause="grow")

    assert isinstance(out, Running) and out.durable_due and out.cause == "grow" and out.group is g
    assert out.record.transfer.path == "live" and out.record.resumed_step == 7 and out.record.steps_lost == 0
    assert out.plan.world_size == 4 and parts.group_cls.resharded == [
        {"survivors": None, "serve": None, "snapshot_step": None}]


def test_survivors_that_hold_every_shard_heal_the_next_group(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, parallel={"dp_mode": "replicate"})
    g, p = parts.holding(2, ["a", "b"], step=7)

    out = carry_out(parts, Resize(workers=2, cause="planned", reason="restart"), group=g,
                    survivors=Heal(old=p, ranks=(0,)))

    assert isinstance(out, Running) and out.record.transfer.path == "peers" and out.record.resumed_step == 7
    assert parts.group_cls.resharded[-1]["survivors"] == [0]


def test_a_live_move_that_fails_with_snapshots_off_falls_back_to_storage(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, checkpoint={"peer_interval": 0})
    g, p = parts.holding(2, ["a", "b"], step=7)
    parts.group_cls.fail_next.append("transfer")

    out = carry_out(parts, Resize(workers=4, cause="grow", reason="2 more workers"), group=g, sound=p, cause="grow")

    assert isinstance(out, Recovering) and out.survivors is None and out.record.step_before == 7
    (failure,) = parts.notes("failure")  # one failure, one event
    assert failure.reason == "a worker died during state transfer" and failure.details["during"] == "transfer"
    (fallback,) = parts.notes("fallback")
    assert fallback.reason == ("the workers handed their state over to the transfer that failed, and peer "
                               "snapshots are off; falling back to the last committed checkpoint (step 0)")


def test_a_size_that_cannot_be_placed_fails_the_job_and_releases_the_group(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2})
    g, p = parts.holding(2, ["a", "b"], step=7)

    out = carry_out(parts, Resize(workers=8, cause="grow", reason="8 workers"), group=g, sound=p, cause="grow")

    assert isinstance(out, Ended) and out.final is JobState.FAILED and out.reason.startswith("cannot plan 8 workers")
    assert g.members == []
