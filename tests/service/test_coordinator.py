"""Tier 1: the coordinator's flows with the fake worker group and fake cluster of tests/fakes.py (no Ray,
no torch ranks)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from parallel.layout import Layout
from parallel.planner import PlanError
from service.control.coordinator import Coordinator
from service.pool.group import FailureKind, WorkerFailure
from tests.fakes import advance, make_coordinator
from service.control.commands import Pause, Resume, SetWorkers, Stop


def changes(c: Coordinator):
    """Reconfigurations after the initial start (which is recorded too, as cause "planned")."""
    assert c.reconfigs and c.reconfigs[0].cause == "planned" and c.reconfigs[0].old_layout is None
    return c.reconfigs[1:]


def states(c: Coordinator) -> list[str]:
    return [e["to_state"] for e in c.events_since(0) if e["kind"] == "transition"]


def test_runs_to_success_on_all_capacity(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2})
    advance(c, lambda c: c.state.name.is_terminal)
    assert str(c.state.name) == "SUCCEEDED" and c.step_done == 20
    assert states(c) == ["STARTING", "RUNNING", "SUCCEEDED"]
    rc = c.reconfigs[-1]
    assert rc.world_size == 4 and rc.new_layout.dp == 4 and c.status().world_size == 0
    assert (tmp_path / "events.jsonl").read_text().count("\n") == len(c.events_since(0))


def test_the_group_is_formed_with_the_planners_whole_plan(tmp_path):
    """The micro batch the planner shrank to fit the memory budget goes to the group with the layout
    (4 workers, 2 samples per DP rank: the asked 2 needs ~4.25 MiB, 1 needs ~3.7)."""
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, parallel={"memory_budget_gb": 4.0 / 1024})
    advance(c, lambda c: c.step_done >= 1)
    assert c.group.plan is c.plan and c.plan.layout == Layout(dp_shard=4)
    assert (c.plan.micro_batch_size, c.plan.grad_accum_steps) == (1, 2)
    assert "micro_batch_size=1 (asked 2): smaller to fit the memory budget" in c.plan.reasons


def test_a_forced_layout_is_planned_by_the_planner_and_holds_the_worker_count(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, parallel={"layout": "dp=1,pp=2"})
    assert c.policy.config.min_workers == c.policy.config.max_workers == 2
    advance(c, lambda c: c.step_done >= 1)
    assert c.group.plan is c.plan and c.plan.layout == Layout(pp=2)
    assert (c.plan.world_size, c.plan.micro_batch_size, c.plan.grad_accum_steps) == (2, 2, 4)
    assert any(r.startswith("layout dp=1,tp=1,pp=2 forced by the job") for r in c.plan.reasons)
    with pytest.raises(PlanError, match="forced layout dp=1,tp=1,pp=2 needs 2 workers, 1 offered"):
        c._plan(1)


def test_preemption_notice_shrinks_with_zero_steps_lost(tmp_path):
    """With drain_margin 0 the group moves off at once, however far the deadline (here the year 2286)."""
    c, cluster, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, parallel={"drain_margin": 0.0})
    advance(c, lambda c: c.step_done >= 7)
    cluster.draining["b"] = 10**13
    advance(c, lambda c: c.group is not None and c.group.size == 2 and c.step_done >= 9)
    (rc,) = changes(c)
    assert rc.cause == "preemption" and rc.steps_lost == 0 and rc.step_before == 7 and rc.resumed_step == 7
    assert "b" not in c.group.nodes()
    assert [e["kind"] for e in c.events_since(0)].count("preemption") == 1


def paced(G, seconds: float) -> None:
    """Each fake training call of group class `G` takes `seconds`, as a real one takes a chunk."""
    run = G.run

    def slow(self, **kw):
        time.sleep(seconds)
        return run(self, **kw)
    G.run = slow


DRAIN = {"drain_floor_s": 1.0, "drain_move_s": 0.2}
"""A lead of 1 s (the floor: 1.5 x (0.05 s chunk + 0.2 s assumed move) is less), so a test waits seconds."""


def test_a_drain_with_a_long_deadline_trains_on_and_moves_off_before_it(tmp_path):
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, steps=10**6, parallel=DRAIN, chunk_seconds=0.05)
    paced(G, 0.01)
    advance(c, lambda c: c.step_done >= 3)
    noticed = c.step_done
    deadline = time.time() + 3.0
    cluster.draining["b"] = int(deadline * 1000)
    assert c._drain_lead() == 1.0
    advance(c, lambda c: len(c.reconfigs) >= 2, limit=100_000)
    (rc,) = changes(c)
    assert rc.cause == "preemption" and rc.steps_lost == 0 and "b" not in c.group.nodes()
    assert deadline - 1.0 - 0.01 <= rc.detected < deadline  # moved once the lead was reached, not before
    assert rc.step_before > noticed + 50  # it trained on with b meanwhile (~200 paced steps)
    notes = [e for e in c.events_since(0) if e["kind"] == "capacity" and e["reason"].startswith("training on")]
    assert len(notes) == 1 and "node b drains in" in notes[0]["reason"], notes  # said once, not every tick
    assert notes[0]["details"]["move_at"] == pytest.approx(deadline - 1.0, abs=0.01)
    assert [e["kind"] for e in c.events_since(0)].count("preemption") == 1


def test_a_drain_with_a_deadline_inside_the_lead_moves_off_at_once(tmp_path):
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, steps=10**6, parallel=DRAIN, chunk_seconds=0.05)
    advance(c, lambda c: c.step_done >= 3)
    noticed = c.step_done
    cluster.draining["b"] = int((time.time() + 0.8) * 1000)  # 0.8 s < the 1 s lead
    advance(c, lambda c: len(c.reconfigs) >= 2)
    (rc,) = changes(c)
    assert rc.cause == "preemption" and rc.steps_lost == 0 and rc.step_before == noticed  # the next decision
    assert not [e for e in c.events_since(0) if e["reason"].startswith("training on")]


def test_a_group_with_spare_capacity_still_moves_off_a_draining_node(tmp_path):
    """Node c offers as many workers as b holds: the group keeps its size but must leave b before the
    deadline (without the move, b's workers would die with it)."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2, "c": 2}, steps=10**6, max_workers=4,
                                     parallel={"drain_margin": 0.0})
    advance(c, lambda c: c.step_done >= 3)
    used = sorted(c.group.nodes())
    on, idle = used[-1], ({"a", "b", "c"} - set(used)).pop()
    cluster.draining[on] = int((time.time() + 60) * 1000)
    advance(c, lambda c: len(c.reconfigs) >= 2)
    (rc,) = changes(c)
    assert rc.cause == "preemption" and rc.world_size == 4 and rc.steps_lost == 0
    assert c.group.nodes()[idle] == 2 and rc.transfer.path == "live"


