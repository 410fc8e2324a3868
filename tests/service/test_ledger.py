"""Pure tests of the capacity ledger (tier 1) and of how a cluster snapshot becomes one."""

from __future__ import annotations

import pytest

from service.pool.cluster import in_use_from, snapshot_from
from service.pool.placement import cap_slots
from service.sharing.ledger import Holding, Ledger, NodeCapacity, WorkerShape

CPU = WorkerShape(cpus=1.0)
GPU = WorkerShape(cpus=2.0, gpus=1.0)


def row(node_id: str, cpus: float, gpus: float = 0.0, *, alive: bool = True, head: bool = False) -> dict:
    res = {"CPU": cpus, "GPU": gpus}
    if head:
        res["node:__internal_head__"] = 1.0
    return {"NodeID": node_id, "Alive": alive, "Resources": res}


def snap(rows, draining=None):
    return snapshot_from(rows, draining or {}, now=100.0)


def test_free_is_the_nodes_minus_what_every_job_holds():
    led = Ledger(nodes=(NodeCapacity(node_id="a", cpus=8, gpus=2), NodeCapacity(node_id="b", cpus=4)),
                 holdings=(Holding.of("g", GPU, {"a": 2}), Holding.of("c", CPU, {"a": 1, "b": 3})))
    assert led.free() == {"a": (3.0, 0.0), "b": (1.0, 0.0)}
    assert led.free_workers(CPU) == 4 and led.free_workers(GPU) == 0
    assert led.grantable("c", CPU) == {"a": 4, "b": 4}
    assert led.grantable("g", GPU) == {"a": 2}
    assert led.overcommitted() == {}


def test_from_snapshot_drops_dead_nodes_keeps_draining_holdings_but_grants_nothing_there():
    s = snap([row("a", 4), row("b", 4), row("c", 4, alive=False)], draining={"b": 0})
    led = Ledger.from_snapshot(s, [Holding.of("j", CPU, {"a": 1, "b": 2, "c": 1})])
    assert [n.node_id for n in led.nodes] == ["a", "b"]
    assert led.held("j").as_dict() == {"a": 1, "b": 2}  # the worker on the dead node is gone
    assert led.free() == {"a": (3.0, 0.0)}  # b is draining: nothing free there
    assert led.grantable("j", CPU) == {"a": 4}


def test_head_is_kept_free_when_asked():
    s = snap([row("h", 4, head=True), row("w", 4)])
    assert Ledger.from_snapshot(s).free_workers(CPU) == 8
    assert Ledger.from_snapshot(s, include_head=False).free_workers(CPU) == 4


def test_resources_used_outside_the_service_count_as_held():
    """Chosen over refusing: a job started with `elastron run` or `ray job submit` never asks for a grant,
    but its workers hold Ray resources; whatever in-use resources our holdings do not explain are held."""
    s = snap([row("a", 8, 2), row("b", 8)])
    avail = {"a": {"CPU": 3.0, "GPU": 1.0}, "b": {"CPU": 8.0}}  # 5 CPUs + 1 GPU in use on a
    in_use = in_use_from(s, avail)
    assert in_use == {"a": (5.0, 1.0), "b": (0.0, 0.0)}
    led = Ledger.from_snapshot(s, [Holding.of("ours", CPU, {"a": 2})], in_use=in_use)
    a = led.node("a")
    assert (a.outside_cpus, a.outside_gpus) == (3.0, 1.0)  # 5 in use - 2 ours
    assert led.free()["a"] == (3.0, 1.0)  # 8 - 3 outside - 2 ours; 2 - 1 outside
    assert led.free_workers(GPU) == 1


def test_a_node_ray_reports_with_nothing_available_is_fully_in_use():
    """Ray's per-node report leaves out a resource none of which is available: a node whose CPUs are all
    taken by a job outside the service has no CPU entry at all, and must not be offered."""
    s = snap([row("a", 1), row("b", 1), row("g", 4, 2)])
    in_use = in_use_from(s, {"a": {"memory": 1e9}, "g": {"CPU": 4.0}})  # b: not reported at all
    assert in_use == {"a": (1.0, 0.0), "b": (1.0, 0.0), "g": (0.0, 2.0)}
    assert Ledger.from_snapshot(s, in_use=in_use).free_workers(CPU) == 4  # g's four CPUs only


def test_holdings_over_a_shrunken_node_are_reported():
    led = Ledger.from_snapshot(snap([row("a", 2)]), [Holding.of("j", CPU, {"a": 3})])
    assert led.overcommitted() == {"a": (1.0, 0.0)}


def test_updates_are_pure():
    led = Ledger(nodes=(NodeCapacity(node_id="a", cpus=4),))
    led2 = led.with_holding(Holding.of("j", CPU, {"a": 2}))
    assert led.holdings == () and led2.held("j").workers == 2
    assert led2.with_holding(Holding.of("j", CPU, {})).holdings == ()
    assert led2.without("j") == led


@pytest.mark.parametrize("make, match", [
    (lambda: WorkerShape(cpus=0, gpus=0), "both are 0"),
    (lambda: WorkerShape(cpus=-1), "cpus per worker"),
    (lambda: Holding(job_id="j", nodes=(("a", 0),)), "integers >= 1"),
    (lambda: Holding(job_id="j", nodes=(("b", 1), ("a", 1))), "unique and sorted"),
    (lambda: Ledger(nodes=(NodeCapacity(node_id="a"), NodeCapacity(node_id="a"))), "node twice"),
    (lambda: Ledger(holdings=(Holding.of("j", CPU, {"x": 1}),)), r"node\(s\) \['x'\]"),
])
def test_bad_ledgers_are_refused_with_the_numbers(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_cap_slots_limits_a_coordinator_to_its_grant():
    slots = {"a": 4, "b": 4, "c": 2}
    assert cap_slots(slots, None) == slots
    assert cap_slots(slots, {"a": 2, "c": 5}) == {"a": 2, "c": 2}
    assert cap_slots(slots, {}) == {}
