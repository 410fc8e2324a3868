"""A coordinator that dies and is started again (Ray restarts its actor) continues the same job: it
keeps the job's event history, records the restart as a failure with the steps it costs, and resumes
from the last committed checkpoint, or, where its workers outlived it (`CoordinatorOptions.owner`),
takes them over and heals from their state. Tier 1: the fake worker group of tests/fakes.py, no Ray
(tests/service/test_coordinator_takeover.py has the real workers)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from service.control.coordinator import Coordinator, CoordinatorOptions
from service.control.state import JobState as S
from service.control.states import Starting
from tests.fakes import advance, make_coordinator, metrics_row


def again(first: Coordinator, group_cls, cluster, *, job_id: str = "job1", owner: str | None = None) -> Coordinator:
    """A new coordinator for the same run directory, as Ray's actor restart builds it."""
    c = Coordinator(replace(first.job, id=job_id), watcher=cluster.watcher(),
                    options=CoordinatorOptions(settle_seconds=0.0, max_restarts=2, owner=owner))
    c.worker_group_cls = group_cls
    c.group_probe = lambda nodes, timeout_s: set(nodes)
    return c


def test_a_restarted_coordinator_resumes_from_the_last_commit_and_keeps_the_history(tmp_path):
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2, "b": 2})
    advance(first, lambda c: c.step_done >= 7)
    before = first.events_since(0)
    committed = group_cls.disk.committed
    assert committed == 5  # interval 5: the last commit before step 7
    # The first coordinator's process is gone (nothing is shut down cleanly); metrics.jsonl as rank 0 left it.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 9)) + '{"st')

    second = again(first, group_cls, cluster)
    advance(second, lambda c: c.state.name.is_terminal)

    assert str(second.state.name) == "SUCCEEDED" and second.step_done == 20
    events = second.events_since(0)
    assert events[:len(before)] == before  # history continues, same indexes
    restart = events[len(before)]
    assert restart["kind"] == "failure" and restart["details"]["kind"] == "coordinator_restarted"
    assert restart["step"] == 8 and "resuming from the last committed checkpoint" in restart["reason"]
    rc = second.reconfigs[0]
    assert rc.cause == "failure" and rc.step_before == 8 and rc.resumed_step == committed
    assert rc.steps_lost == 8 - committed and rc.old_layout == first.plan.layout
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == events


def test_another_jobs_events_in_the_run_dir_are_not_adopted(tmp_path):
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2})
    advance(first, lambda c: c.state.name.is_terminal)
    group_cls.disk.committed = 0
    other = again(first, group_cls, cluster, job_id="job2")
    assert other.events_since(0) == [] and other.failures == ()
    advance(other, lambda c: c.state.name.is_terminal)
    assert str(other.state.name) == "SUCCEEDED" and other.reconfigs[0].cause == "planned"
    assert {e["job_id"] for e in other.events_since(0)} == {"job2"}


def left_running(group_cls, lost):
    """`group_cls` whose `adopt` takes over the group `lost` (the dead coordinator's) as it was: its
    members at their step, as detached workers outlive their coordinator."""
    def adopt(self):
        self.members, self.step, self.plan = list(lost.members), lost.step, lost.plan
        return len(self.members)
    return type("LeftRunning", (group_cls,), {"adopt": adopt})


def test_a_restarted_coordinator_trains_on_with_the_group_it_takes_over_as_it_is(tmp_path):
    """The workers the lost coordinator left training are still its plan's group: they train on from
    their step, nothing re-formed, no state moved (live or storage resharding alike)."""
    for reshard in ("live", "storage"):
        first, cluster, group_cls = make_coordinator(tmp_path / reshard, {"a": 2, "b": 2},
                                                     parallel={"reshard": reshard})
        advance(first, lambda c: c.step_done >= 7)
        (tmp_path / reshard / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))

        second = again(first, left_running(group_cls, first.group), cluster, owner="elastron-job-job1")
        advance(second, lambda c: c.state.name.is_terminal)

        assert str(second.state.name) == "SUCCEEDED" and second.step_done == 20
        rc = second.reconfigs[0]
        assert rc.cause == "failure" and rc.step_before == 7 and rc.resumed_step == 7 and rc.steps_lost == 0
        assert rc.started == rc.stopped == 0 and rc.transfer.path == "in place"
        moves = [(e["from_state"], e["to_state"]) for e in second.events_since(len(first.events_since(0)))
                 if e["kind"] == "transition"]
        assert moves == [("PENDING", "RUNNING"), ("RUNNING", "SUCCEEDED")], moves


def test_a_restarted_coordinator_heals_from_the_workers_left_running_when_they_cannot_train_on(tmp_path):
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2, "b": 2})
    group_cls.heals, group_cls.intact = True, False
    advance(first, lambda c: c.step_done >= 7)
    assert group_cls.disk.committed == 5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))

    second = again(first, left_running(group_cls, first.group), cluster, owner="elastron-job-job1")
    advance(second, lambda c: c.state.name.is_terminal)

    assert str(second.state.name) == "SUCCEEDED" and second.step_done == 20
    rc = second.reconfigs[0]
    assert rc.cause == "failure" and rc.step_before == 7 and rc.resumed_step == 7 and rc.steps_lost == 0
    assert rc.started == 0 and rc.transfer.path == "peers"  # healed from the same workers, none started
    kinds = [(e["kind"], e["reason"]) for e in second.events_since(0)]
    assert ("info", "took over 4 worker(s) the previous coordinator left running") in kinds
    assert ("info", "the workers taken over cannot train on as they are: they are not the plan's group") in kinds
    restart = next(r for k, r in kinds if k == "failure")
    assert "taking over the workers it left running" in restart


