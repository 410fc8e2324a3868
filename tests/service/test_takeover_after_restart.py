"""Takeover on its own (service.control.takeover), over a fake group and no coordinator: where a
restarted coordinator starts (`restarted`), and what taking over the workers left running returns
(`adopt`: Adopting -> Running or Pending)."""

from __future__ import annotations

from service.control.source import Heal
from service.control.journal import Journal
from service.control.state import JobState
from service.control.states import Adopting, Pending, Running
from service.pool.group import FailureKind
from tests.fakes import make_parts


def lost_coordinators_events(p, *, step: int, restarts: int = 0) -> list:
    """The events a lost coordinator left: its earlier restarts, and the group it formed for `p`."""
    events = []
    journal = Journal("job1", current=lambda: JobState.RUNNING, sink=events.append)
    for _ in range(restarts):
        journal.note("failure", reason="restarted", step=0, cause="failure",
                details={"kind": FailureKind.COORDINATOR_RESTARTED})
    journal.note("resize", reason="formed", step=step, cause="planned", details={"plan": p.to_dict()})
    return events


def left_running(parts, p, nodes, *, step: int):
    """The fake group class adopts (as detached workers outlive their coordinator) a group of `p` on `nodes`."""
    def adopt(self):
        self.members, self.plan, self.step = list(nodes), p, step
        return len(nodes)
    parts.group_cls.adopt = adopt


def test_a_restarted_coordinator_with_detached_workers_starts_by_adopting_its_last_plan(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, owner="elastron-job-job1")
    p = parts.reconfigure.plan_for(2)

    out = parts.takeover.restarted(lost_coordinators_events(p, step=7, restarts=1))

    assert isinstance(out, Adopting) and out.lost == p and out.record.step_before == 7
    # its own restart and the earlier one both count against the restart budget
    assert [f.kind for f in parts.failures] == [FailureKind.COORDINATOR_RESTARTED] * 2
    assert "taking over the workers it left running" in parts.notes("failure")[-1].reason


def test_a_restarted_coordinator_without_detached_workers_starts_pending(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2})

    out = parts.takeover.restarted(lost_coordinators_events(parts.reconfigure.plan_for(2), step=7))

    assert isinstance(out, Pending) and out.record.step_before == 7 and out.survivors is None


def test_a_sound_group_left_running_is_adopted_and_trains_on_in_place(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, owner="elastron-job-job1")
    p = parts.reconfigure.plan_for(2)
    left_running(parts, p, ["a", "b"], step=9)  # two steps past what the lost coordinator recorded
    adopting = parts.takeover.restarted(lost_coordinators_events(p, step=7))

    out = parts.takeover.adopt(adopting, parts.watcher.poll())

    assert isinstance(out, Running) and out.record.transfer.to_dict() == {"path": "in place"}
    assert out.record.resumed_step == out.record.step_before == 9 and out.record.started == 0
    assert out.plan == p and out.group.members == ["a", "b"] and parts.progress.step_done == 9


def test_workers_left_running_that_cannot_train_on_are_salvaged_to_heal_the_next_group(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, owner="elastron-job-job1", parallel={"dp_mode": "replicate"})
    parts.group_cls.heals, parts.group_cls.intact = True, False
    p = parts.reconfigure.plan_for(2)
    left_running(parts, p, ["a", "b"], step=7)
    adopting = parts.takeover.restarted(lost_coordinators_events(p, step=7))

    out = parts.takeover.adopt(adopting, parts.watcher.poll())

    assert isinstance(out, Pending) and out.survivors == Heal(old=p, ranks=(0, 1))
    assert out.group.members == ["a", "b"]  # kept to form from; no layout runs until it forms


def test_nothing_left_running_to_adopt_leaves_the_job_pending_without_a_group(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, owner="elastron-job-job1")
    p = parts.reconfigure.plan_for(2)
    adopting = parts.takeover.restarted(lost_coordinators_events(p, step=7))

    out = parts.takeover.adopt(adopting, parts.watcher.poll())

    assert out == Pending(reason=adopting.reason, cause="failure", record=adopting.record)
    assert out.group is None
