"""Peer snapshots, the pure rules, by literal tables: who keeps whose copy (`pair`) and which snapshot
step the survivors' copies cover after a failure (`cover`)."""

from __future__ import annotations

import pytest

from parallel.layout import Layout
from parallel.peers import Cover, NoCover, cover, pair


@pytest.mark.parametrize("nodes, buddy", [
    (("a", "b"), (1, 0)),
    (("a", "b", "c"), (1, 2, 0)),                       # odd count: a ring
    (("a", "a", "b", "b"), (2, 3, 0, 1)),
    (("a", "b", "a", "b"), (1, 0, 3, 2)),               # ranks interleaved over the nodes
    (("a", "a", "b", "c", "c"), (2, 3, 4, 0, 1)),       # uneven nodes, none with most ranks
    (("a", "a", "b"), (2, 2, 0)),                       # one node has most ranks: rank 2 keeps two copies
    (("a", "a", "a", "b", "c"), (3, 4, 3, 0, 1)),
])
def test_every_rank_has_a_buddy_on_another_node(nodes, buddy):
    p = pair(nodes)
    assert p.paired and p.why == ""
    assert p.buddy == buddy
    assert all(nodes[r] != nodes[b] for r, b in enumerate(p.buddy))


def test_a_rank_may_keep_several_copies_when_one_node_hosts_most_ranks():
    p = pair(("a", "a", "b"))
    assert p.keeps(2) == (0, 1) and p.keeps(0) == (2,) and p.keeps(1) == ()


@pytest.mark.parametrize("nodes", [("a",), ("a", "a", "a")])
def test_one_node_has_no_pairing_and_says_why(nodes):
    p = pair(nodes)
    assert not p.paired
    assert p.buddy == (None,) * len(nodes)
    assert p.why == f"all {len(nodes)} ranks are on one node: no copy of a shard can live on another node"


SHARD3 = Layout(dp_shard=3)  # buddies on three nodes: 0 -> 1 -> 2 -> 0 (rank r's copy lives on r+1)
SHARD4 = Layout(dp_shard=4)  # nodes a,a,b,b: 0 -> 2, 1 -> 3, 2 -> 0, 3 -> 1


@pytest.mark.parametrize("layout, held, want", [
    # rank 1 killed after snapshot 12 was complete everywhere: its copy lives on rank 2
    (SHARD3, {0: {0: [10, 12], 2: [10, 12]}, 2: {2: [10, 12], 1: [10, 12]}},
     Cover(step=12, serve={0: 0, 1: 2, 2: 2})),
    # rank 1 killed while sending snapshot 12: rank 2 holds its copy of 10 only -> the previous step
    (SHARD3, {0: {0: [10, 12], 2: [10, 12]}, 2: {2: [10, 12], 1: [10]}},
     Cover(step=10, serve={0: 0, 1: 2, 2: 2})),
    # pure replicas: either copy of the one box will do
    (Layout(dp_replicate=2), {0: {0: [5], 1: [5]}}, Cover(step=5, serve={0: 0, 1: 0})),
    # a fault while forming from memory (rank 1 lost, then rank 0): ranks 2 and 3 still hold everything
    (SHARD4, {2: {2: [12], 0: [12]}, 3: {3: [12], 1: [12]}}, Cover(step=12, serve={0: 2, 1: 3, 2: 2, 3: 3})),
    # FSDP x TP: ranks 1 (shard 0, tp 1) and 2 (shard 1, tp 0) lost; copies on 3 and 0
    (Layout(dp_shard=2, tp=2), {0: {0: [4], 2: [4]}, 3: {3: [4], 1: [4]}}, Cover(step=4, serve={0: 0, 1: 3, 2: 0, 3: 3})),
])
def test_the_newest_step_held_whole_is_used_and_each_copy_served_by_its_holder(layout, held, want):
    assert cover(layout, held) == want


@pytest.mark.parametrize("layout, held, why", [
    # double fault: rank 1 and rank 2, which kept its copy, both lost
    (SHARD3, {0: {0: [12], 2: [12]}},
     "no survivor holds a copy of old rank(s) [1] of dp=3,tp=1,pp=1 at snapshot step 12 (nor every shard at an "
     "older one): a rank and the buddy that kept its copy were both lost"),
    # a fault while forming from memory that takes the last copy of shard 1 (ranks 1 then 3)
    (Layout(dp_replicate=2, dp_shard=2), {0: {0: [12], 2: [12]}, 2: {2: [12], 0: [12]}},
     "no survivor holds a copy of old rank(s) [1, 3] of dp_replicate=2,dp_shard=2,tp=1,pp=1 at snapshot step 12 (nor "
     "every shard at an older one): a rank and the buddy that kept its copy were both lost"),
    # the survivors' copies are of different steps, neither whole
    (SHARD3, {0: {0: [12]}, 2: {2: [10], 1: [10]}},
     "no survivor holds a copy of old rank(s) [1, 2] of dp=3,tp=1,pp=1 at snapshot step 12 (nor every shard at "
     "an older one): a rank and the buddy that kept its copy were both lost"),
    (SHARD3, {0: {}, 2: {}}, "no survivor holds a snapshot"),
])
def test_copies_that_miss_a_shard_give_the_reason(layout, held, why):
    assert cover(layout, held) == NoCover(why)


def test_a_missing_shard_is_found_with_one_look_at_each_rank_not_one_per_rank_and_holder(monkeypatch):
    looked = []
    place = Layout.place
    monkeypatch.setattr(Layout, "place", lambda layout, r: looked.append(r) or place(layout, r))
    layout = Layout(dp_shard=256)
    held = {r: {r: (7,)} for r in range(1, 256)}  # rank 0 and its copy are lost

    got = cover(layout, held)

    assert isinstance(got, NoCover) and "old rank(s) [0]" in got.why
    # each holder's place for the step, again to name the lost ranks, and each rank's once: linear
    assert len(looked) <= 3 * layout.world_size


def test_a_cover_looks_at_the_holders_places_only(monkeypatch):
    """Whether a step is covered takes one place per old rank held at it, none per rank of the layout
    (before: every rank's place for the layout's set, then the holders', each as four enum lookups)."""
    looked, coords = [], []
    place = Layout.place
    monkeypatch.setattr(Layout, "place", lambda layout, r: looked.append(r) or place(layout, r))
    monkeypatch.setattr(Layout, "coords", lambda layout, r: coords.append(r))
    layout = Layout(dp_replicate=2, dp_shard=128)
    held = {r: {r: (7,)} for r in range(128, 256)}  # the second replica survives, each with its own copy

    got = cover(layout, held)

    assert got == Cover(step=7, serve={r: r for r in range(128, 256)})
    assert sorted(looked) == list(range(128, 256)) and coords == []