def test_workers_taken_over_from_a_storage_job_stay_warm_for_its_resume(tmp_path):
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2, "b": 2}, parallel={"reshard": "storage"})
    group_cls.intact = False
    advance(first, lambda c: c.step_done >= 7)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))

    second = again(first, left_running(group_cls, first.group), cluster, owner="elastron-job-job1")
    advance(second, lambda c: c.state.name.is_terminal)

    rc = second.reconfigs[0]
    assert rc.resumed_step == 5 and rc.steps_lost == 2  # from the last commit...
    assert rc.started == 0 and rc.transfer.path == "storage"  # ...by the processes already running


def test_without_an_owner_a_restart_looks_for_no_workers(tmp_path):
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2})
    advance(first, lambda c: c.step_done >= 7)

    def adopt(self):
        raise AssertionError("adopt called for a coordinator whose workers end with it")
    second = again(first, type("NoAdopt", (group_cls,), {"adopt": adopt}), cluster)
    advance(second, lambda c: c.state.name.is_terminal)
    assert str(second.state.name) == "SUCCEEDED" and second.reconfigs[0].resumed_step == 5


def test_workers_started_before_any_group_formed_are_taken_over_not_left_holding_slots(tmp_path):
    """The coordinator died while its first group was starting: no plan was recorded, but the workers
    it started run on, detached. The next coordinator must make them its own (here: reuse them), or
    they would hold their slots for as long as the job's actor lives."""
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2, "b": 2})
    first._enter(Starting(reason="starting", cause="planned"))  # and then it died
    lost = group_cls(first.cfg, str(tmp_path))
    lost.members = ["a", "a", "b", "b"]

    second = again(first, left_running(group_cls, lost), cluster, owner="elastron-job-job1")
    advance(second, lambda c: c.state.name.is_terminal)

    assert str(second.state.name) == "SUCCEEDED"
    rc = second.reconfigs[0]
    assert rc.started == 0 and rc.stopped == 0 and rc.resumed_step == 0  # the same four, from the start


@pytest.mark.parametrize("intact", [False, True], ids=["heal", "in-place"])
def test_a_heal_from_workers_a_step_ahead_of_the_lost_coordinator_moves_from_their_step(tmp_path, intact):
    """The coordinator died while its workers finished a step it never recorded; their salvage (or, where
    they train on as they are, their answer to `carry_on`) brings that step's metrics back, so the job
    moves on from that step (seen in CI's chaos test as "a live move from step 116 resumed at step 117")."""
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2, "b": 2})
    group_cls.heals, group_cls.intact = True, intact
    advance(first, lambda c: c.step_done >= 7)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))
    first.group.step += 1  # step 8 finished after the coordinator died
    base = left_running(group_cls, first.group)

    def row(self):
        return metrics_row(self.step)

    def salvage(self, **kw):
        got = base.salvage(self, **kw)
        return replace(got, kept={r: replace(s, rows=(row(self),)) for r, s in got.kept.items()})

    def carry_on(self, plan):
        got = base.carry_on(self, plan)
        return replace(got, rows=(row(self),)) if got.step is not None else got

    ahead = type("Ahead", (base,), {"salvage": salvage, "carry_on": carry_on})
    second = again(first, ahead, cluster, owner="elastron-job-job1")
    advance(second, lambda c: c.state.name.is_terminal)
    rc = second.reconfigs[0]
    assert rc.step_before == 8 and rc.resumed_step == 8 and rc.steps_lost == 0
    assert rc.transfer.path == ("in place" if intact else "peers")
    assert second.metrics_since(7)[0] == row(first.group).to_dict()  # step 8, as the workers reported it


def test_a_coordinator_restarted_more_often_than_its_budget_in_the_window_ends_the_job(tmp_path):
    """Ray restarts the coordinator's actor without a lifetime cap that matters (a long job may see many
    restarts over weeks); the job's own budget ends a crash loop: each restart is a failure of kind
    coordinator_restarted, the earlier ones read back from the job's events, and the policy fails the job
    once more than `max_restarts` (here 2) fall within `restart_window_s`."""
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2, "b": 2})
    advance(first, lambda c: c.step_done >= 3)
    c = first
    for n in (1, 2):  # within the budget: each restarted coordinator trains on
        c = again(c, group_cls, cluster)
        assert [f.kind for f in c.failures] == ["coordinator_restarted"] * n
        advance(c, lambda x, s=c.step_done: x.step_done >= max(s, 3) + 1 or x.state.name.is_terminal)
        assert not c.state.name.is_terminal
    third = again(c, group_cls, cluster)
    advance(third, lambda x: x.state.name.is_terminal)
    assert str(third.state.name) == "FAILED"
    assert "coordinator_restarted failed 3 times" in third.state.reason and "max_restarts=2" in third.state.reason