def test_the_lead_comes_from_the_last_live_move_and_the_assumed_one_before(tmp_path):
    c, cluster, G = make_coordinator(tmp_path, {"a": 2}, steps=10**6)
    advance(c, lambda c: c.step_done >= 2)
    assert c._drain_lead() == pytest.approx(1.5 * (0.5 + 40.0))  # the defaults: nothing moved live yet
    cluster.nodes["b"] = 2
    advance(c, lambda c: len(c.reconfigs) >= 2)  # a growth: moved live (the fake's hand-over and transfer take 0 s)
    assert changes(c)[-1].transfer.path == "live"
    assert c._drain_lead() == 5.0  # the floor: 1.5 x (0.5 s chunk + 0 s)


def test_a_node_the_watcher_still_calls_alive_is_left_out_after_a_failed_probe(tmp_path):
    """The stale-view case: Ray still lists a killed node as alive, but it cannot place work."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5)
    advance(c, lambda c: c.step_done >= 6)
    G.fail_next.append(FailureKind.WORKER_DIED)
    c.group_probe = lambda nodes, timeout_s: {n for n in nodes if n != "b"}  # b: alive per the watcher only
    advance(c, lambda c: len(changes(c)) == 1)
    (rc,) = changes(c)
    assert rc.world_size == 2 and "b" not in c.group.nodes() and rc.resumed_step == 5
    fail = [e for e in c.events_since(0) if e["kind"] == "failure"][0]
    assert fail["details"]["unresponsive_nodes"] == ["b"]


def test_a_node_that_dies_just_after_the_probe_is_caught_when_the_restart_fails_on_it(tmp_path):
    """Two faults in quick succession: a worker dies, the probe finds every node fine, then a node
    dies. The re-form onto that node fails; the nodes it was placing on are probed too, so the next
    re-form leaves the dead node out instead of failing on it again."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5)
    advance(c, lambda c: c.step_done >= 6)
    gone: set[str] = set()

    def probe(nodes, timeout_s):
        alive = {n for n in nodes if n not in gone}
        gone.add("b")  # b dies right after the first probe
        return alive
    c.group_probe = probe
    start = G.scale_to

    def scale_to(self, nodes):
        if set(nodes) & gone:
            raise WorkerFailure(FailureKind.WORKER_DIED, "a worker died during start")
        return start(self, nodes)
    G.scale_to = scale_to
    G.fail_next.append(FailureKind.WORKER_DIED)
    advance(c, lambda c: len(changes(c)) == 1)
    (rc,) = changes(c)
    assert rc.cause == "failure" and rc.world_size == 2 and "b" not in c.group.nodes()
    fails = [e for e in c.events_since(0) if e["kind"] == "failure"]
    assert [f["details"]["unresponsive_nodes"] for f in fails] == [[], ["b"]]


