"""The spot replay's pure parts: trace -> windows -> schedule (benchmarks/spot_schedule.py), the clock
(spot_clock.py) and the figures (spot_figures.py). The replay itself (Ray clusters, three systems) is the
benchmark's run, not a test."""

from __future__ import annotations

import pytest

from benchmarks.spot_clock import Clock
from benchmarks.spot_figures import (StallCause, above_ideal, analyse, best_by_size, charge, ideal_samples,
                                     loss_agreement, steady_throughput, summarize)
from benchmarks.spot_schedule import (Action, ActionKind, Mapping, TraceEvent, WindowKind, build_schedule,
                                      choose_windows, load_trace, trace_size, window_counts)

JOIN, NOTICED, UNNOTICED, START = StallCause.JOIN, StallCause.NOTICED, StallCause.UNNOTICED, StallCause.START


def _ev(*rows):
    return [TraceEvent(t_s=t, op=op, node=n) for t, op, n in rows]


# 16 instances at t=0, and one more granted and lost later: a trace of size 17
BASE = _ev(*[(0, "add", f"n{i}") for i in range(16)])


def test_events_mapping_keeps_each_event_within_1_to_k_and_notices_lead_their_removal():
    events = BASE + _ev((110, "add", "a"), (120, "add", "b"), (130, "add", "c"),  # the third would make 5
                        (150, "remove", "n0"), (160, "remove", "n1"), (170, "remove", "n2"), (180, "remove", "a"),
                        (400, "add", "late"))  # outside the window
    s = build_schedule(events, start_s=100, window_s=200, k=4, compression=10, notice_share=1.0, seed=3, size=32)
    assert (s.k0, s.duration_s, s.notice_s, s.trace_events) == (2, 20.0, 12.0, 7)
    assert s.dropped == 2  # the fifth node, and the removal that would leave none
    assert [(a.at, a.kind) for a in s.actions if a.kind is ActionKind.ADD] == [(1.0, ActionKind.ADD), (2.0, ActionKind.ADD)]
    removes = [a for a in s.actions if a.kind is ActionKind.REMOVE]
    assert [a.at for a in removes] == [5.0, 6.0, 7.0] and all(a.notice for a in removes)
    for r in removes:  # each notice 12 s ahead, but never before its node was added (slot 2 and 3: at 1 and 2 s)
        n = next(a for a in s.actions if a.kind is ActionKind.NOTICE and a.slot == r.slot)
        added = next((a.at for a in s.actions if a.kind is ActionKind.ADD and a.slot == r.slot), 0.0)
        assert n.at == max(added, r.at - 12.0)
    assert [k for _, k in s.availability] == [2, 3, 4, 3, 2, 1]


def test_the_trace_size_is_read_from_the_file_so_a_trace_of_another_shape_starts_at_its_own_level(tmp_path):
    # 8 instances at most: 6 alive at the window's start is round(6 * 4 / 8) = 3 nodes (with 32 it was 1)
    p = tmp_path / "eight.csv"
    p.write_text("".join(f"0,add,i{i}\n" for i in range(8)) + "50000,remove,i0\n60000,remove,i1\n"
                 "200000,add,i0\n")
    events = load_trace(p)
    assert trace_size(events) == 8
    s = build_schedule(events, start_s=100, window_s=200, k=4, compression=10, notice_share=0.0)
    assert (s.trace_size, s.k0) == (8, 3)
    assert [(a.at, a.kind, a.slot) for a in s.actions] == [(10.0, ActionKind.ADD, 3)]
    scaled = build_schedule(events, start_s=100, window_s=200, k=4, compression=10, notice_share=0.0,
                            mapping=Mapping.SCALED)
    assert [k for _, k in scaled.availability] == [3, 4]  # 7 alive: round(3.5) = 4


def test_the_schedule_is_the_same_for_the_same_seed_and_notices_follow_the_share():
    events = BASE + _ev(*[(100 + 10 * i, "remove" if i % 2 else "add", f"x{i // 2}") for i in range(40)])
    kw = dict(start_s=100, window_s=1000, k=4, compression=5)
    a = build_schedule(events, notice_share=0.5, seed=1, **kw)
    assert a == build_schedule(events, notice_share=0.5, seed=1, **kw)
    assert not any(x.notice for x in build_schedule(events, notice_share=0.0, seed=1, **kw).actions)
    assert all(x.notice for x in build_schedule(events, notice_share=1.0, seed=1, **kw).actions
               if x.kind is ActionKind.REMOVE)


