"""The coordinator as a named detached Ray actor: found again by name by a new job manager (an API
restart), commanded through it, released when finished; a killed actor's job ends FAILED with the
state its events.jsonl last recorded. The fake worker group keeps it to one local Ray and no torch ranks."""

from __future__ import annotations

import pytest

from api.store import JobStore
from service.server.job_actor import NAMESPACE, RayLauncher, actor_name
from service.server.job_manager import JobManager
from tests.api.helpers import SPEC, fake_factory, wait_for
from tests.fakes import FakeCluster
from tests.ray_local import local_ray  # noqa: F401  (a fixture)
from service.control.commands import SetWorkers

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e


def manager(tmp_path) -> JobManager:
    # The actor's coordinator runs the fake group over a fixed fake cluster, 0.03 s a step.
    launcher = RayLauncher(coordinator_factory=fake_factory(FakeCluster({"a": 2, "b": 2}), step_s=0.03),
                           timeout_s=60)
    return JobManager(JobStore(tmp_path / "jobs.db"), launcher, runs_root=tmp_path / "runs", sync_interval_s=0.1)


def test_a_detached_job_actor_survives_its_manager_and_is_found_by_name(local_ray, tmp_path):
    first = manager(tmp_path)
    first.start()
    job_id = first.submit(SPEC, steps=40)
    wait_for(lambda: first.get(job_id).status.step >= 3, timeout=90, what="the actor trains")
    first.close()
    actor = ray.get_actor(actor_name(job_id), namespace=NAMESPACE)
    assert ray.get(actor.ping.remote()) == job_id

    second = manager(tmp_path)  # a restarted API: new store object, new launcher, same names
    second.start()
    try:
        step = second.get(job_id).status.step
        assert second.get(job_id).state == "RUNNING" and step >= 3
        second.command(job_id, SetWorkers(workers=2))
        j = wait_for(lambda: (x := second.get(job_id).status).degrees["dp"] == 2 and x, timeout=30, what="resized")
        assert j.world_size == 2
        j = wait_for(lambda: (x := second.get(job_id).status).state == "SUCCEEDED" and x, timeout=60, what="done")
        assert [m["step"] for m in second.metrics(job_id)] == list(range(1, 41))
        assert j.reconfigurations == {"planned": 1, "user": 1} and j.steps_lost == 0
        def released() -> bool:  # once its final state was stored (the sync thread stores, then releases)
            try:
                ray.get_actor(actor_name(job_id), namespace=NAMESPACE)
                return False
            except ValueError:
                return True
        wait_for(released, timeout=30, what="the finished job's actor released")

        doomed = second.submit(SPEC, steps=10_000)
        wait_for(lambda: second.get(doomed).status.step >= 2, timeout=90, what="second job trains")
        ray.kill(ray.get_actor(actor_name(doomed), namespace=NAMESPACE), no_restart=True)
        j = wait_for(lambda: (x := second.get(doomed).status).state == "FAILED" and x, timeout=30, what="FAILED")
        assert "coordinator is gone" in j.reason and "last recorded state RUNNING" in j.reason
    finally:
        second.close()
