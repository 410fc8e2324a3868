"""Issue 15 item 8: a restarted coordinator (Ray restarts the job actor) rebuilds the user's intent from
RUN_DIR/commands.jsonl: a paused job stays paused without training, a stopped job stops, a resize holds.
Tier 1: the fake worker group, the job actor's body in this process."""

from __future__ import annotations

import json

from service.control.job import Job
from service.server.job_actor import JobActorBody
from service.server.specs import validate_spec
from tests.api.helpers import SPEC, fake_factory, wait_for
from tests.fakes import FakeCluster, Gate
from service.control.commands import Pause, Resume, SetWorkers, Stop


def runner(tmp_path, cluster, gate, job_id="job1"):
    job = Job.of(validate_spec(SPEC), job_id=job_id, run_dir=tmp_path, steps=20)
    return JobActorBody(job, options={}, coordinator_factory=fake_factory(cluster, gate=gate))


def transitions_after_restart(r) -> list[str]:
    ev = r.events_since(0)
    i = max(i for i, e in enumerate(ev) if e["kind"] == "failure"
            and e["details"].get("kind") == "coordinator_restarted")
    return [e["to_state"] for e in ev[i + 1:] if e["kind"] == "transition"]


def test_a_paused_job_stays_paused_after_its_coordinator_restarts(tmp_path):
    cluster, gate = FakeCluster({"a": 2, "b": 2}), Gate(limit=3)
    first = runner(tmp_path, cluster, gate)
    wait_for(lambda: first.status().step == 3, what="step 3")
    first.send(Pause())
    wait_for(lambda: first.status().state == "PAUSED", what="PAUSED")
    gate.allow(None)
    # The actor's process dies; Ray builds the actor again with the same arguments.
    second = runner(tmp_path, cluster, gate)
    wait_for(lambda: second.status().state == "PAUSED", what="PAUSED after the restart")
    assert transitions_after_restart(second) == ["PAUSED"] and second.status().world_size == 0
    second.send(Resume())
    wait_for(lambda: second.status().state == "SUCCEEDED", what="SUCCEEDED after resume")
    lines = [json.loads(x) for x in (tmp_path / "commands.jsonl").read_text().splitlines()]
    assert [x["command"] for x in lines] == ["pause", "resume"]
    first.coord.send(Stop())
    second.join(10)


def test_a_stopped_job_does_not_start_again_and_a_resize_holds(tmp_path):
    cluster, gate = FakeCluster({"a": 2, "b": 2}), Gate(limit=3)
    first = runner(tmp_path, cluster, gate)
    wait_for(lambda: first.status().step == 3, what="step 3")
    first.send(SetWorkers(workers=2))
    first.send(SetWorkers(min_workers=2))
    first.send(Stop())
    wait_for(lambda: first.status().state == "STOPPED", what="STOPPED")
    second = runner(tmp_path, cluster, gate)
    assert second.join(10)
    st = second.status()
    assert st.state == "STOPPED" and transitions_after_restart(second) == ["STOPPED"]
    assert (st.min_workers, st.max_workers) == (2, 2)


def test_another_jobs_commands_in_the_run_dir_are_not_replayed(tmp_path):
    cluster, gate = FakeCluster({"a": 2}), Gate(limit=None)
    (tmp_path / "commands.jsonl").write_text(json.dumps({"job_id": "other", "command": "stop", "args": {}}) + "\n"
                                             + '{"job_id": "job1", "comm')  # and a torn line
    r = runner(tmp_path, cluster, gate)
    wait_for(lambda: r.status().state == "SUCCEEDED", what="SUCCEEDED")
    st = r.status()
    assert (st.state, st.step) == ("SUCCEEDED", 20)  # the other job's stop was not applied to this one
    assert [e["to_state"] for e in r.events_since(0) if e["kind"] == "transition"] == ["STARTING", "RUNNING",
                                                                                       "SUCCEEDED"]