def test_scaled_mapping_follows_alive_times_k_over_the_trace_size():
    events = BASE + _ev(*[(100 + i, "add", f"g{i}") for i in range(8)],
                        *[(200 + i, "remove", f"g{i}") for i in range(4)])
    s = build_schedule(events, start_s=100, window_s=200, k=4, compression=1, notice_share=0, mapping="scaled",
                       size=32)
    # 16 -> 24 alive: 2 -> 3 nodes at the 5th grant (20 alive: 2.5 rounds to 2; 21: 2.625 to 3); back
    # to 20 at the 4th removal
    assert s.k0 == 2 and [k for _, k in s.availability] == [2, 3, 2]
    assert [(a.at, a.kind) for a in s.actions] == [(4.0, ActionKind.ADD), (103.0, ActionKind.REMOVE)]
    assert s.dropped == 12 - 2
    with pytest.raises(ValueError):
        build_schedule(events, start_s=100, window_s=200, k=4, compression=1, notice_share=0, mapping="x")


def test_windows_busiest_median_and_calm_by_events():
    # minutes 1..5 start windows of 2 minutes ending by the last event (t=420): counts 3, 1, 0, 2, 1
    events = _ev((0, "add", "a"), (70, "add", "b"), (100, "remove", "a"), (130, "add", "c"),
                 (300, "remove", "b"), (330, "add", "d"), (420, "remove", "c"))
    assert window_counts(events, 120) == [(60.0, 3), (120.0, 1), (180.0, 0), (240.0, 2), (300.0, 2)]
    assert choose_windows(events, 120) == {WindowKind.BUSIEST: 60.0, WindowKind.MEDIAN: 240.0,
                                           WindowKind.CALM: 180.0}
    with pytest.raises(ValueError, match="window-min"):
        window_counts(events, 600)


