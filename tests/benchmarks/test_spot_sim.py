"""benchmarks/spot_sim.py: event handling on tiny literal traces, the ideal as an upper bound, a system
above it failing the run, the sensitivity sweep's shape, and the check against a replay JSON."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from benchmarks.spot_sim import (SWEEP, Cause, Common, ElastronCosts, Elastron, Event, Fixed, Hardware, Job, Kind,
                                 Params, RayTrain, RayTrainCosts, Size, SizeTable, System, check_replay, grid,
                                 ideal_tokens, job_8b, main, one_at_a_time, replay_scenario, run_job, simulate, top_two,
                                 with_notices)
from models.config import model_config

# 1-3 nodes train 100 / 200 / 300 tokens/s; a step is 300 tokens (1 s at 3 nodes)
TABLE = SizeTable(tuple([Size(0, "-", 0, 0, 0.0, 0.0)] + [Size(n, f"dp={n}", n, 1, 1.0, 100.0 * n) for n in (1, 2, 3)]))
JOB = Job(name="toy", model=model_config("tiny"), params=1.0, seq_len=1, global_batch=300, micro_batch=1,
          tokens_per_gpu_s=100.0, ref_nodes=1, plan_s=0.0)
# every cost zero but the ones a test names; bandwidths so large that moving bytes takes no time
QUIET = Params(common=Common(notice_share=0.0, kill_detect_s=2.0, ckpt_interval_s=50.0, ckpt_block_s=0.0, build_s=0.0,
                             compile_cold_s=0.0, compile_warm_s=0.0, comm_init_s=0.0),
               hardware=Hardware(gpus_per_node=1, network_gbit_s=1e12, object_store_gbit_s=1e12, d2h_gbyte_s=1e12),
               elastron=ElastronCosts(settle_s=10.0, joiner_start_s=5.0, handover_s=0.0, rendezvous_s=0.0, form_s=1.0,
                                      failure_handled_s=0.0),
               raytrain=RayTrainCosts(autoscaler_tick_s=20.0, monitor_interval_s=5.0, preemption_poll_s=5.0,
                                      group_stop_s=3.0, group_start_s=4.0, stale_start_timeout_s=60.0))


def ev(*rows):
    return [Event(float(t), Kind(k), n) for t, k, n in rows]


def run(cls, events, end, params=QUIET, **kw):
    return simulate(cls(JOB, TABLE, params, **kw), events, end)


def test_notices_lead_their_removal_by_the_notice_but_never_before_the_add():
    events = ev((0, "add", "a"), (0, "add", "b"), (50, "add", "c"), (100, "remove", "c"), (300, "remove", "a"))
    got = with_notices(events, share=1.0, notice_s=120.0, seed=0)
    assert [(e.t, e.kind.value, e.node) for e in got if e.kind is Kind.NOTICE] == [(50.0, "notice", "c"),
                                                                                 (180.0, "notice", "a")]
    assert [(e.t, e.kind.value) for e in got][2:4] == [(50.0, "add"), (50.0, "notice")]  # at one instant: add first
    assert not [e for e in with_notices(events, share=0.0, notice_s=120.0, seed=0) if e.kind is Kind.NOTICE]


def test_elastron_grows_once_the_offer_settled_and_the_joiner_is_warm():
    events = ev((0, "add", "a"), (0, "add", "b"), (100, "add", "c"), (200, "add", "d"))
    r = run(Elastron, events, 200.0)
    # the policy decides between steps (1.5 s at 2 nodes): it sees c at 100.5 and starts its worker (warm at
    # 105.5); the settle ends at 110.5, so it grows at the step's end at 111; a 1 s move, then 3 nodes
    assert r.events == {"grow": 1}
    assert r.trained_tokens == pytest.approx(200 * 111 + 300 * 88)
    assert r.lost[str(Cause.JOIN)] == pytest.approx(100 * 11 + 300 * 1)
    assert ideal_tokens(events, TABLE, 200.0) == pytest.approx(200 * 100 + 300 * 100)


def test_an_add_during_the_settle_restarts_it():
    events = ev((0, "add", "a"), (100, "add", "b"), (105, "add", "c"), (300, "add", "d"))
    r = run(Elastron, events, 300.0)
    # 3 s steps at 1 node: b seen at 102, c at 105 (a step's end) restarts the settle to 115; the step
    # in flight then ends at 117: one growth to 3 there, not two
    assert r.events == {"grow": 1}
    assert r.trained_tokens == pytest.approx(100 * 117 + 300 * 182)


def test_a_joiners_warm_up_starts_at_the_decision_that_sees_its_node():
    events = ev((0, "add", "a"), (100, "add", "b"), (300, "add", "d"))
    slow = drain_params(settle_s=0.0, joiner_start_s=5.0)
    r = run(Elastron, events, 300.0, slow)
    # b seen at 102 (the 3 s step's end), warm at 107, grown at the next step's end, 108; moved by 109
    assert r.events == {"grow": 1}
    assert r.trained_tokens == pytest.approx(100 * 108 + 200 * 191)


def test_elastron_drains_a_notice_without_a_deadline_at_once_and_loses_nothing_at_the_removal():
    events = ev((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (100, "notice", "c"), (220, "remove", "c"),
                (300, "add", "x"))
    r = run(Elastron, events, 300.0)
    # 3 nodes until the notice, a 1 s move, then 2 nodes; the drained node's last 119 s go to the notice
    assert r.events == {"drain": 1}
    assert r.trained_tokens == pytest.approx(300 * 100 + 200 * 199)
    assert r.lost[str(Cause.NOTICE)] == pytest.approx(300 * 1 + 100 * 119)
    assert r.lost[str(Cause.REDONE)] == 0


def drain_params(**kw) -> Params:
    return dataclasses.replace(QUIET, elastron=dataclasses.replace(QUIET.elastron, **kw))


NOTICED = [Event(0.0, Kind.ADD, "a"), Event(0.0, Kind.ADD, "b"), Event(0.0, Kind.ADD, "c"),
           Event(100.0, Kind.NOTICE, "c", deadline=220.0), Event(220.0, Kind.REMOVE, "c"), Event(300.0, Kind.ADD, "x")]
"""c noticed at 100 with AWS's 120 s: its deadline, 220, is its removal."""


