"""NodeHealth.sweep: nodes the GCS lists alive whose raylet refuses connections are left out of plans.
Seen in a chaos run: a node removed without notice, then a coordinator kill; the restarted coordinator
(no suspects of its own) planned its next start onto the dead node, which the GCS still listed, and that
start failed at its probe (+4 s)."""

from __future__ import annotations

from service.pool.cluster import ClusterSnapshot, NodeInfo, snapshot_from
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


class CountedId(str):
    """A node id that counts the comparisons made with it."""

    compared = 0

    def __eq__(self, other):
        CountedId.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_which_of_a_groups_nodes_are_gone_is_one_lookup_per_node_not_a_scan_of_the_cluster_each():
    ids = [CountedId(f"node{i:04d}") for i in range(512)]
    snap = snapshot_from([{"NodeID": i, "Alive": str(i) != "node0000", "Resources": {"CPU": 8.0}} for i in ids],
                         {}, now=0.0)
    h = NodeHealth(None, probe_timeout_s=1.0, suspect_seconds=60.0, reprobe_interval_s=1.0)
    h.suspect({"node0001"})
    CountedId.compared = 0

    gone = NodeHealth.gone(snap, [CountedId(str(i)) for i in ids])
    usable = h.usable_nodes(snap)

    assert gone == {"node0000"} and len(usable) == 510
    # a lookup per node asked about (512), plus the suspect's; a scan of the cluster per node made 131,000
    assert CountedId.compared <= 2 * len(ids)
