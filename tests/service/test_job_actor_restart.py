"""The job's coordinator actor is killed (SIGKILL of its process): Ray restarts it, it resumes the job,
and the job manager keeps showing the job instead of declaring it failed. Fake worker group (no torch
ranks) on one local Ray; the real-worker version is in the chaos suite."""

from __future__ import annotations

import os
import signal

import pytest

from api.store import JobStore
from service.server.job_actor import RayLauncher
from service.server.job_manager import JobManager
from tests.api.helpers import SPEC, fake_factory, wait_for
from tests.fakes import FakeCluster
from tests.ray_local import local_ray  # noqa: F401  (a fixture)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e


def test_a_killed_coordinator_actor_is_restarted_and_finishes_the_job(local_ray, tmp_path):
    launcher = RayLauncher(coordinator_factory=fake_factory(FakeCluster({"a": 2}), step_s=0.03), timeout_s=60)
    mgr = JobManager(JobStore(tmp_path / "jobs.db"), launcher, runs_root=tmp_path / "runs", sync_interval_s=0.1)
    mgr.start()
    try:
        job_id = mgr.submit(SPEC, steps=60)
        first = wait_for(lambda: (j := mgr.get(job_id).status).step >= 8 and j, timeout=90, what="the actor trains")
        os.kill(first.pid, signal.SIGKILL)
        seen = []

        def restarted():
            j = mgr.get(job_id).status
            seen.append(j.state)
            return j.pid not in (None, first.pid) and j
        wait_for(restarted, timeout=90, what="a new coordinator process")
        done = wait_for(lambda: (j := mgr.get(job_id).status).state in ("SUCCEEDED", "FAILED") and j, timeout=90,
                        what="the job ends")
        assert done.state == "SUCCEEDED", done.reason
        assert "FAILED" not in seen  # never declared dead while Ray brought the actor back
        assert done.step == 60 and done.reconfigurations.get("failure") == 1
        kinds = [(e["kind"], e["details"].get("kind")) for e in mgr.events(job_id)]
        assert ("failure", "coordinator_restarted") in kinds
        steps = [m["step"] for m in mgr.metrics(job_id)]
        assert steps == list(range(1, 61))
    finally:
        mgr.close()