def test_a_suspect_that_answers_a_later_probe_is_used_again_at_once(tmp_path):
    """A probe that timed out on a merely slow raylet must not keep its node out for suspect_seconds:
    while the job cannot start (min_workers=4 needs both nodes) it probes the suspect again."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5, min_workers=4, reprobe_interval_s=0.0)
    advance(c, lambda c: c.step_done >= 6)
    slow = {"b"}
    c.group_probe = lambda nodes, timeout_s: {n for n in nodes if n not in slow}
    G.fail_next.append(FailureKind.WORKER_DIED)
    advance(c, lambda c: str(c.state.name) == "WAITING_FOR_CAPACITY")
    assert "min_workers=4" in c.state.reason
    slow.clear()  # b answers again
    advance(c, lambda c: len(changes(c)) == 1 and str(c.state.name) == "RUNNING")
    (rc,) = changes(c)
    assert rc.cause == "failure" and rc.world_size == 4 and rc.resumed_step == 5
    back = [e for e in c.events_since(0) if e["kind"] == "capacity"]
    assert back and back[-1]["details"]["nodes"] == ["b"]


def test_node_death_resumes_from_last_commit_on_what_is_left(tmp_path):
    c, cluster, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5)
    advance(c, lambda c: c.step_done >= 8)
    cluster.dead.add("b")
    advance(c, lambda c: changes(c))
    (rc,) = changes(c)
    assert rc.cause == "failure" and rc.resumed_step == 5 and rc.steps_lost == 3 and rc.world_size == 2
    assert "RECOVERING" in states(c)
    advance(c, lambda c: c.state.name.is_terminal)
    assert str(c.state.name) == "SUCCEEDED"


def test_grow_waits_for_settle_then_resizes_without_redoing_steps(tmp_path):
    c, cluster, _ = make_coordinator(tmp_path, {"a": 2}, settle=0.0)
    advance(c, lambda c: c.step_done >= 3)
    cluster.nodes["b"] = 2
    advance(c, lambda c: len(c.reconfigs) == 2)
    (rc,) = changes(c)
    assert c.group.size == 4
    assert rc.cause == "grow" and rc.steps_lost == 0 and rc.started == 2 and rc.stopped == 0


def _joiners_warm_after(G, steps: int | None) -> dict[str, int]:
    """Give fake group class `G` joiners that are warm `steps` training calls after `prewarm` started
    them (None: never); returns {node: calls left} as prewarm fills it."""
    warming: dict[str, int] = {}
    run = G.run

    def prewarm(self, nodes):
        for n in nodes:
            warming.setdefault(n, steps if steps is not None else 10**9)
        return len(nodes)

    def warm(self, nodes):
        return all(warming.get(n) == 0 for n in nodes)

    def run_and_warm(self, **kw):
        for n in warming:
            warming[n] = max(0, warming[n] - 1)
        return run(self, **kw)

    G.prewarm, G.warm, G.run = prewarm, warm, run_and_warm
    return warming


def test_a_join_trains_on_at_the_old_size_until_the_joiners_are_warm(tmp_path):
    """A node arrives: its workers start and warm up (`prewarm`) while the group trains on at its old
    size; the growth waits for them (`warm`), so the group stops only to move state and form."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2}, settle=0.0, steps=40)
    warming = _joiners_warm_after(G, 3)
    advance(c, lambda c: c.step_done >= 3)
    cluster.nodes["b"] = 2
    arrived = c.step_done
    advance(c, lambda c: len(c.reconfigs) == 2)
    (rc,) = changes(c)
    assert warming == {"b": 0}
    assert rc.step_before == arrived + 3  # three steps trained while the joiners warmed up
    assert [c.metrics[s].world_size for s in range(arrived + 1, rc.step_before + 1)] == [2, 2, 2]
    assert c.group.size == 4 and rc.cause == "grow" and rc.steps_lost == 0


