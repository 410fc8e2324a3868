"""A coordinator that dies and is started again (Ray restarts its actor) continues the same job: it
keeps the job's event history, records the restart as a failure with the steps it costs, and resumes
from the last committed checkpoint. Tier 1: the fake worker group of tests/fakes.py, no Ray."""

from __future__ import annotations

import json

from service.coordinator import Coordinator, CoordinatorOptions
from tests.fakes import advance, make_coordinator


def again(first: Coordinator, group_cls, cluster, *, job_id: str = "job1") -> Coordinator:
    """A new coordinator for the same run directory, as Ray's actor restart builds it."""
    c = Coordinator(first.cfg, run_dir=first.run_dir, job_id=job_id, watcher=cluster.watcher(),
                    options=CoordinatorOptions(settle_seconds=0.0, max_restarts=2))
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
    advance(second, lambda c: c.sm.state.is_terminal)

    assert str(second.sm.state) == "SUCCEEDED" and second.step_done == 20
    events = second.events_since(0)
    assert events[:len(before)] == before  # history continues, same indexes
    restart = events[len(before)]
    assert restart["kind"] == "failure" and restart["details"]["kind"] == "coordinator_restart"
    assert restart["step"] == 8 and "resuming from the last committed checkpoint" in restart["reason"]
    rc = second.reconfigs[0]
    assert rc.cause == "failure" and rc.step_before == 8 and rc.resumed_step == committed
    assert rc.steps_lost == 8 - committed and rc.old_layout == first.plan.layout.to_dict()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == events


def test_another_jobs_events_in_the_run_dir_are_not_adopted(tmp_path):
    first, cluster, group_cls = make_coordinator(tmp_path, {"a": 2})
    advance(first, lambda c: c.sm.state.is_terminal)
    group_cls.disk.committed = 0
    other = again(first, group_cls, cluster, job_id="job2")
    assert other.events_since(0) == [] and other.failures == []
    advance(other, lambda c: c.sm.state.is_terminal)
    assert str(other.sm.state) == "SUCCEEDED" and other.reconfigs[0].cause == "planned"
    assert {e["job_id"] for e in other.events_since(0)} == {"job2"}