def test_elastron_trains_on_with_a_noticed_node_until_its_deadline_less_the_lead():
    # no move measured yet: lead = max(5, 1.5 x (the 1 s step at 3 nodes + the assumed 2 s)) = 5 s: moves at 215
    r = run(Elastron, NOTICED, 300.0, drain_params(drain_margin=1.5, drain_floor_s=5.0, drain_move_s=2.0))
    assert r.events == {"drain": 1}
    assert r.trained_tokens == pytest.approx(300 * 215 + 200 * 84)  # 1 s move (form), then 2 nodes from 216
    assert r.lost[str(Cause.NOTICE)] == pytest.approx(300 * 1 + 100 * 4)
    assert r.lost[str(Cause.REDONE)] == 0
    # the defaults: the assumed 40 s move makes the lead 1.5 x 41 = 61.5 s, so it moves at the end of the
    # step in flight at 158.5, 159
    r = run(Elastron, NOTICED, 300.0)
    assert r.events == {"drain": 1} and r.trained_tokens == pytest.approx(300 * 159 + 200 * 140)


def test_a_measured_move_shortens_the_lead_and_margin_zero_moves_at_once():
    # c seen at 21 (1.5 s steps at 2 nodes), settled at 31, grown at 31.5; that move off takes 0 s here, so
    # the lead is the 5 s floor: the group moves off c at the first step's end after 215 (steps from 32.5)
    grown = [Event(0.0, Kind.ADD, "a"), Event(0.0, Kind.ADD, "b"), Event(20.0, Kind.ADD, "c"),
             Event(100.0, Kind.NOTICE, "c", deadline=220.0), Event(220.0, Kind.REMOVE, "c"), Event(300.0, Kind.ADD, "x")]
    r = run(Elastron, grown, 300.0, drain_params(drain_floor_s=5.0))
    assert r.events == {"grow": 1, "drain": 1}
    assert r.trained_tokens == pytest.approx(200 * 31.5 + 300 * (215.5 - 32.5) + 200 * 83.5)
    at_once = run(Elastron, NOTICED, 300.0, drain_params(drain_margin=0.0))
    assert at_once.trained_tokens == pytest.approx(300 * 100 + 200 * 199)