def test_a_join_whose_workers_never_warm_up_grows_after_the_start_timeout(tmp_path):
    c, cluster, G = make_coordinator(tmp_path, {"a": 2}, settle=0.0, steps=1000, start_timeout_s=0.2)
    _joiners_warm_after(G, None)
    advance(c, lambda c: c.step_done >= 3)
    cluster.nodes["b"] = 2
    t0 = time.monotonic()
    advance(c, lambda c: len(c.reconfigs) == 2 or time.monotonic() - t0 > 60, limit=10**6)
    assert c.group.size == 4 and time.monotonic() - t0 >= 0.2


def test_a_settled_growth_trains_on_while_a_periodic_checkpoint_is_written(tmp_path):
    """The hand-over would wait for a save in flight with the whole group stopped: a growth due while the
    checkpoint of step 5 writes (its row says step 0 is the last committed) trains one more step."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2}, settle=0.0, steps=40, interval=5)
    run = G.run

    def run_committing_after_the_call(self, **kw):
        committed = self.disk.committed
        # this call's save, if it started one, commits after it
        return replace(run(self, **kw), committed_step=committed)

    G.run = run_committing_after_the_call
    advance(c, lambda c: c.step_done >= 5)
    assert c.committed_step == 0
    cluster.nodes["b"] = 2
    advance(c, lambda c: len(c.reconfigs) == 2)
    (rc,) = changes(c)
    assert rc.step_before == 6 and c.group.size == 4 and rc.steps_lost == 0


def test_waits_for_capacity_below_min_workers_and_resumes(tmp_path):
    c, cluster, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, min_workers=3)
    advance(c, lambda c: c.step_done >= 6)
    cluster.dead.add("b")
    advance(c, lambda c: str(c.state.name) == "WAITING_FOR_CAPACITY")
    assert "min_workers=3" in c.state.reason
    cluster.dead.discard("b")
    advance(c, lambda c: str(c.state.name) == "RUNNING" and c.group.size == 4)
    assert c.step_done == 5  # resumed from the checkpoint committed at step 5


def test_repeated_failures_of_one_kind_end_in_failed_with_the_error(tmp_path):
    c, _, G = make_coordinator(tmp_path, {"a": 2})
    G.fail_next.extend([FailureKind.WORKER_RAISED] * 5)
    advance(c, lambda c: c.state.name.is_terminal)
    assert str(c.state.name) == "FAILED"
    assert "worker_raised failed 3 times" in c.state.reason and "boom" in c.state.reason


def test_user_resize_pause_resume_stop(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, settle=1e9)
    advance(c, lambda c: c.step_done >= 3)
    c.send(SetWorkers(workers=2))
    advance(c, lambda c: len(c.reconfigs) == 2)
    assert c.group.size == 2 and c.reconfigs[-1].cause == "user" and c.reconfigs[-1].steps_lost == 0
    c.send(SetWorkers(workers=4))  # a user's growth ignores the settle time
    advance(c, lambda c: len(c.reconfigs) == 3)
    assert c.group.size == 4
    c.send(Pause())
    advance(c, lambda c: str(c.state.name) == "PAUSED")
    paused_at = c.step_done
    assert c.group is None and c.committed_step == paused_at
    c.send(Resume())
    advance(c, lambda c: c.step_done > paused_at)
    c.send(Stop())
    advance(c, lambda c: c.state.name.is_terminal)
    assert str(c.state.name) == "STOPPED"


def test_a_planned_resize_moves_state_live_then_writes_a_durable_checkpoint_in_the_background(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, settle=1e9, interval=5)
    advance(c, lambda c: c.step_done >= 7)
    c.send(SetWorkers(workers=2))
    advance(c, lambda c: len(c.reconfigs) == 2)
    rc = c.reconfigs[-1]
    assert rc.transfer.path == "live" and rc.transfer.moved.bytes_moved == 1 << 20
    assert rc.step_before == rc.resumed_step == 7 and rc.steps_lost == 0  # not the step-5 commit
    advance(c, lambda c: c.step_done >= 9)
    events = c.events_since(0)
    live = next(i for i, e in enumerate(events) if e["kind"] == "resize" and "moved live" in e["reason"])
    durable = next(i for i, e in enumerate(events) if e["kind"] == "checkpoint" and "in the background" in e["reason"])
    # written once the new layout has trained its first step (8), not while that step runs
    assert live < durable and events[durable]["step"] == 8 and c.committed_step >= 8


def test_reshard_storage_resizes_through_a_blocking_checkpoint(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, settle=1e9, parallel={"reshard": "storage"})
    advance(c, lambda c: c.step_done >= 7)
    c.send(SetWorkers(workers=2))
    advance(c, lambda c: len(c.reconfigs) == 2)
    assert c.reconfigs[-1].transfer.path == "storage"
    assert c.reconfigs[-1].transfer.to_dict().keys() == {"path", "start_s", "standby", "form_s", "snapshot_bytes"}  # where its time went
    assert c.reconfigs[-1].steps_lost == 0
    assert any(e["kind"] == "checkpoint" and "before resize" in e["reason"] for e in c.events_since(0))


def test_a_live_transfer_that_fails_midway_falls_back_to_the_last_commit_and_says_so(tmp_path):
    c, _, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, settle=1e9, interval=5)
    advance(c, lambda c: c.step_done >= 7)
    G.fail_next.append("transfer")
    c.send(SetWorkers(workers=2))
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 8)
    fallback = [e for e in c.events_since(0) if e["kind"] == "fallback"]
    assert len(fallback) == 1 and "last committed checkpoint (step 5)" in fallback[0]["reason"]
    rc = c.reconfigs[-1]
    assert rc.cause == "failure" and rc.resumed_step == 5 and rc.steps_lost == 2 and rc.transfer.path == "storage"


def test_a_node_death_heals_from_surviving_replicas_with_no_step_redone(tmp_path):
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5, parallel={"dp_mode": "replicate"})
    G.heals = True
    advance(c, lambda c: c.step_done >= 7)
    cluster.dead.add("b")
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 8)
    rc = c.reconfigs[-1]
    assert rc.cause == "failure" and rc.transfer.path == "peers"
    assert rc.step_before == rc.resumed_step == 7 and rc.steps_lost == 0  # not the step-5 commit
    assert c.group.size == 2 and "b" not in c.group.nodes() and rc.started == 0
    assert not [e for e in c.events_since(0) if e["kind"] == "fallback"]
    # the members it stopped, and why, are said before the heal
    (why,) = [e for e in c.events_since(0) if e["kind"] == "info" and "stopped" in e["details"]]
    assert why["details"]["stopped"] == ["its node is dead"] * 2 and "healing from 2 surviving" in why["reason"]


def test_a_node_the_watcher_lists_as_dead_is_neither_waited_for_nor_probed_after_a_failure(tmp_path):
    """Its workers cannot answer the salvage and its raylet cannot place the probe's bundle: waiting for
    either only runs out a timeout. It is still reported as unresponsive, and the survivors heal."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5, parallel={"dp_mode": "replicate"})
    G.heals = True
    probed: list[list[str]] = []
    c.group_probe = lambda nodes, timeout_s: probed.append(sorted(nodes)) or set(nodes)
    advance(c, lambda c: c.step_done >= 7)
    cluster.dead.add("b")
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 8)
    assert c.group.salvaged_gone == {"b"} and probed == [["a"]]
    (fail,) = [e for e in c.events_since(0) if e["kind"] == "failure"]
    assert fail["details"]["unresponsive_nodes"] == ["b"]
    assert c.reconfigs[-1].transfer.path == "peers" and c.reconfigs[-1].steps_lost == 0


