"""Tier 3: a job started outside the service (an `elastron run` or `ray job submit` beside it) fills a node
of a real Ray cluster; the service sees that node as taken, so it queues a job that needs it instead of
granting a worker that cannot be placed. The outside job is an actor holding the node's only CPU, as
each worker of an `elastron run` does."""

from __future__ import annotations

import pytest

from service.control.commands import Grant
from service.pool.cluster import ClusterWatcher, resources_in_use
from service.sharing.rounds import JobView, plan_round
from service.sharing.scheduler import JobRequest

pytestmark = pytest.mark.e2e


def test_a_node_filled_by_an_outside_job_is_not_granted():
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [c.add_node(num_cpus=1) for _ in range(2)]
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)

        @ray.remote(num_cpus=1)
        class OutsideWorker:
            def ready(self) -> bool:
                return True

        full = nodes[0].node_id
        outside = OutsideWorker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(full, soft=False)).remote()
        assert ray.get(outside.ready.remote(), timeout=60)
        snap = ClusterWatcher().poll()
        in_use = resources_in_use(snap)
        assert in_use[full] == (1.0, 0.0) and in_use[nodes[1].node_id] == (0.0, 0.0)

        two = JobView(request=JobRequest(job_id="two", min_workers=2, max_workers=2), state="QUEUED")
        (told,) = plan_round(snap, [two], in_use=in_use).actions
        assert isinstance(told.command, Grant) and told.command.nodes == {}  # queued: one worker is free
        assert told.command.queue_position == 1
        one = JobView(request=JobRequest(job_id="one", min_workers=1, max_workers=2), state="QUEUED")
        (told,) = plan_round(snap, [one], in_use=in_use).actions
        assert told.command.nodes == {nodes[1].node_id: 1}  # the free node only
    finally:
        ray.shutdown()
        c.shutdown()
