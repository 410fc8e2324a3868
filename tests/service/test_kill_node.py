"""service.pool.cluster.kill_node, the simulated machine death of the demo and the chaos benchmark: the node's
raylet goes with its agents.

`Cluster.remove_node` alone kills the raylet and returns while the node's agents still run; they then
publish the raylet's log tail to every driver as an error (two 20-line state dumps in the demo's
output). This checks kill_node leaves none of the node's processes running when it returns.
"""

from __future__ import annotations

import pytest

from service.pool.cluster import kill_node, process_running


def test_a_vanished_node_takes_its_agents_with_it():
    pytest.importorskip("ray")
    import psutil
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        node = cluster.add_node(num_cpus=1)
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        procs = [raylet, *raylet.children(recursive=True)]
        assert len(procs) >= 2, f"expected the raylet and its agents, found {[p.name() for p in procs]}"
        kill_node(cluster, node)
        assert [p.name() for p in procs if process_running(p)] == []
        assert node not in cluster.worker_nodes  # and Ray's bookkeeping forgot it
    finally:
        cluster.shutdown()
