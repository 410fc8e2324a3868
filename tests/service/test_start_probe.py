"""A node that dies while the group starts workers on it fails the start at the next probe of the nodes
still starting, instead of when Ray's health checks declare the node dead. Seen in the chaos
benchmark's double fault (a worker kill, then its node, 0.3 s apart): killed once its worker's
placement group was placed, the start waited ~15 s for the actor's death (kind "worker_died"); killed before,
the placement group waited out the whole start timeout (kind "start", 63 s to recover). A spare
pre-started there (a growth settling) is awaited the same way: before, the start waited ~15 s for the
spare's death, then started another on the dead node."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from service.pool.group import WorkerFailure
from service.pool.worker_group import WorkerGroup
from workers.config import JobConfig

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e


@contextmanager
def cluster_of(n: int):
    """A fresh Ray cluster (a head without CPUs) with `n` 1-CPU nodes, this process connected: (cluster,
    nodes)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        nodes = [cluster.add_node(num_cpus=1) for _ in range(n)]
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def _kill_once_placed(cluster, node, done: threading.Event) -> None:
    """Kill `node` as soon as a placement group has been placed on it: its worker is starting then."""
    from ray.util import placement_group_table

    from service.pool.cluster import kill_node

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(t.get("state") == "CREATED" and node.node_id in (t.get("bundles_to_node_id") or {}).values()
               for t in placement_group_table().values()):
            kill_node(cluster, node)
            done.set()
            return
        time.sleep(0.02)


@pytest.mark.parametrize("when", ["before placement", "while starting", "spare starting"])
def test_a_node_that_dies_as_its_worker_starts_fails_the_start_at_the_probe(tmp_path, when):
    from service.pool.cluster import kill_node

    with cluster_of(1) as (cluster, (node,)):
        g = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t",
                        start_timeout_s=60, start_probe_s=1.0, probe_timeout_s=1.0)
        killed = threading.Event()
        if when == "spare starting":
            assert g.prewarm([node.node_id]) == 1
        if when in ("before placement", "spare starting"):  # the GCS lists it alive for seconds yet
            kill_node(cluster, node)
            killed.set()
        else:
            threading.Thread(target=_kill_once_placed, args=(cluster, node, killed), daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure) as e:
            g.scale_to([node.node_id])
        took = time.monotonic() - t0
        assert killed.wait(timeout=60)
        assert e.value.kind == "node_lost" and node.node_id[:8] in str(e.value), (e.value.kind, str(e.value), took)
        assert took < 12, took  # the 1 s probe, not Ray's own detection (>= 15 s) nor the start timeout
        assert g.members == [] and g.spares == []


@pytest.mark.parametrize("call", ["form", "leave"])
def test_a_member_node_that_dies_before_a_group_call_fails_it_at_the_probe(tmp_path, call):
    """The chaos double fault with warm survivors: a failure's survivors are kept for the storage
    resume, and one's node dies right after; the re-form's calls on it (leave; the head's free port and
    the ranks' join) waited for Ray to declare the actor dead, 6-9 s later there. They probe the members'
    nodes, so the call fails within seconds whichever notices first: the probe (kind "node_lost"), or Ray,
    which on a quiet box may already know the actor is dead (kind "worker_died", in milliseconds)."""
    from dataclasses import replace

    from parallel.planner import plan
    from service.pool.cluster import kill_node
    from workers.config import job_constraints

    with cluster_of(2) as (cluster, nodes):
        cfg = JobConfig()
        g = WorkerGroup(cfg, str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t",
                        start_timeout_s=60, start_probe_s=1.0, probe_timeout_s=1.0)
        g.scale_to([n.node_id for n in nodes])
        p = plan(2, cfg.model.build(), replace(job_constraints(cfg), min_workers=1, max_workers=2))
        kill_node(cluster, nodes[0])  # the head member's node: the free-port call goes there first
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure) as e:
            g.form(p) if call == "form" else g.leave()
        took = time.monotonic() - t0
        assert (e.value.kind == "node_lost" and nodes[0].node_id[:8] in str(e.value)) or e.value.kind == "worker_died", \
            (e.value.kind, str(e.value), took)
        assert took < 5, took  # at worst the first probe (0.5 s) and its timeout (1 s)
        g.shutdown()


def test_a_draining_node_counts_as_answering_the_probe():
    """Ray places nothing new on a node it drains, so a probe there would time out and the node look dead;
    a live transfer off a draining node probes its members' nodes while it waits and failed that way (a
    preemption notice handled as a failure, seen in tests/service/test_elastic_e2e.py)."""
    from service.pool.cluster import drain_node, kill_node
    from service.pool.placement import probe_nodes

    with cluster_of(1) as (cluster, (node,)):
        @ray.remote(num_cpus=1)
        class Busy:  # keeps the node from exiting as soon as it is drained and idle
            def ping(self) -> bool:
                return True

        busy = Busy.remote()
        assert ray.get(busy.ping.remote(), timeout=60)
        assert probe_nodes([node.node_id], timeout_s=5) == {node.node_id}
        drain_node(node.node_id, message="test: spot reclaim", deadline_remaining_s=60)
        assert probe_nodes([node.node_id], timeout_s=1) == {node.node_id}
        kill_node(cluster, node)  # reclaimed at its deadline: draining still, as far as the GCS knows
        assert probe_nodes([node.node_id], timeout_s=1) == set()  # its raylet refuses connections


def test_waits_probe_early_and_often_then_every_cap():
    from itertools import islice

    from service.pool.calls import probe_gaps

    assert list(islice(probe_gaps(3.0), 6)) == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert list(islice(probe_gaps(0.2), 3)) == [0.2, 0.2, 0.2]  # a cap below the first gap wins


def test_a_node_whose_raylet_is_gone_is_found_dead_without_waiting_out_the_probe(monkeypatch):
    """The GCS lists a killed node alive until its health checks time out (~16 s here), and a placement
    there waits that long or the probe's whole timeout; its raylet's port refuses connections at once, so
    no placement is tried there."""
    import service.pool.placement as placement
    from service.pool.cluster import kill_node

    placed_on: list[str] = []
    real = placement.placement_group

    def spy(bundles, *, strategy, _soft_target_node_id):
        placed_on.append(_soft_target_node_id)
        return real(bundles, strategy=strategy, _soft_target_node_id=_soft_target_node_id)

    monkeypatch.setattr(placement, "placement_group", spy)
    with cluster_of(2) as (cluster, (dead, live)):
        kill_node(cluster, dead)
        assert placement.probe_nodes([dead.node_id, live.node_id], timeout_s=60) == {live.node_id}
        assert placed_on == [live.node_id]
