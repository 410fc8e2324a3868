"""WorkerGroup on a local Ray: a start that fails releases what it reserved. (The chaos run found a
failed start leaking its placement groups, so that the next start could not place anything.)"""

from __future__ import annotations

import time

import pytest

from service.worker_group import WorkerFailure, WorkerGroup
from tests.ray_local import local_ray  # noqa: F401  (a fixture)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e


def test_a_failed_start_releases_its_placement_groups_and_cpus(local_ray, tmp_path):
    from ray.util import placement_group_table

    me = ray.get_runtime_context().get_node_id()
    # The worker's constructor rejects this config (a dict, not a JobConfig), so both actors die while starting.
    g = WorkerGroup({"model": {"preset": "no-such-preset"}}, str(tmp_path), cpus_per_worker=1, gpus_per_worker=0,
                    job_id="t", start_timeout_s=60)
    with pytest.raises(WorkerFailure, match="during start"):
        g.scale_to([me, me])
    assert g.size == 0
    states = [pg["state"] for pg in placement_group_table().values()]
    assert states and all(s == "REMOVED" for s in states), states
    deadline = time.monotonic() + 10  # resource release is asynchronous
    while ray.available_resources().get("CPU") != 2.0:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_the_probe_finds_a_node_alive_while_all_its_cpus_are_reserved(local_ray):
    """Right after a failure the node's CPUs may still be held by placement groups being removed; the
    probe must not take that for a dead raylet."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from service.worker_group import probe_nodes

    me = ray.get_runtime_context().get_node_id()
    full = placement_group([{"CPU": 2}], strategy="STRICT_PACK")
    ray.get(full.ready(), timeout=30)
    try:
        assert probe_nodes([me], timeout_s=5) == {me}
    finally:
        remove_placement_group(full)
