"""Cluster watcher tests.

Tier 1 (unmarked): snapshot building and change detection from fake `ray.nodes()` rows.
Tier 3 (`e2e`): a real `ray.cluster_utils.Cluster` (head 1 CPU + 2 nodes x 2 CPUs) in which nodes are
added, drained with a preemption notice and removed. Conditions are polled against a deadline.
"""

from __future__ import annotations

import threading
import time

import pytest

from service.pool.cluster import ClusterSnapshot, ClusterWatcher, NodeInfo, drain_node, snapshot_from

HEAD_RES = {"CPU": 1.0, "memory": 1e9, "node:__internal_head__": 1.0}


def row(node_id: str, cpus: float = 2.0, gpus: float = 0.0, alive: bool = True, head: bool = False, death=0):
    res = {"CPU": cpus, "memory": 1e9} | ({"GPU": gpus} if gpus else {}) | (HEAD_RES if head else {})
    return {"NodeID": node_id, "Alive": alive, "Resources": res if alive else {}, "DeathReason": death}


class FakeRay:
    """Stands in for ray.nodes() and get_draining_nodes(); tests mutate `rows` and `drains`."""

    def __init__(self):
        self.rows = [row("h", cpus=1.0, head=True), row("a"), row("b")]
        self.drains: dict[str, int] = {}

    def watcher(self, **kw) -> ClusterWatcher:
        return ClusterWatcher(nodes_fn=lambda: list(self.rows), draining_fn=lambda: dict(self.drains),
                              clock=lambda: 123.0, **kw)


# -- tier 1 ---------------------------------------------------------------------------------------------
def test_snapshot_from_rows():
    rows = [row("b"), row("h", cpus=1.0, head=True), row("d", alive=False, death=3), row("c", gpus=4, cpus=16)]
    snap = snapshot_from(rows, {"b": 1_700_000_030_500, "d": 1_700_000_000_000, "c": 0}, now=9.0)
    assert [n.node_id for n in snap.nodes] == ["b", "c", "d", "h"]  # sorted, immutable tuple
    assert snap.node("b") == NodeInfo(node_id="b", alive=True, cpus=2.0, draining=True, drain_deadline=1_700_000_030.5)
    assert snap.node("c").draining and snap.node("c").drain_deadline is None  # 0 ms = no deadline
    assert snap.node("d") == NodeInfo(node_id="d", alive=False, death_reason="AUTOSCALER_DRAIN_PREEMPTED")
    assert snap.node("h").is_head and not snap.node("b").is_head
    assert snap.draining() == {"b": 1_700_000_030.5, "c": None}  # a dead node is not "draining"
    assert [n.node_id for n in snap.alive()] == ["b", "c", "h"]
    assert snap.time == 9.0 and snap.node("zz") is None


def test_usable_workers_counts_alive_non_draining_nodes_by_total_resources():
    rows = [row("h", cpus=1.0, head=True), row("a", cpus=2.0), row("b", cpus=2.0), row("c", cpus=3.0),
            row("g", cpus=8.0, gpus=2.0), row("x", cpus=64.0, alive=False)]
    snap = snapshot_from(rows, {"b": 0}, now=0.0)
    assert snap.usable_workers(1) == 1 + 2 + 3 + 8
    assert snap.usable_workers(1, include_head=False) == 2 + 3 + 8
    assert snap.usable_workers(2) == 0 + 1 + 1 + 4
    assert snap.usable_workers(0.5) == 2 + 4 + 6 + 16
    assert snap.usable_workers(1, 1) == 2  # only the GPU node, limited by its 2 GPUs
    assert snap.usable_workers(0, 1) == 2
    assert snap.usable_workers(3, 1) == 2  # 8 CPUs / 3 = 2, 2 GPUs / 1 = 2
    assert snapshot_from([row("f", cpus=0.3 * 10)], {}, 0.0).usable_workers(0.3) == 10  # float-safe floor
    with pytest.raises(ValueError, match="both per-worker needs are 0"):
        snap.usable_workers(0, 0)
    with pytest.raises(ValueError, match="cpus_per_worker"):
        snap.usable_workers(-1)


def test_duplicate_rows_prefer_the_alive_one():
    snap = snapshot_from([row("a"), row("a", alive=False, death=2)], {}, 0.0)
    assert len(snap.nodes) == 1 and snap.node("a").alive


def test_poll_sets_changed_and_calls_back_only_on_membership_change():
    fake, calls = FakeRay(), []
    w = fake.watcher(on_change=[lambda old, new: calls.append((old, new))])
    assert w.latest is None
    first = w.poll()
    assert w.changed and w.latest is first and calls == [(None, first)]
    assert first.usable_workers(1) == 5
    w.poll()
    assert not w.changed and len(calls) == 1, "an unchanged cluster must not call back"

    fake.rows[1] = row("a", alive=False, death=2)  # Ray marked node a dead
    snap = w.poll()
    assert w.changed and snap.usable_workers(1) == 3, "a dead node leaves capacity on the first poll"
    assert snap.node("a").death_reason == "UNEXPECTED_TERMINATION" and len(calls) == 2

    fake.drains["b"] = 1_700_000_000_000
    snap = w.poll()
    assert w.changed and snap.usable_workers(1) == 1 and snap.draining() == {"b": 1_700_000_000.0}
    assert calls[-1] == (calls[-2][1], snap)


def test_failing_callback_does_not_break_polling(caplog):
    fake, seen = FakeRay(), []

    def boom(old, new):
        raise RuntimeError("callback bug")

    w = fake.watcher(on_change=[boom, lambda old, new: seen.append(new)])
    w.poll()
    assert len(seen) == 1 and "callback bug" in caplog.text


