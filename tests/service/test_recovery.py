"""Recovery on its own (service.control.recovery), over a fake group and no coordinator: the state it
returns after a failure (and what it leaves of the group) is its whole outcome."""

from __future__ import annotations

from service.control.source import Heal, Memory
from service.control.states import Recovering
from service.pool.group import FailureKind, WorkerFailure
from tests.fakes import make_parts

# FSDP over 4 workers on nodes a (ranks 0, 1) and b (ranks 2, 3): each rank's peer snapshot lives on the
# other node (0 <-> 2, 1 <-> 3); snapshot 6 is complete everywhere.
SNAPS = {0: {0: (5, 6), 2: (5, 6)}, 1: {1: (5, 6), 3: (5, 6)}}


def test_a_worker_death_in_training_with_replicas_surviving_recovers_to_heal_from_them(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, parallel={"dp_mode": "replicate"})
    parts.group_cls.heals = True
    g, p = parts.holding(4, ["a", "a", "b", "b"], step=7)
    parts.cluster.dead.add("b")  # the watcher has not seen it: the probe beside the salvage finds it

    out = parts.recovery.recover(WorkerFailure(FailureKind.WORKER_DIED, "a worker died"), g, p)

    assert out == Recovering(reason="a worker died", cause="failure", group=g, failed_plan=p,
                             survivors=Heal(old=p, ranks=(0, 1)), record=out.record)
    assert out.record.cause == "failure" and out.record.step_before == 7
    assert out.record.old_layout == p.layout
    assert [f.kind for f in parts.failures] == [FailureKind.NODE_LOST]  # a worker death on a dead node
    assert g.members == ["a", "a"] and parts.progress.step_done == 7
    (note,) = parts.notes("failure")
    assert note.details["unresponsive_nodes"] == ["b"] and note.details["during"] == "training"


def test_lost_fsdp_shards_recover_to_form_the_next_group_from_the_survivors_peer_snapshots(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, parallel={"dp_mode": "shard"})
    parts.group_cls.heals, parts.group_cls.snapshots = True, SNAPS
    g, p = parts.holding(4, ["a", "a", "b", "b"], step=7)
    parts.cluster.dead.add("b")

    out = parts.recovery.recover(WorkerFailure(FailureKind.NODE_LOST, "node b is gone"), g, p)

    assert out.survivors == Memory(old=p, step=6, serve=((0, 0), (1, 1), (2, 0), (3, 1)))
    assert out.group.members == ["a", "a"] and not parts.notes("fallback")


def test_a_rank_lost_with_the_buddy_of_its_copy_recovers_from_storage_keeping_the_survivors_warm(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, parallel={"dp_mode": "shard"})
    parts.group_cls.heals, parts.group_cls.snapshots = True, {0: {0: (5, 6), 2: (5, 6)}, 1: {1: (5, 6)}}
    g, p = parts.holding(4, ["a", "a", "b", "b"], step=7)
    parts.cluster.dead.add("b")

    out = parts.recovery.recover(WorkerFailure(FailureKind.NODE_LOST, "node b is gone"), g, p)

    assert isinstance(out, Recovering) and out.survivors is None  # the next group loads the checkpoint
    assert out.group.members == ["a", "a"]  # kept as warm processes for that re-form
    (fallback,) = parts.notes("fallback")
    assert "no survivor holds a copy of old rank(s) [3]" in fallback.reason


def test_a_job_that_reshards_through_storage_asks_no_survivor_and_stops_the_members(tmp_path):
    parts = make_parts(tmp_path, {"a": 2, "b": 2}, parallel={"dp_mode": "replicate", "reshard": "storage"})
    parts.group_cls.heals = True
    g, p = parts.holding(2, ["a", "b"], step=7)

    out = parts.recovery.recover(WorkerFailure(FailureKind.WORKER_RAISED, "worker raised: boom"), g, p)

    assert out.survivors is None and out.record.step_before == 7
    assert not hasattr(g, "salvaged_gone")  # no salvage was asked for
    assert out.group is g and g.members == []
    assert [f.kind for f in parts.failures] == [FailureKind.WORKER_RAISED]
    assert [e.kind for e in parts.events] == ["failure"]  # a storage job falls back as it always does