def test_a_malformed_trace_line_is_refused_naming_the_line(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("0,add,node1\n60000,remove,node1\n")
    assert load_trace(p) == _ev((0.0, "add", "node1"), (60.0, "remove", "node1"))
    p.write_text("0,add,node1\n0,grant,node1\n")
    with pytest.raises(ValueError, match="t.csv:2"):
        load_trace(p)
    p.write_text("")
    with pytest.raises(ValueError, match="no events"):
        load_trace(p)


def test_every_wait_is_compressed_by_one_rule_above_its_floor():
    c = Clock(10, interval_floor_s=0.5, timeout_floor_s=20)
    e = c.elastron()
    assert (e["settle_seconds"], e["poll_interval_s"], e["suspect_seconds"]) == (1.0, 0.5, 6.0)
    assert (e["start_timeout_s"], e["probe_timeout_s"]) == (20.0, 2.0)  # a timeout never below min(default, floor)
    env = c.ray_env()
    assert env["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] == "0.5" and env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"
    assert env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "20.0"
    assert env["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] == "60.0"
    assert env["SPOT_CLOCK_RAY_TICK_S"] == "2.0" and c.ray_monitor_interval_s() == 6.0
    rec = c.record()
    assert rec["raytrain"]["autoscaling_coordinator_tick_s"] == {"default_s": 20.0, "set_s": 2.0}
    assert rec["notice_s"] == {"default_s": 120.0, "set_s": 12.0}
    with pytest.raises(ValueError, match="compression"):
        Clock(0.5)


def _rows(spec):
    return [{"time": t, "step": s, "world_size": w} for t, s, w in spec]


def test_steady_throughput_leaves_out_each_runs_warmup():
    # 2 workers: two slow first intervals (warm-up), then one step a second; 1 worker after a resize
    rows = _rows([(0, 1, 2), (5, 2, 2), (8, 3, 2), (9, 4, 2), (10, 5, 2), (11, 6, 2),
                  (20, 7, 1), (30, 8, 1), (32, 9, 1), (34, 10, 1)])
    assert steady_throughput(rows, 12, warmup=2) == {2: 12.0, 1: 6.0}
    assert steady_throughput(rows, 12, warmup=0) == {2: 12.0, 1: 6.0}
    # another worker group (attempt) at the same size starts a new run
    two = [{**r, "attempt": 1} for r in _rows([(0, 1, 1), (1, 2, 1), (2, 3, 1)])] + \
          [{**r, "attempt": 2} for r in _rows([(9, 4, 1), (10, 5, 1), (10.5, 6, 1), (11, 7, 1)])]
    assert steady_throughput(two, 12, warmup=1) == {1: 24.0}  # one run: 7 s would count, and the median be 1 s


def test_the_ideal_is_the_best_rate_at_each_size_integrated_over_availability():
    thr = best_by_size({1: 10.0, 2: 18.0}, {2: 20.0, 3: 25.0}, {1: 9.0})
    assert thr == {1: 10.0, 2: 20.0, 3: 25.0}
    # 10 s at 1 node, 5 s at 2, 5 s at 3
    assert ideal_samples([(0, 1), (10, 2), (15, 3)], 20, thr) == pytest.approx(100 + 100 + 125)
    assert ideal_samples([(0, 2), (30, 1)], 20, thr) == pytest.approx(400)  # the window ends first
    with pytest.raises(ValueError, match="4 workers"):
        ideal_samples([(0, 4)], 5, thr)


def test_a_stall_is_charged_to_the_event_that_started_it():
    ev = [(10.0, UNNOTICED), (12.0, JOIN), (30.0, NOTICED)]
    assert charge(9.0, 20.0, ev) == UNNOTICED  # the first event inside the gap, not the join after it
    assert charge(13.0, 20.0, ev) == JOIN  # none inside: the last one before it
    assert charge(1.0, 5.0, ev) == START


def test_goodput_counts_each_step_once_and_stalls_go_to_their_event():
    rows = _rows([(99, 10, 2), (101, 11, 2), (102, 12, 2), (103, 13, 2),
                  # a removal without notice at 103.5: 5 s without a step, resumed from step 11 on 1 worker
                  (108.5, 12, 1), (110.5, 13, 1), (112.5, 14, 1),
                  # a join at 113 acted on late: 4 s to the first step at 2 workers
                  (117.5, 15, 2), (118.5, 16, 2), (119.5, 17, 2)])
    thr = {1: 6.0, 2: 12.0}  # 2 s and 1 s a step
    a = analyse(rows, t0=100, t_end=120, gbs=12, events=[(103.5, UNNOTICED), (113.0, JOIN)], thr=thr, ideal=200.0)
    assert (a["step_start"], a["step_end"], a["steps_counted"], a["steps_trained"]) == (10, 17, 7, 9)
    assert a["steps_redone"] == 2
    assert a["goodput_samples_per_s"] == pytest.approx(7 * 12 / 20)
    assert a["goodput_vs_ideal"] == pytest.approx(84 / 200)
    # 103 -> 108.5 at 1 worker: 5.5 - 2; 112.5 -> 117.5 at 2 workers: 5 - 1 (the join before the gap)
    assert a["stall_s"] == {"start": 0.0, "join": 4.0, "removal with notice": 0.0, "removal without notice": 3.5}
    assert a["stalls"] == {"start": 0, "join": 1, "removal with notice": 0, "removal without notice": 1}
    # a system that never trained in the window stalled through all of it, charged to what started it
    none = analyse(rows[:1], t0=100, t_end=120, gbs=12, events=[(103.5, UNNOTICED)], thr=thr, ideal=200.0)
    assert none["steps_counted"] == 0 and none["stall_s"]["removal without notice"] == 19.0


def test_goodput_above_the_ideal_is_named_and_summary_keeps_failures():
    ok = {"analysis": {"goodput_vs_ideal": 0.9, "goodput_samples_per_s": 9.0}}
    over = {"analysis": {"goodput_vs_ideal": 1.02, "goodput_samples_per_s": 10.2}}
    assert above_ideal({"elastron": ok, "raytrain": over, "fixed": {"error": "TimeoutError: x"}}) == ["raytrain"]
    s = summarize([{"systems": {"elastron": ok, "fixed": {"error": "TimeoutError: x"}}},
                   {"systems": {"elastron": {"analysis": {"goodput_vs_ideal": 0.7, "goodput_samples_per_s": 7.0}},
                                "fixed": ok}}])
    assert s["elastron"]["goodput_vs_ideal"]["mean"] == pytest.approx(0.8)
    assert (s["elastron"]["goodput_vs_ideal"]["min"], s["elastron"]["goodput_vs_ideal"]["max"]) == (0.7, 0.9)
    assert s["fixed"]["failed_replays"] == 1 and s["fixed"]["goodput_vs_ideal"]["n"] == 1


def test_loss_agreement_uses_each_steps_latest_loss():
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 9.9}, {"step": 2, "loss": 4.0}, {"step": 3, "loss": 3.0}]
    ok = loss_agreement(rows, [5.0, 4.0002, 3.0])
    assert ok["within_1e-4"] and ok["steps_compared"] == 3 and ok["max_rel_diff"] == pytest.approx(0.0002 / 4.0002)
    assert not loss_agreement(rows, [5.0, 4.001, 3.0])["within_1e-4"]
    assert loss_agreement(rows, [5.0, 4.0, 3.0, 2.0])["missing"] == [4]
    assert not loss_agreement(rows, [5.0, 4.0, 3.0, 2.0])["within_1e-4"]


def test_action_is_a_value():
    assert Action(at=1.0, kind=ActionKind.ADD, slot=0) == Action(at=1.0, kind=ActionKind.ADD, slot=0)
