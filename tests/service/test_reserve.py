"""The reserve without Ray running: a start takes spares by the node they answered from, and a growth
counts as warm only once a spare has answered on each node it needs, and where standbys are kept (the
Ray-backed paths are in test_standby.py and test_worker_group.py)."""

from __future__ import annotations

import pytest

from service.pool.reserve import Reserve, standby_targets
from service.pool.roster import Role, Roster, WorkerHandle
from service.pool.slots import Slots
from workers.report import WorkerInfo


def _reserve(monkeypatch, answers: dict[int, str]) -> tuple[Reserve, Roster]:
    """A reserve whose handles answer from the node `answers` gives by their id (none: not answered)."""
    monkeypatch.setattr(WorkerHandle, "answer", lambda self: WorkerInfo(node_id=answers[id(self)], ip="", pid=1)
                        if id(self) in answers else None)
    roster = Roster()
    return Reserve(roster=roster, slots=Slots(cpus=1, gpus=0, job_id="j", owner=None), launcher=None), roster


def test_a_start_takes_the_spares_on_the_nodes_they_answered_from_one_per_entry(monkeypatch):
    answers: dict[int, str] = {}
    reserve, roster = _reserve(monkeypatch, answers)
    member = WorkerHandle(None, "a", None, Role.MEMBER)
    landed = WorkerHandle(None, "a", None, Role.SPARE)  # aimed at a, answered from b
    on_b, on_c = WorkerHandle(None, "b", None, Role.SPARE), WorkerHandle(None, "c", None, Role.SPARE)
    answers.update({id(landed): "b", id(on_b): "b", id(on_c): "c"})
    roster.workers = [member, landed, on_b, on_c]
    assert reserve.take_spares(["a", "b"]) == [landed]
    assert landed.node_id == "b" and roster.workers == [member, on_b, on_c]
    assert reserve.take_spares(["b", "b", "c"]) == [on_b, on_c] and roster.workers == [member]


def test_a_growth_is_warm_once_a_spare_has_answered_on_each_node_it_needs(monkeypatch):
    answers: dict[int, str] = {}
    reserve, roster = _reserve(monkeypatch, answers)
    first, second = WorkerHandle(None, "a", None, Role.SPARE), WorkerHandle(None, "a", None, Role.SPARE)
    roster.workers = [first, second]
    answers[id(first)] = "a"
    assert reserve.warm(["a"]) and not reserve.warm(["a", "a"])  # the second is still starting
    answers[id(second)] = "a"
    assert reserve.warm(["a", "a"]) and not reserve.warm(["a", "b"])
    assert roster.spares == [first, second]  # asking takes nothing


@pytest.mark.parametrize("per_node, members, free, spares, want", [
    # tp=2 on 3 nodes of 2 slots, 4 ranks on a and b: one standby beside each, and c holds a node's worth
    (1, {"a": 2, "b": 2}, {"a": 2, "b": 2, "c": 2}, (), {"a": 1, "b": 1, "c": 2}),
    # no idle node (every usable node hosts members): beside the members only
    (1, {"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 1, "c": 1}, (), {"a": 1, "b": 1, "c": 1}),
    # a growth's spare warms up on c: c gets nothing; d, the next idle one, the node's worth
    (1, {"a": 2, "b": 2}, {"a": 2, "b": 2, "c": 2, "d": 2}, ("c",), {"a": 1, "b": 1, "d": 2}),
    # only one idle node takes them: the roomiest, then the lowest id; at most its slots
    (1, {"a": 3}, {"a": 3, "c": 2, "b": 2, "d": 4}, (), {"a": 1, "d": 3}),
    (1, {"a": 3}, {"a": 3, "c": 2, "b": 2}, (), {"a": 1, "b": 2}),
    (1, {"a": 3}, {"a": 3, "c": 1}, (), {"a": 1, "c": 1}),
    # a node outside the grant offers no slot (0) and gets none
    (1, {"a": 2}, {"a": 2, "b": 0}, (), {"a": 1}),
    # per_node counts beside members; the idle node's count is the lost node's members, not per_node
    (2, {"a": 2, "b": 1}, {"a": 2, "b": 2, "c": 2}, (), {"a": 2, "b": 2, "c": 2}),
    # standbys off, or no member yet: none anywhere
    (0, {"a": 2}, {"a": 2, "b": 2}, (), {}),
    (1, {}, {"a": 2, "b": 2}, (), {}),
])
def test_standbys_go_beside_the_members_and_a_nodes_worth_on_one_idle_node(per_node, members, free, spares, want):
    assert standby_targets(per_node, members, free, spares) == want


@pytest.mark.parametrize("per_node,members,free,cap,want", [
    # the cap leaves the members' own nodes theirs first: the idle node's share goes first
    (1, {"a": 2, "b": 2}, {"a": 2, "b": 2, "c": 2}, 3, {"a": 1, "b": 1, "c": 1}),
    (1, {"a": 2, "b": 2}, {"a": 2, "b": 2, "c": 2}, 2, {"a": 1, "b": 1}),
    # then one at a time from the nodes with most (highest id first)
    (8, {"a": 1}, {"a": 1, "b": 1}, 3, {"a": 3}),
    (2, {"a": 1, "b": 1}, {"a": 1, "b": 1}, 3, {"a": 2, "b": 1}),
    (8, {"a": 1}, {"a": 1, "b": 1}, 0, {}),
    # a cap above what the rule asks changes nothing
    (1, {"a": 2}, {"a": 2, "b": 2}, 10, {"a": 1, "b": 2}),
    (1, {"a": 2}, {"a": 2, "b": 2}, None, {"a": 1, "b": 2}),
])
def test_a_cap_bounds_the_standbys_in_all(per_node, members, free, cap, want):
    assert standby_targets(per_node, members, free, cap=cap) == want
