"""The job manager across API restarts, under concurrent submits, and when a coordinator dies."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from api.store import JobStore
from service.server.job_actor import LocalLauncher
from service.server.job_manager import JobManager
from service.server.specs import SpecError
from tests.api.helpers import SPEC, fake_factory, make_app, make_launcher, stop_all, wait_for
from tests.fakes import FakeCluster, Gate

J = "/api/v1/jobs"


def job(c, job_id):
    return c.get(f"{J}/{job_id}").json()


def test_restarting_the_api_in_the_middle_of_a_job_loses_nothing(tmp_path):
    gate = Gate(limit=6)
    launcher, _ = make_launcher(gate=gate)
    db = tmp_path / "jobs.db"
    with TestClient(make_app(tmp_path, launcher, db=db)) as c:
        job_id = c.post(J, json={"spec": SPEC, "steps": 12}).json()["id"]
        wait_for(lambda: job(c, job_id)["step"] == 6, what="step 6")
        events_before = c.get(f"{J}/{job_id}/events").json()
        metrics_before = c.get(f"{J}/{job_id}/metrics").json()
    assert [m["step"] for m in metrics_before] == list(range(1, 7))

    # The API is down; the coordinator is not.
    gate.allow(9)
    wait_for(lambda: launcher.attach(job_id).status().step == 9, what="step 9 with no API")
    with TestClient(make_app(tmp_path, launcher, db=db)) as c:  # a new app, manager and store object
        j = job(c, job_id)
        assert j["state"] == "RUNNING" and j["step"] == 9 and j["world_size"] == 4
        events = c.get(f"{J}/{job_id}/events").json()
        assert events[:len(events_before)] == events_before
        assert [m["step"] for m in c.get(f"{J}/{job_id}/metrics").json()] == list(range(1, 10))
        # Commands reach the re-attached coordinator.
        assert c.post(f"{J}/{job_id}/resize", json={"workers": 2}).status_code == 202
        wait_for(lambda: job(c, job_id)["world_size"] == 2, what="resized after the restart")
        gate.allow(None)
        j = wait_for(lambda: (x := job(c, job_id))["state"] == "SUCCEEDED" and x, what="SUCCEEDED")
        assert j["step"] == 12 and j["reconfigurations"] == {"planned": 1, "user": 1} and j["steps_lost"] == 0
        assert [m["step"] for m in c.get(f"{J}/{job_id}/metrics").json()] == list(range(1, 13))
        file_events = [json.loads(x) for x in open(f"{j['run_dir']}/events.jsonl")]
        assert c.get(f"{J}/{job_id}/events").json() == file_events
    assert launcher.attach(job_id) is None  # released once its final state was stored


def test_jobs_that_ended_while_the_api_was_down_show_their_final_state(tmp_path):
    gate = Gate(limit=2)
    launcher, _ = make_launcher(gate=gate)
    db = tmp_path / "jobs.db"
    with TestClient(make_app(tmp_path, launcher, db=db)) as c:
        done = c.post(J, json={"spec": SPEC, "steps": 3}).json()["id"]
        stuck = c.post(J, json={"spec": SPEC, "steps": 10}).json()["id"]
        paused = c.post(J, json={"spec": SPEC, "steps": 10}).json()["id"]
        for j in (done, stuck, paused):
            wait_for(lambda: job(c, j)["step"] == 2, what=f"{j} at step 2")
        c.post(f"{J}/{paused}/pause")
        wait_for(lambda: job(c, paused)["state"] == "PAUSED", what="PAUSED")

    gate.allow(3)  # `done` finishes while no API runs; `stuck` reaches step 3 and waits
    wait_for(lambda: str(launcher.attach(done).status().state) == "SUCCEEDED", what="done finishes")
    wait_for(lambda: launcher.attach(stuck).status().step == 3, what="stuck at 3")

    # Same launcher: the finished coordinator still holds its final state.
    with TestClient(make_app(tmp_path, launcher, db=db)) as c:
        j = job(c, done)
        assert j["state"] == "SUCCEEDED" and j["step"] == 3 and j["reason"] == "reached step 3"
        assert [m["step"] for m in c.get(f"{J}/{done}/metrics").json()] == [1, 2, 3]
        assert job(c, stuck)["state"] == "RUNNING" and job(c, paused)["state"] == "PAUSED"
    assert launcher.attach(done) is None

    # A launcher that has no coordinators at all (e.g. the Ray cluster was restarted): the run
    # directory's events.jsonl tells how each job ended.
    with TestClient(make_app(tmp_path, LocalLauncher(), db=db)) as c:
        assert job(c, done)["state"] == "SUCCEEDED"
        j = job(c, stuck)
        assert j["state"] == "FAILED" and j["world_size"] == 0
        assert "coordinator is gone" in j["reason"] and "last recorded state RUNNING at step" in j["reason"]
        assert [e["to_state"] for e in c.get(f"{J}/{stuck}/events").json() if e["kind"] == "transition"] == [
            "STARTING", "RUNNING"]
        assert "last recorded state PAUSED" in job(c, paused)["reason"]
        assert c.post(f"{J}/{stuck}/stop").status_code == 409
    stop_all(launcher)


def test_a_job_whose_coordinator_ended_before_the_store_knew_is_read_from_events_jsonl(tmp_path):
    launcher, _ = make_launcher()
    store = JobStore(tmp_path / "jobs.db")
    mgr = JobManager(store, launcher, runs_root=tmp_path / "runs")
    job_id = mgr.submit(SPEC, steps=4)  # not started: no sync thread (and reads never sync)
    assert launcher.attach(job_id).join(20)
    launcher._runners.clear()  # the coordinator is gone before anyone synced it
    assert mgr.get(job_id).state == "PENDING"  # reads are served from the store
    mgr.sync(job_id)
    j = mgr.get(job_id).status
    assert j.state == "SUCCEEDED" and j.step == 4
    assert [e["to_state"] for e in mgr.events(job_id) if e["kind"] == "transition"][-1] == "SUCCEEDED"


def test_fifty_concurrent_submits_are_all_recorded_with_unique_ids(tmp_path):
    launcher, _ = make_launcher(nodes={})  # no capacity: every job waits, cheaply
    app = make_app(tmp_path, launcher)

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await asyncio.gather(*[
                c.post(J, json={"spec": {**SPEC, "name": f"job{i}"}}) for i in range(50)])

    try:
        responses = asyncio.run(burst())
        assert [r.status_code for r in responses] == [201] * 50
        ids = [r.json()["id"] for r in responses]
        assert len(set(ids)) == 50
        with TestClient(app) as c:
            listed = c.get(J).json()
            assert sorted(j["id"] for j in listed) == sorted(ids)
            assert sorted(j["name"] for j in listed) == sorted(f"job{i}" for i in range(50))
            assert len({j["run_dir"] for j in listed}) == 50
            j = wait_for(lambda: (x := job(c, ids[-1]))["state"] == "WAITING_FOR_CAPACITY" and x, what="waiting")
            assert "worker" in j["reason"]
    finally:
        stop_all(launcher)


class Boom(Exception):
    pass


def test_a_crashed_coordinator_is_reported_failed_with_the_error(tmp_path):
    cluster = FakeCluster({"a": 2})
    base = fake_factory(cluster)

    def factory(*a, **kw):
        c = base(*a, **kw)
        c.worker_group_cls.run = lambda self, **kw: (_ for _ in ()).throw(Boom("kaput"))
        return c

    launcher = LocalLauncher(coordinator_factory=factory)
    with TestClient(make_app(tmp_path, launcher)) as c:
        job_id = c.post(J, json={"spec": SPEC}).json()["id"]
        j = wait_for(lambda: (x := job(c, job_id))["state"] == "FAILED" and x, what="FAILED")
        assert "coordinator crashed: Boom: kaput" in j["reason"]
        assert any(e["kind"] == "failure" and "kaput" in e["reason"] for e in c.get(f"{J}/{job_id}/events").json())
    stop_all(launcher)


def test_a_launch_failure_is_recorded_not_lost(tmp_path):
    class Broken(LocalLauncher):
        def launch(self, *a, **kw):
            raise RuntimeError("no Ray here")

    with TestClient(make_app(tmp_path, Broken())) as c:
        r = c.post(J, json={"spec": SPEC})
        assert r.status_code == 201
        j = job(c, r.json()["id"])
        assert j["state"] == "FAILED" and j["reason"] == "could not start the coordinator: no Ray here"


@pytest.mark.parametrize("spec,loc", [
    ({"train": {"steps": 0}}, ("train", "steps")),
    ({"bogus": 1}, ("bogus",)),
    ({"data": {"x": 1}}, ("data", "x")),
    ({"data": {"suffixes": [".txt", 3]}}, ("data", "suffixes", 1)),
    ({"parallel": {"min_workers": 3, "max_workers": 2}}, ("parallel", "min_workers")),
    ({"model": {"preset": "giant"}}, ("model", "preset")),
    ({"model": {"preset": "tiny", "overrides": {"dim": 130}}}, ("model", "overrides")),
    ({"model": {"preset": "tiny", "overrides": {"vocab_size": 64}}, "data": {"source": "corpus"}},
     ("model", "overrides", "vocab_size")),
])
def test_config_errors_carry_the_field_path(spec, loc):
    """Each check says where it is, as a path (ConfigError.loc): no message is parsed for it."""
    from service.server.specs import validate_spec

    with pytest.raises(SpecError) as e:
        validate_spec(spec)
    assert e.value.loc == ("spec", *loc), e.value.msg


def test_spec_errors_name_request_fields():
    from service.server.specs import validate_spec

    with pytest.raises(SpecError) as e:
        validate_spec(SPEC, workers=0)
    assert e.value.loc == ("workers",)
    with pytest.raises(SpecError) as e:
        validate_spec({**SPEC, "parallel": {"max_workers": 10**9}})
    assert e.value.loc == ("spec", "parallel", "max_workers") and "is more than Elastron accepts (at most 100000)" in e.value.msg


def test_spec_layout_check_is_the_planners_and_stays_fast_at_the_servers_limits():
    """The submit-time check calls plan(): with every size at the largest value the server accepts
    (the spec schema's maxima), planning stays cheap; past them, the request is refused before anything plans."""
    from service.server.specs import MAX_WORKERS, validate_spec
    from workers.config import spec_maxima

    dims = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len")
    at_limit = {"preset": "tiny", "overrides": {k: spec_maxima()["model", "overrides", k] for k in dims}}
    t0 = time.perf_counter()
    cfg = validate_spec({**SPEC, "model": at_limit, "train": {"global_batch_size": 720720 * 16,
                                                             "micro_batch_size": 1}}, workers=MAX_WORKERS)
    assert cfg.model.build().n_heads == 1024
    with pytest.raises(SpecError) as e:
        validate_spec({**SPEC, "model": at_limit, "parallel": {"max_workers": MAX_WORKERS, "memory_budget_gb": 1e-9}})
    assert e.value.loc == ("spec", "parallel", "max_workers") and "no parallel layout can run this job" in e.value.msg
    with pytest.raises(SpecError) as e:
        validate_spec({**SPEC, "train": {"global_batch_size": 2**60, "micro_batch_size": 2**60},
                       "parallel": {"layout": "dp=1"}})
    assert e.value.loc == ("spec", "train", "global_batch_size")
    with pytest.raises(SpecError) as e:
        validate_spec({**SPEC, "parallel": {"layout": f"dp={2**40}", "max_workers": 4}})
    assert e.value.loc == ("spec", "parallel", "layout") and str(MAX_WORKERS) in e.value.msg
    assert time.perf_counter() - t0 < 5.0  # ~0.03 s