def test_background_thread_polls_and_stops():
    fake = FakeRay()
    state = {"polls": 0}
    grew = threading.Event()

    def nodes():
        state["polls"] += 1
        if state["polls"] == 2:
            raise ConnectionError("GCS restarting")  # the loop must survive a failed poll
        return list(fake.rows)

    w = ClusterWatcher(interval_s=0.01, nodes_fn=nodes, draining_fn=dict,
                       on_change=[lambda old, new: len(new.nodes) == 4 and grew.set()])
    w.start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            w.start()
        fake.rows = fake.rows + [row("c")]
        assert grew.wait(5.0), "the thread never reported the added node"
        assert w.running
    finally:
        w.stop()
    assert not w.running and state["polls"] >= 3
    assert w.latest.usable_workers(1) == 7


def test_watcher_rejects_bad_interval():
    with pytest.raises(ValueError, match="interval_s"):
        ClusterWatcher(interval_s=0)


# -- tier 3: a real Ray cluster -------------------------------------------------------------------------
def _until(watcher: ClusterWatcher, pred, timeout: float = 2.0) -> tuple[ClusterSnapshot, float]:
    """Poll until pred(snapshot) holds; returns (snapshot, seconds taken) or fails with the last view."""
    start = time.monotonic()
    while True:
        snap = watcher.poll()
        if pred(snap):
            return snap, time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"condition not met within {timeout} s; last snapshot: {snap}")
        time.sleep(0.05)  # poll interval, not a wait for the outcome


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)  # this cluster, never a stale /tmp/ray session
        yield cluster, workers
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.e2e
def test_e2e_snapshot_counts(ray_cluster):
    cluster, workers = ray_cluster
    w = ClusterWatcher()
    snap, _ = _until(w, lambda s: len(s.alive()) >= 3)
    base = {n.node_id for n in snap.alive()}
    assert {n.node_id for n in workers} <= base
    heads = [n for n in snap.alive() if n.is_head]
    assert len(heads) == 1 and heads[0].cpus == 1.0
    assert snap.usable_workers(1) == 5 and snap.usable_workers(1, include_head=False) == 4
    assert snap.usable_workers(2) == 2 and snap.draining() == {}


@pytest.mark.e2e
def test_e2e_added_node_seen_within_2s_by_the_thread(ray_cluster):
    cluster, _ = ray_cluster
    w = ClusterWatcher(interval_s=0.2)
    first = w.poll()
    old_ids = {n.node_id for n in first.alive()}
    arrivals: list[tuple[float, ClusterSnapshot]] = []
    arrived = threading.Event()

    def on_change(old, new):
        if {n.node_id for n in new.alive()} - old_ids:
            arrivals.append((time.monotonic(), new))
            arrived.set()

    w.add_callback(on_change)
    w.start()
    node = None
    try:
        t_call = time.monotonic()
        node = cluster.add_node(num_cpus=2)  # returns once the raylet has registered with GCS
        t_added = time.monotonic()
        assert arrived.wait(2.0), "added node not seen within 2 s"
        t_seen, snap = arrivals[0]
        assert {n.node_id for n in snap.alive()} - old_ids == {node.node_id}
        assert snap.usable_workers(1) == first.usable_workers(1) + 2
        assert t_seen - t_added <= 2.0
        print(f"added node seen {t_seen - t_added:+.2f} s after add_node returned "
              f"({t_seen - t_call:.2f} s after it was called)")
    finally:
        w.stop()
        if node is not None:
            cluster.remove_node(node)


@pytest.mark.e2e
def test_e2e_drain_notice_marks_node_draining_and_unusable(ray_cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cluster, _ = ray_cluster
    node = cluster.add_node(num_cpus=2)
    w = ClusterWatcher()
    before = _until(w, lambda s: s.node(node.node_id) is not None and s.node(node.node_id).alive)[0]

    # An idle node that accepts a drain exits at once; a worker on it keeps it alive while draining,
    # as a training worker would.
    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self):
            return "ok"

    holder = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
    assert ray.get(holder.ping.remote(), timeout=30) == "ok"
    try:
        t_req = time.time()
        drain_node(node.node_id, message="spot instance reclaimed", deadline_remaining_s=30)
        snap, took = _until(w, lambda s: node.node_id in s.draining())
        info = snap.node(node.node_id)
        assert info.alive and info.draining
        assert t_req + 29 <= info.drain_deadline <= time.time() + 31, info
        assert snap.usable_workers(1) == before.usable_workers(1) - 2
        print(f"drain seen after {took:.3f} s")

        ray.kill(holder)  # the drained node is now idle and leaves by itself: a preemption, per Ray
        snap, _ = _until(w, lambda s: not s.node(node.node_id).alive, timeout=10.0)
        assert snap.node(node.node_id).death_reason == "AUTOSCALER_DRAIN_PREEMPTED"
        assert node.node_id not in snap.draining() and snap.usable_workers(1) == before.usable_workers(1) - 2
    finally:
        cluster.remove_node(node)  # already gone by itself; this reaps its processes


@pytest.mark.e2e
def test_e2e_removed_node_leaves_within_2s(ray_cluster):
    cluster, _ = ray_cluster
    node = cluster.add_node(num_cpus=2)
    w = ClusterWatcher()
    before = _until(w, lambda s: s.node(node.node_id) is not None and s.node(node.node_id).alive)[0]
    cluster.remove_node(node)
    snap, took = _until(w, lambda s: not s.node(node.node_id).alive, timeout=2.0)
    assert snap.usable_workers(1) == before.usable_workers(1) - 2 and not w.latest.node(node.node_id).alive
    print(f"removed node gone after {took:.3f} s")