def test_a_node_the_groups_own_probe_found_dead_is_neither_waited_for_nor_probed_again(tmp_path):
    """A wait on workers (a start, a form, a transfer) fails when its probe of their nodes finds one dead,
    while the watcher still lists it alive (Ray's health checks take ~15 s): the recovery must not ask
    its workers (the salvage would wait out its grace for them) nor probe it again (its timeout), and
    must leave it out of the next plan."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5, parallel={"dp_mode": "replicate"})
    G.heals = True
    probed: list[list[str]] = []
    c.group_probe = lambda nodes, timeout_s: probed.append(sorted(nodes)) or set(nodes) - {"b"}
    advance(c, lambda c: c.step_done >= 7)
    G.run = lambda self, **kw: (_ for _ in ()).throw(
        WorkerFailure(FailureKind.NODE_LOST, "node(s) b stopped answering during run", nodes={"b"}))
    c.step()
    del G.run
    assert c.group.salvaged_gone == {"b"} and probed == [["a"]]
    assert "b" in c.health.suspects
    (fail,) = [e for e in c.events_since(0) if e["kind"] == "failure"]
    assert fail["details"]["unresponsive_nodes"] == ["b"]
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 8)
    assert set(c.group.nodes()) == {"a"}  # b left out: the watcher still lists it alive
    assert c.reconfigs[-1].transfer.path == "peers" and c.reconfigs[-1].steps_lost == 0


def test_the_probe_of_the_failed_groups_nodes_runs_while_the_survivors_salvage(tmp_path):
    """Both wait out a silent peer (the probe's timeout, the salvage's grace): side by side, not one
    after the other. Each side waits here for the other to have started; run in turn, they would not meet."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5, parallel={"dp_mode": "replicate"})
    G.heals = True
    both = threading.Barrier(2, timeout=10)
    salvage = G.salvage

    def meeting_salvage(self, **kw):
        both.wait()
        return salvage(self, **kw)

    def meeting_probe(nodes, timeout_s):
        both.wait()
        return {n for n in nodes if n != "b"}
    G.salvage = meeting_salvage
    c.group_probe = meeting_probe
    advance(c, lambda c: c.step_done >= 7)
    G.fail_next.append(FailureKind.WORKER_DIED)  # b is not dead per the watcher: it is probed, and found unresponsive
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 8)
    (fail,) = [e for e in c.events_since(0) if e["kind"] == "failure"]
    assert fail["details"]["unresponsive_nodes"] == ["b"] and not both.broken


