"""Slots without Ray running: the names a group gives what it starts, and the slot a stopped member
left on a live node, which only the next start on that node takes."""

from __future__ import annotations

import service.pool.slots as slots
from service.pool.detached import standby_kind, standby_node, worker_prefix
from service.pool.slots import Slots


def test_a_group_without_an_owner_names_nothing_and_one_with_an_owner_names_each_thing_apart():
    assert Slots(cpus=1, gpus=0, job_id="j1", owner=None).named() == {}
    owned = Slots(cpus=1, gpus=0, job_id="j1", owner="coordinator-j1")
    a, b = owned.named(), owned.named()
    assert a["lifetime"] == b["lifetime"] == "detached"
    assert a["name"].startswith(worker_prefix("j1")) and a["name"] != b["name"]
    standby = owned.named(standby_kind("node-7"))["name"]
    assert standby_node("j1", standby) == "node-7"  # a coordinator taking over reads the node from the name
    assert standby_node("j1", a["name"]) is None and standby_node("j2", standby) is None


def test_a_vacant_slot_goes_to_the_next_start_on_its_node_and_the_rest_are_removed_after_it(monkeypatch):
    removed = []
    monkeypatch.setattr(slots, "remove_placement_group", removed.append)
    s = Slots(cpus=1, gpus=0, job_id="j", owner=None)
    s.leave_vacant("a", "pg-a1")
    s.leave_vacant("a", "pg-a2")
    s.leave_vacant("b", "pg-b")
    assert s.take_vacant("c") is None  # none left there
    assert s.take_vacant("a") == "pg-a2" and removed == []
    s.release_vacant()
    assert sorted(removed) == ["pg-a1", "pg-b"]
    assert s.take_vacant("a") is None and s.take_vacant("b") is None  # released once, not handed out again
    s.release_vacant()
    assert sorted(removed) == ["pg-a1", "pg-b"]
