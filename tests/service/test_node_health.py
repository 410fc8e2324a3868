"""NodeHealth.sweep: nodes the GCS lists alive whose raylet refuses connections are left out of plans.
Seen in a chaos run: a node removed without notice, then a coordinator kill; the restarted coordinator
(no suspects of its own) planned its next start onto the dead node, which the GCS still listed, and that
start failed at its probe (+4 s)."""

from __future__ import annotations

from service.pool.cluster import ClusterSnapshot, NodeInfo
from service.pool.node_health import NodeHealth


def health(refused) -> NodeHealth:
    return NodeHealth(None, probe_timeout_s=1.0, suspect_seconds=60.0, reprobe_interval_s=3.0, refused=refused)


SNAP = ClusterSnapshot(time=0.0, nodes=(NodeInfo(node_id="a", alive=True, cpus=2), NodeInfo(node_id="b", alive=True, cpus=2),
                             NodeInfo(node_id="c", alive=False)))


def test_a_node_whose_raylet_refuses_is_a_suspect_and_out_of_plans():
    asked = []

    def refused(ids):
        asked.append(sorted(ids))
        return {"b"}

    h = health(refused)
    assert h.sweep(SNAP) == {"b"}
    assert asked == [["a", "b"]]  # only nodes the watcher lists alive
    assert [n.node_id for n in h.usable_nodes(SNAP)] == ["a"]
    h.sweep(SNAP)
    assert asked[-1] == ["a"]  # a suspect is not swept again


def test_a_sweep_that_cannot_ask_changes_nothing():
    def broken(ids):
        raise RuntimeError("GCS unavailable")

    h = health(broken)
    assert h.sweep(SNAP) == set() and [n.node_id for n in h.usable_nodes(SNAP)] == ["a", "b"]
    assert health(None).sweep(SNAP) == set() and health(lambda ids: {"a"}).sweep(None) == set()