def test_survivors_without_every_shard_fall_back_to_the_last_commit_and_say_why(tmp_path):
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, interval=5, parallel={"dp_mode": "shard"})
    G.heals = True
    advance(c, lambda c: c.step_done >= 7)
    cluster.dead.add("b")
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 6)
    rc = c.reconfigs[-1]
    assert rc.transfer.path == "storage" and rc.resumed_step == 5 and rc.steps_lost == 2
    (fb,) = [e for e in c.events_since(0) if e["kind"] == "fallback"]
    assert "do not hold every shard" in fb["reason"] and "(step 5)" in fb["reason"]
    # the two survivors on a re-form as warm processes: nothing is started for the storage resume
    assert fb["details"]["warm_workers"] == 2 and rc.started == 0 and c.group.nodes() == {"a": 2}
    assert fb["details"]["stopped"] == ["its node is dead"] * 2


def test_survivors_below_min_workers_are_released_and_the_job_resumes_from_storage(tmp_path):
    c, cluster, G = make_coordinator(tmp_path, {"a": 1, "b": 1}, interval=5, min_workers=2,
                                     parallel={"dp_mode": "replicate"})
    G.heals = True
    advance(c, lambda c: c.step_done >= 7)
    cluster.dead.add("b")
    advance(c, lambda c: str(c.state.name) == "WAITING_FOR_CAPACITY")
    assert c.group is None and c.state.survivors is None
    (fb,) = [e for e in c.events_since(0) if e["kind"] == "fallback"]
    assert "surviving workers are released" in fb["reason"] and "(step 5)" in fb["reason"]
    cluster.dead.discard("b")
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 6)
    assert c.reconfigs[-1].transfer.path == "storage"
    assert c.reconfigs[-1].transfer.to_dict().keys() == {"path", "start_s", "standby", "form_s", "snapshot_bytes"}  # where its time went
    assert c.reconfigs[-1].resumed_step == 5