def test_a_drain_takes_the_warm_joiners_along_and_leaves_a_cold_one_to_a_growth():
    def drained(notice_at: float):
        events = [Event(0.0, Kind.ADD, "a"), Event(0.0, Kind.ADD, "b"), Event(0.0, Kind.ADD, "c"),
                  Event(100.0, Kind.ADD, "d"), Event(notice_at, Kind.NOTICE, "c", deadline=230.0),
                  Event(230.0, Kind.REMOVE, "c"), Event(300.0, Kind.ADD, "x")]
        return run(Elastron, events, 200.0, drain_params(drain_margin=0.0))
    # d's worker starts at 100 (a step's end) and is warm at 105: a drain at 107 moves onto a, b and d
    r = drained(107.0)
    assert r.events == {"drain": 1}
    assert r.trained_tokens == pytest.approx(300 * 107 + 300 * 92)
    # at 102 it is not: the drain leaves 2 nodes, and d joins by a growth, whose settle starts again after
    # the move (at 103, to 113): at the end of the step in flight then (1.5 s steps from 103: 113.5)
    r = drained(102.0)
    assert r.events == {"drain": 1, "grow": 1}
    assert r.trained_tokens == pytest.approx(300 * 102 + 200 * 10.5 + 300 * 85.5)


def test_a_lead_longer_than_the_notice_moves_at_once_and_a_late_move_off_is_counted():
    short = [Event(0.0, Kind.ADD, "a"), Event(0.0, Kind.ADD, "b"), Event(0.0, Kind.ADD, "c"),
             Event(200.0, Kind.NOTICE, "c", deadline=205.0), Event(205.0, Kind.REMOVE, "c"), Event(300.0, Kind.ADD, "x")]
    r = run(Elastron, short, 300.0, drain_params(handover_s=10.0))  # lead 1.5 x (1 + 40) > 5 s: at once
    assert r.events == {"drain": 1, "drain, moved off after its deadline": 1}  # its hand-over ends at 210
    assert r.trained_tokens == pytest.approx(300 * 200 + 200 * 89)


