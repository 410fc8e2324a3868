"""Tier 3: jobs sharing a real Ray cluster (`ray.cluster_utils.Cluster`, four 1-CPU nodes) through the job
service (issue 16, D6). Two jobs fill the cluster; a third of higher priority arrives and is admitted by
shrinking them (the planned-resize path: no step redone); it finishes and they grow back. The API (the
job manager) is restarted in the middle. Every job's per-step losses equal one uninterrupted
single-process run (1e-4 relative)."""

from __future__ import annotations

import time

import pytest

from api.store import JobStore
from service.server.job_actor import RayLauncher
from service.server.job_manager import JobManager
from tests.bodies import train_body
from tests.multiproc import run_ranks
from service.control.commands import Stop

pytestmark = pytest.mark.e2e

HORIZON = 400  # train.steps: the LR schedule's horizon; the two long jobs are stopped long before it
SPEC = {
    "model": {"preset": "tiny"},
    "data": {"source": "corpus", "seq_len": 32, "max_bytes": 300_000},
    "train": {"steps": HORIZON, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 2,
              "seed": 7},
    "parallel": {"min_workers": 1, "max_workers": 2},
    "checkpoint": {"interval_steps": 50, "keep_last": 2},
    "resources": {"device": "cpu", "cpus_per_worker": 1},
}
URGENT = {**SPEC, "name": "urgent", "train": {**SPEC["train"], "steps": 6},
          "parallel": {"min_workers": 2, "max_workers": 2}, "scheduling": {"priority": 10}}


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(4):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def manager(tmp_path) -> JobManager:
    launcher = RayLauncher(timeout_s=60, options={"settle_seconds": 1000.0, "chunk_seconds": 0.2,
                                                  "poll_interval_s": 0.2})
    m = JobManager(JobStore(tmp_path / "jobs.db"), launcher, runs_root=tmp_path / "runs", sync_interval_s=0.2,
                   shared=True)
    m.start()
    return m


def wait(fn, what: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not (out := fn()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return out


def told(m: JobManager, job_id: str) -> list[str]:
    return [e["reason"] for e in m.events(job_id) if e["kind"] == "schedule"]


def test_a_higher_priority_job_shrinks_two_running_ones_and_they_grow_back(cluster, tmp_path):
    m = manager(tmp_path)
    try:
        a, b = m.submit({**SPEC, "name": "a"}), m.submit({**SPEC, "name": "b"})
        for j in (a, b):  # the cluster's four workers, two each
            wait(lambda j=j: (x := m.get(j).status).world_size == 2 and x.step >= 3, f"job {j} on 2 workers")

        urgent = m.submit(URGENT)
        # the API goes down while the shrinks are under way, and a new one takes over
        wait(lambda: any(r.startswith("shrunk 2→1") for r in told(m, a)), "the shrink of job a sent")
        m.close()
        m = manager(tmp_path)

        u = wait(lambda: (x := m.get(urgent).status).state == "SUCCEEDED" and x, "the urgent job done")
        assert u.steps_lost == 0 and told(m, urgent)[-1] == "admitted on 2 workers (min 2, priority 10)"
        for j in (a, b):
            wait(lambda j=j: (x := m.get(j).status).world_size == 2 and x.reconfigurations.get("grow"),
                 f"job {j} grown back")
            assert f"shrunk 2→1 to admit job {urgent} (priority 10)" in told(m, j)
            m.command(j, Stop())
        done = {j: wait(lambda j=j: (x := m.get(j).status).state == "STOPPED" and x, f"job {j} stopped") for j in (a, b)}
    finally:
        m.close()

    longest = max(d.step for d in done.values())
    (ref,) = run_ranks(1, train_body, SPEC, "dp=1", longest, return_params=False)
    for j, d in [*done.items(), (urgent, u)]:
        rows = m.metrics(j)
        assert [r["step"] for r in rows] == list(range(1, d.step + 1)), f"job {j}: a step redone or missing"
        assert d.steps_lost == 0
        want = ref["losses"] if j != urgent else run_ranks(1, train_body, URGENT, "dp=1", 6,
                                                           return_params=False)[0]["losses"]
        for r in rows:
            assert abs(r["loss"] - want[r["step"] - 1]) <= 1e-4 * abs(want[r["step"] - 1]), \
                f"job {j} step {r['step']}: loss {r['loss']} vs uninterrupted {want[r['step'] - 1]}"
    for j in (a, b):
        causes = [k for k, n in sorted(done[j].reconfigurations.items()) for _ in range(n)]
        assert causes == ["grow", "planned", "planned"], causes  # the start, the shrink, the growth back