def test_a_recovery_that_resumes_at_the_last_step_is_still_recorded(tmp_path):
    """The last step is done and committed; the final checkpoint call then finds a worker gone. The new
    group resumes at the last step and finishes without training: its reconfiguration is recorded all
    the same (it was lost, since records were only closed by a first step)."""
    c, _, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, steps=10, interval=5)
    advance(c, lambda c: c.step_done >= 10)
    real = G.checkpoint

    def dies_once(self, *, blocking=True):
        G.checkpoint = real
        raise WorkerFailure(FailureKind.WORKER_DIED, "a worker died during checkpoint")
    G.checkpoint = dies_once
    advance(c, lambda c: c.state.name.is_terminal)
    assert str(c.state.name) == "SUCCEEDED"
    (rc,) = changes(c)
    assert rc.cause == "failure" and rc.resumed_step == 10 and rc.first_step_time is None


def test_bad_resize_is_rejected_in_the_callers_thread(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2})
    with pytest.raises(ValueError, match="max_workers=1 is less than min_workers=2"):
        c.send(SetWorkers(min_workers=2, max_workers=1))


def test_status_reports_layout_and_world_size_of_one_plan_while_a_group_re_forms(tmp_path):
    """Polled from another thread mid-resize, status must not pair the new group's size with the old
    layout (or the other way round)."""
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2})
    advance(c, lambda c: c.step_done >= 3)
    seen = []
    start = G.scale_to

    def scale_to(self, nodes):
        out = start(self, nodes)
        seen.append(c.status().to_dict())  # members changed, plan not yet: what an API poll would see now
        return out
    G.scale_to = scale_to
    c.send(SetWorkers(workers=2))
    advance(c, lambda c: c.group.size == 2 and c.plan.world_size == 2 and c.step_done >= 5)
    assert seen
    for st in seen + [c.status().to_dict()]:
        lay = st["layout"]
        assert lay["dp_replicate"] * lay["dp_shard"] * lay["tp"] * lay["pp"] == st["world_size"], st


def test_the_real_group_and_the_fakes_satisfy_the_group_protocol(tmp_path):
    from service.pool.group import Group
    from service.pool.worker_group import WorkerGroup
    from tests.fakes import FakeGroup, GatedGroup

    wanted = [m for m in vars(Group) if not m.startswith("_")]  # every method and property it declares
    assert {"carry_on", "salvage", "reshard", "size"} <= set(wanted)
    for cls in (WorkerGroup, FakeGroup, GatedGroup):
        missing = [m for m in wanted if not hasattr(cls, m)]
        assert not missing, (cls.__name__, missing)
    c, _, G = make_coordinator(tmp_path, {"a": 2})
    advance(c, lambda c: c.group is not None)
    assert isinstance(c.group, Group)


def test_each_state_but_the_final_one_has_one_handler_and_every_lifecycle_state_a_value(tmp_path):
    import typing

    from service.control.state import JobState
    from service.control.states import Ended, State, Waiting

    c, _, _ = make_coordinator(tmp_path, {"a": 2})
    classes = set(typing.get_args(State))
    assert set(c._handlers) == classes - {Ended}
    names = {cls.name for cls in classes if cls not in (Waiting, Ended)}
    names |= {JobState.QUEUED, JobState.WAITING_FOR_CAPACITY} | {s for s in JobState if s.is_terminal}
    assert names == set(JobState)


def test_a_configuration_error_on_a_worker_fails_the_job_without_a_restart(tmp_path):
    c, _, G = make_coordinator(tmp_path, {"a": 2})
    advance(c, lambda c: c.step_done >= 2)
    G.fail_next.append(FailureKind.CONFIG_REJECTED)  # as a worker's ConfigError comes back (WorkerGroup._failure)
    advance(c, lambda c: c.state.name.is_terminal)
    assert str(c.state.name) == "FAILED" and "configuration cannot run" in c.state.reason
    assert [f.kind for f in c.failures] == [FailureKind.CONFIG_REJECTED]  # failed at the first, never re-formed
    assert len([e for e in c.events_since(0) if e["kind"] == "resize"]) == 1


def test_a_job_asking_for_gpus_on_a_cluster_with_none_says_so(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2}, resources={"gpus_per_worker": 1})
    advance(c, lambda c: str(c.state.name) == "WAITING_FOR_CAPACITY")
    assert "needs 1 GPU (resources.gpus_per_worker) and the cluster has none" in c.state.reason