def test_a_loss_without_notice_redoes_the_step_in_flight_and_reforms_from_peers():
    events = ev((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (100.5, "remove", "c"), (200, "add", "x"))
    r = run(Elastron, events, 200.0)
    # the 1 s step in flight is half done (the snapshot round of a tiny state ends at once), detect 2 s, move 1 s
    assert r.events == {"loss, from peers": 1}
    assert r.lost[str(Cause.REDONE)] == pytest.approx(0.5 * 300)
    assert r.trained_tokens == pytest.approx(300 * 100.5 - 150 + 200 * 96.5)


# 0.75 GB of state over 1 GB/s: a snapshot round at 3 nodes takes 0.25 s; a growth from 1 to 3 nodes
BIG = dataclasses.replace(JOB, params=0.75e9 / 12)
SLOW = dataclasses.replace(QUIET, hardware=dataclasses.replace(QUIET.hardware, network_gbit_s=8.0, transfer_efficiency=1.0))


def test_a_loss_inside_the_snapshot_round_redoes_one_step_more_unless_replicated():
    def redone(at: float, job: Job) -> float:
        events = ev((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (at, "remove", "c"), (200, "add", "x"))
        return simulate(Elastron(job, TABLE, SLOW), events, 200.0).lost[str(Cause.REDONE)]
    assert redone(100.2, BIG) == pytest.approx(1.2 * 300)  # 0.2 s into the step: the last step's round is not done
    assert redone(100.5, BIG) == pytest.approx(0.5 * 300)
    assert redone(100.2, dataclasses.replace(BIG, replicated=True)) == pytest.approx(0.2 * 300)


def test_a_replicated_group_reforms_from_a_survivor_when_a_member_and_its_buddy_go():
    events = ev((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (120.5, "remove", "a"), (120.5, "remove", "b"),
                (200, "add", "x"))
    r = simulate(Elastron(dataclasses.replace(JOB, replicated=True), TABLE, QUIET), events, 200.0)
    assert r.events == {"loss, from peers": 1}  # c holds the whole state: no checkpoint read
    assert r.lost[str(Cause.REDONE)] == pytest.approx(0.5 * 300)
    assert r.trained_tokens == pytest.approx(300 * 120.5 - 150 + 100 * 76.5)  # detect 2 s, move 1 s


def test_the_bytes_a_move_sends_depend_on_the_layout_kind():
    sharded, replicated = Elastron(BIG, TABLE, SLOW), Elastron(dataclasses.replace(BIG, replicated=True), TABLE, SLOW)
    assert sharded.wire_s(1, 3) == pytest.approx(0.25)  # each node receives its new third
    assert replicated.wire_s(1, 3) == pytest.approx(1.5)  # the one member sends the whole state to each of 2 joiners
    assert replicated.wire_s(2, 3) == pytest.approx(0.75)
    assert replicated.wire_s(3, 2) == 0.0  # a shrink: the survivors keep their copies


def test_a_node_that_comes_back_after_a_notice_is_usable_again():
    # c noticed and removed at 100, then a new instance in the same slot at 150 (spot_trace.py reuses slots)
    events = [Event(0.0, Kind.ADD, "a"), Event(0.0, Kind.ADD, "b"), Event(0.0, Kind.ADD, "c"),
              Event(100.0, Kind.NOTICE, "c", deadline=100.0), Event(100.0, Kind.REMOVE, "c"), Event(150.0, Kind.ADD, "c"),
              Event(300.0, Kind.ADD, "x")]
    s = Elastron(JOB, TABLE, QUIET)
    r = simulate(s, events, 300.0)
    assert r.events == {"loss, from peers": 1, "grow": 1}
    assert s.members == ("a", "b", "c")


def test_a_loss_right_after_a_move_redoes_nothing():
    # c is noticed at 100 (drained by 101); b vanishes at 101.5, half a second into the new group's life
    events = ev((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (100, "notice", "c"), (101.5, "remove", "b"),
                (200, "add", "x"))
    r = run(Elastron, events, 200.0)
    assert r.events == {"drain": 1, "loss, from peers": 1}
    assert r.lost[str(Cause.REDONE)] == pytest.approx(0.5 * 200)  # its half second at 2 nodes, not half a step


def test_losing_a_member_and_its_buddy_at_once_restores_from_the_checkpoint():
    # a's snapshot is on b (the next member): both gone in one batch, so the group restarts from storage
    events = ev((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (120, "remove", "a"), (120, "remove", "b"),
                (200, "add", "x"))
    r = run(Elastron, events, 200.0)
    assert r.events == {"loss, from storage": 1}
    # checkpoints every 50 training seconds: the last at 100, so 20 s at 300 tokens/s are redone
    assert r.lost[str(Cause.REDONE)] == pytest.approx(20 * 300)
    assert r.trained_tokens == pytest.approx(300 * 120 - 6000 + 100 * 78)  # detect 2 s, restart (no costs) on c


def test_ray_train_restarts_every_worker_at_its_next_tick_and_redoes_since_the_checkpoint():
    events = ev((0, "add", "a"), (0, "add", "b"), (130, "add", "c"), (400, "add", "x"))
    r = run(RayTrain, events, 400.0)
    # decided at 130 + 20 + 5 = 155; stop 3 s + start 4 s; the checkpoint at 150 (every 50 s) is 5 s old
    assert r.events == {"grow": 1}
    assert r.lost[str(Cause.REDONE)] == pytest.approx(5 * 200)
    assert r.trained_tokens == pytest.approx(200 * 155 - 1000 + 300 * (400 - 162))


def test_ray_train_saves_once_on_a_notice_and_still_restarts_at_the_removal():
    events = ev((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (110, "notice", "c"), (140, "remove", "c"),
                (400, "add", "x"))
    r = run(RayTrain, events, 400.0)
    # the just-in-time save at 115 leaves 25 s to redo; detect 2 + stale start 60 + start 4 s
    assert r.events == {"loss": 1}
    assert r.lost[str(Cause.REDONE)] == pytest.approx(25 * 300)
    assert r.trained_tokens == pytest.approx(300 * 140 - 7500 + 200 * (400 - 206))


def test_a_loss_while_ray_train_waits_to_grow_takes_the_new_node_and_later_growth_still_happens():
    events = ev((0, "add", "a"), (0, "add", "b"), (100, "add", "c"), (110, "remove", "a"), (300, "add", "d"),
                (500, "add", "x"))
    r = run(RayTrain, events, 500.0)
    # the loss at 110 restarts on b and c (the pending growth is void); d at 300 is a growth at 325
    assert r.events == {"loss": 1, "grow": 1}


def test_the_fixed_job_ignores_nodes_beyond_its_size_and_waits_for_enough():
    events = ev((0, "add", "a"), (0, "add", "b"), (0, "add", "c"), (60, "remove", "c"), (100, "remove", "b"),
                (150, "add", "d"), (300, "add", "x"))
    r = run(Fixed, events, 300.0, size=2)
    # c is not a member: nothing happens at 60; b's loss at 100 leaves 1 node: wait until d at 150, then restart
    assert r.events == {"loss": 1, "start": 1}
    assert r.lost[str(Cause.REDONE)] == pytest.approx(0)  # the checkpoint at 100 (every 50 s) is exactly the loss time
    assert r.trained_tokens == pytest.approx(200 * 100 + 200 * (300 - 154))
    assert r.lost[str(Cause.IDLE)] == pytest.approx(100 * 60)


@pytest.mark.parametrize("seed", range(6))
def test_no_system_exceeds_the_ideal_on_random_traces(seed):
    rng = random.Random(seed)
    alive, t, rows = [], 0.0, [(0, "add", "n0")]
    alive.append("n0")
    for i in range(1, 60):
        t += rng.choice([0.0, 5.0, 40.0, 200.0])
        if alive and (len(alive) >= 3 or rng.random() < 0.5):
            rows.append((t, "remove", alive.pop(rng.randrange(len(alive)))))
        else:
            rows.append((t, "add", f"n{i}"))
            alive.append(f"n{i}")
    trace = ev(*rows)
    params = dataclasses.replace(QUIET, common=dataclasses.replace(QUIET.common, notice_share=0.5, seed=seed))
    events = with_notices(trace, share=0.5, notice_s=120.0, seed=seed)
    ideal = ideal_tokens(events, TABLE, trace[-1].t)
    for cls, kw in ((Elastron, {}), (RayTrain, {}), (Fixed, {"size": 1}), (Fixed, {"size": 2})):
        r = run(cls, events, trace[-1].t, params, **kw)
        assert r.trained_tokens <= ideal * (1 + 1e-9), (cls.name, kw)
        assert r.trained_tokens + sum(r.lost.values()) == pytest.approx(ideal, rel=1e-9)  # every token accounted


def test_every_system_stays_under_the_ideal_on_the_whole_trace():
    from benchmarks.spot_sim import TRACE, load_trace
    result = run_job(job_8b(), load_trace(TRACE), Params())
    assert result.errors == []
    assert {r.system for r in result.rows} == {"elastron", "raytrain", "fixed"}
    assert all(0 < result.of_ideal(r.system) < 1 for r in result.rows)


class AboveIdeal(System):
    """A broken model: it trains at the best rate of any size whatever is alive."""

    name = "above"

    def react(self, t, batch):
        pass

    def timer(self, t, name):
        pass

    def advance(self, t):
        self.trained += self.table.sizes[-1].tokens_s * max(0.0, t - self.t)
        self.t = t


TINY_TRACE = "0,add,a\n0,add,b\n600000,add,c\n1200000,remove,a\n1800000,add,d\n"


def test_a_system_above_the_ideal_fails_the_run(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(TINY_TRACE)
    out = tmp_path / "r.json"
    rc = main(["--trace", str(trace), "--jobs", "8b", "--no-sweep", "--json", str(out)], systems={"above": AboveIdeal})
    assert rc == 1
    assert "above the ideal" in capsys.readouterr().err
    assert json.loads(out.read_text())["errors"]
    assert main(["--trace", str(trace), "--jobs", "8b", "--no-sweep"]) == 0


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--set", "common.nope=1", "--no-sweep"]) == 2
    assert main(["--set", "common.kill_detect_s=soon", "--no-sweep"]) == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("0,join,a\n")
    assert main(["--trace", str(bad), "--no-sweep"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("spot_sim: ") for line in err)


def test_the_sweep_has_both_alternatives_per_parameter_and_a_three_by_three_grid(tmp_path):
    trace = ev(*[(0, "add", f"n{i}") for i in range(4)], (600, "remove", "n1"), (1200, "add", "m"),
               (1800, "remove", "n2"), (2400, "add", "k"))
    params = Params(common=Common(ckpt_interval_s=300.0))
    rows = one_at_a_time([job_8b()], trace, params)
    assert len(rows) == 2 * len(SWEEP)
    assert {(r["param"], r["value"]) for r in rows} == {(k, v) for k, vs in SWEEP for v in vs}
    keys = top_two(rows)
    assert len(keys) == 2 and set(keys) <= dict(SWEEP).keys()
    g = grid([job_8b()], trace, params, keys)
    assert len(g) == 9 and all({"elastron", "raytrain", "fixed", "job", *keys} <= r.keys() for r in g)


def test_params_set_changes_one_field_and_names_the_fields_when_wrong():
    p = Params().set("common.kill_detect_s=50").set("fixed.nodes=12")
    assert (p.common.kill_detect_s, p.fixed.nodes, p.common.comm_init_s) == (50.0, 12, Common().comm_init_s)
    with pytest.raises(ValueError, match="fields: "):
        Params().set("common.kill=1")
    with pytest.raises(ValueError, match="GROUP.FIELD=VALUE"):
        Params().set("kill_detect_s")


def synthetic_replay(goodput: float) -> dict:
    """One replay of benchmarks/spot_trace.py --out, 2 simulated nodes, one lost without notice at 50 s of
    100 and back at 90 s."""
    return {"k": 2, "k0": 2, "replay_s": 100.0, "global_batch_size": 12, "notice_s": 6.0, "window": "busiest",
            "clock": {"elastron": {"settle_seconds": {"default_s": 10.0, "set_s": 1.0}}},
            "ideal_throughput_by_size": {"1": 100.0, "2": 200.0},
            "actions": [{"at": 50.0, "kind": "remove", "slot": 1, "notice": False},
                        {"at": 90.0, "kind": "add", "slot": 1, "notice": False}],
            "systems": {"elastron": {"analysis": {"goodput_samples_per_s": goodput}}}}


def test_the_replay_check_compares_simulated_and_measured_goodput():
    first = check_replay(synthetic_replay(150.0))
    sim = first["simulated_samples_per_s"]
    assert first["events"] == {"loss, from peers": 1, "grow": 1}  # 2 nodes at the start, slot 1 lost, then back
    assert first["params"]["elastron"]["settle_s"] == 1.0  # the replay's clock, not the default
    assert 0 < first["simulated_of_ideal"] < 1
    assert sim < (200 * 50 + 100 * 40 + 200 * 10) / 100  # below the ideal's 160 samples/s
    assert check_replay(synthetic_replay(sim * 1.05))["within"]
    assert not check_replay(synthetic_replay(sim * 1.25))["within"]
    with pytest.raises(ValueError, match="lacks"):
        check_replay({"k0": 2})


def test_the_replays_stall_before_its_first_event_is_left_out_of_its_time():
    replay = synthetic_replay(1.5)
    replay["systems"]["elastron"]["analysis"] |= {"wall_s": 100.0, "stall_s": {"start": 25.0, "join": 3.0}}
    c = check_replay(replay)
    assert (c["measured_start_stall_s"], c["measured_samples_per_s_after_start"]) == (25.0, pytest.approx(2.0))
    assert c["relative_difference"] == pytest.approx(c["simulated_samples_per_s"] / 2.0 - 1)


def test_the_replay_check_counts_the_step_in_flight_at_the_end_and_the_replays_own_rates():
    replay = synthetic_replay(1.2)
    el = replay["systems"]["elastron"]
    el["analysis"] |= {"wall_s": 100.0, "own_throughput_by_size": {"2": 150.0}}
    # step 11 ends 1 s after the window's end (t0 + 100): 3 of its 4 s were done by then
    el |= {"t0": 1000.0, "rows": [{"time": 1097.0, "step": 10, "world_size": 2},
                                  {"time": 1101.0, "step": 11, "world_size": 2}]}
    c = check_replay(replay)
    assert c["measured_step_in_flight_at_end"] == 0.75
    assert c["measured_samples_per_s_after_start"] == pytest.approx((1.2 * 100 + 0.75 * 12) / 100)
    assert c["size_table"] == {1: 100.0, 2: 150.0}  # measured at 2 workers, the ideal's at 1
    assert [x["event"] for x in c["timeline"] if "event" in x] == ["loss, from peers", "grow"]
    assert c["timeline"][0] | {"from_s": 0.0} == {"from_s": 0.0, "to_s": 50.0, "phase": "training", "workers": 2}
    el["rows"][1]["step"] = 10  # the row after the end redoes a step: nothing was in flight towards step 11
    assert check_replay(replay)["measured_step_in_flight_at_end"] == 0.0


def test_a_replay_event_at_0_s_comes_after_the_start_at_k0_nodes():
    replay = synthetic_replay(1.0)
    replay["actions"][0]["at"] = 0.0  # slot 1 lost as the replay starts: a loss, not a start on one node
    assert check_replay(replay)["events"] == {"loss, from peers": 1, "grow": 1}


def test_the_replay_is_simulated_as_executed_with_the_layout_kind_the_product_chose():
    replay = synthetic_replay(1.0)
    replay["actions"] = [{"at": 40.0, "kind": "notice", "slot": 1, "notice": False},
                         {"at": 44.0, "kind": "remove", "slot": 1, "notice": True},
                         {"at": 90.0, "kind": "add", "slot": 1, "notice": False}]
    replay["systems"]["elastron"] |= {
        "replay": [{"kind": "notice", "slot": 1, "at": 40.0, "took_s": 0.01},
                   {"kind": "remove", "slot": 1, "at": 44.01, "took_s": 0.07},
                   {"kind": "add", "slot": 1, "at": 90.5, "took_s": 1.5}],  # the node's start ended at 92
        "extra": {"reconfigurations": [{"new_layout": {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1}}]}}
    events, _, job, _ = replay_scenario(replay)
    # the notice's deadline is its removal (4 s: shorter than notice_s), not the notice + 6 s
    assert [(e.t, e.kind.value, e.node, e.deadline) for e in events if e.t >= 0] == [
        (40.0, "notice", "s1", 44.01), (44.01, "remove", "s1", None), (92.0, "add", "s1", None)]
    assert job.replicated
    replay["systems"]["elastron"]["extra"]["reconfigurations"][0]["new_layout"]["dp_shard"] = 2
    assert not replay_scenario(replay)[2].replicated
    del replay["systems"]["elastron"]["replay"]  # no record of the execution: the planned times
    assert [e.t for e in replay_scenario(replay)[0] if e.t >= 0] == [40.0, 44.0, 90.0]


def test_the_replay_check_on_the_command_line_judges_every_replay(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(TINY_TRACE)
    sim = check_replay(synthetic_replay(1.0))["simulated_samples_per_s"]
    paths = []
    for i, factor in enumerate((0.95, 1.08)):  # measured 5% below and 8% above the simulation: both within 10%
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(synthetic_replay(sim * factor)))
    base = ["--trace", str(trace), "--jobs", "8b", "--no-sweep", "--json", str(tmp_path / "o.json")]
    assert main(base + ["--check-replay", *map(str, paths)]) == 0
    check = json.loads((tmp_path / "o.json").read_text())["replay_check"]
    assert len(check["replays"]) == 2 and check["within"]
    far = [tmp_path / "low.json", tmp_path / "high.json"]  # +-20%: their signed mean is 0, yet neither is within
    far[0].write_text(json.dumps(synthetic_replay(sim / 1.2)))
    far[1].write_text(json.dumps(synthetic_replay(sim / 0.8)))
    assert main(base + ["--check-replay", *map(str, far)]) == 3
    assert "off a replay" in capsys.readouterr().err


def test_the_model_against_the_committed_idle_box_replays_gives_the_documented_figures():
    from benchmarks.spot_sim import ROOT
    got = {}
    for window in ("busiest", "calm", "median"):
        path = ROOT / "benchmarks" / "results" / "spot-trace-emulated-k4-quiet" / f"{window}-events-seed0.json"
        c = check_replay(json.loads(path.read_text()))
        got[window] = (round(c["simulated_samples_per_s"], 2), round(c["measured_samples_per_s_after_start"], 2),
                       round(100 * c["relative_difference"], 1), c["within"])
    assert got == {"busiest": (1.73, 1.76, -1.8, True), "calm": (3.56, 3.56, 0.1, True),
                   "median": (2.65, 2.62, 1.1, True)}  # docs/benchmarks.md, spot_sim.py
