"""What the KubeRay manifests rely on: with the pinned Ray, SIGTERM to `ray start --block` (what Kubernetes
sends a Ray pod that is evicted: GKE spot shutdown, the AWS Node Termination Handler, a node drain) marks
that node draining in the GCS with reason PREEMPTION and a deadline RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
ahead, which is what the coordinator's ClusterWatcher reads. A Ray upgrade that changes this fails here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

DRAIN_S = 40.0


def test_sigterm_to_ray_start_block_drains_the_node_with_a_deadline(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    from service.pool.cluster import ClusterWatcher

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    proc = None
    log = open(tmp_path / "worker.log", "w")
    try:
        ray.init(address=c.address, log_to_driver=False)
        ray_bin = Path(sys.executable).parent / "ray"
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_S), "RAY_USAGE_STATS_ENABLED": "0"}
        proc = subprocess.Popen(
            [str(ray_bin), "start", "--block", f"--address={c.address}", "--num-cpus=1",
             '--resources={"pod": 1}'],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        @ray.remote(num_cpus=1, resources={"pod": 1})
        class Busy:  # a worker actor: the node is not idle, so the drain waits for its deadline
            def node(self):
                return ray.get_runtime_context().get_node_id()

        busy = Busy.remote()
        node_id = ray.get(busy.node.remote(), timeout=90)
        assert ClusterWatcher().poll().draining() == {}

        sent = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while not (draining := ClusterWatcher().poll().draining()):
            assert proc.poll() is None or time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "no drain within 15 s of SIGTERM"
            time.sleep(0.2)
        assert set(draining) == {node_id}
        assert draining[node_id] == pytest.approx(sent + DRAIN_S, abs=5.0)
        assert proc.poll() is None, "`ray start --block` must wait while its busy node drains"
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()
        ray.shutdown()
        c.shutdown()