def test_a_stop_while_the_group_has_no_members_ends_stopped_without_a_save(tmp_path):
    """A group whose members are all gone (e.g. waiting for capacity after every node left) has nothing to
    checkpoint: a Stop ends the job STOPPED at the last commit instead of asking no workers for a save."""
    c, _, _ = make_coordinator(tmp_path, {"a": 2}, settle=1e9, interval=5)
    advance(c, lambda c: c.step_done >= 7)
    committed = c.committed_step
    c.group.members = []

    def no_save(**_):
        raise AssertionError("a group without members was asked for a checkpoint")

    c.group.checkpoint = no_save
    c.send(Stop())
    advance(c, lambda c: c.state.name.is_terminal)
    assert str(c.state.name) == "STOPPED" and c.committed_step == committed


# FSDP over 4 workers on nodes a (ranks 0, 1) and b (ranks 2, 3): each rank's peer snapshot lives on the
# other node (0 <-> 2, 1 <-> 3). Node b dies at step 7 with snapshot 6 complete everywhere.
SNAPS_AFTER_B = {0: {0: (5, 6), 2: (5, 6)}, 1: {1: (5, 6), 3: (5, 6)}}


def _fsdp_with_snapshots(tmp_path, snapshots):
    c, cluster, G = make_coordinator(tmp_path, {"a": 2, "b": 2}, settle=1e9, interval=5,
                                     parallel={"dp_mode": "shard"})
    G.heals, G.snapshots = True, snapshots
    advance(c, lambda c: c.step_done >= 7)
    return c, cluster, G


def test_a_lost_node_of_fsdp_shards_is_formed_from_the_survivors_peer_snapshots(tmp_path):
    c, cluster, G = _fsdp_with_snapshots(tmp_path, SNAPS_AFTER_B)
    cluster.dead.add("b")
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 7)
    rc = c.reconfigs[-1]
    assert rc.cause == "failure" and rc.transfer.path == "memory" and rc.transfer.snapshot_step == 6
    assert rc.step_before == 7 and rc.resumed_step == 6 and rc.steps_lost == 1  # not the step-5 commit
    assert G.resharded[-1] == {"survivors": [0, 1], "serve": {0: 0, 1: 1, 2: 0, 3: 1}, "snapshot_step": 6}
    assert not [e for e in c.events_since(0) if e["kind"] == "fallback"]


def test_a_rank_lost_with_the_buddy_that_kept_its_copy_falls_back_to_storage_and_says_why(tmp_path):
    # rank 1's copy of rank 3 is gone with it (a double fault): nobody holds shard 3
    c, cluster, G = _fsdp_with_snapshots(tmp_path, {0: {0: (5, 6), 2: (5, 6)}, 1: {1: (5, 6)}})
    cluster.dead.add("b")
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 6)
    (fallback,) = [e for e in c.events_since(0) if e["kind"] == "fallback"]
    assert "no survivor holds a copy of old rank(s) [3]" in fallback["reason"]
    assert "a rank and the buddy that kept its copy were both lost" in fallback["reason"]
    assert "last committed checkpoint (step 5)" in fallback["reason"]
    rc = c.reconfigs[-1]
    assert rc.transfer.path == "storage" and rc.resumed_step == 5


def test_a_fault_while_forming_from_memory_asks_the_survivors_again(tmp_path):
    c, cluster, G = _fsdp_with_snapshots(tmp_path, SNAPS_AFTER_B)
    cluster.dead.add("b")
    G.fail_next.append("transfer")
    advance(c, lambda c: len(c.reconfigs) == 2 and c.step_done >= 7)
    assert [r["snapshot_step"] for r in G.resharded] == [6, 6]  # their snapshots outlived the failed transfer
    assert c.reconfigs[-1].transfer.path == "memory" and c.reconfigs[-1].resumed_step == 6
    failures = [(e["reason"], e["details"]["during"]) for e in c.events_since(0) if e["kind"] == "failure"]
    # one event per failure: the node's loss, then the transfer's (the recovery asks the survivors again)
    assert failures == [("a node hosting workers is gone", "training"), ("a worker died during state transfer",
                                                                         "transfer")]
