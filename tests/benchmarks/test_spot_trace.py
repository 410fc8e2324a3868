"""benchmarks/spot_trace.py's pure parts: the trace -> schedule mapping and the goodput arithmetic.
The replay itself (Ray clusters, three systems) is the benchmark's run, not a test."""

from __future__ import annotations

import pytest

from benchmarks.spot_trace import (JOIN, NOTICED, UNNOTICED, Action, TraceEvent, analyse, build_schedule,
                                   busiest_window, ideal_samples, load_trace, loss_agreement, throughput_by_size)


def _ev(*rows):
    return [TraceEvent(t_s=t, op=op, node=n) for t, op, n in rows]


# 16 instances at t=0 -> round(16 * 4 / 32) = 2 nodes at the window's start (t=100)
BASE = _ev(*[(0, "add", f"n{i}") for i in range(16)])


def test_events_mapping_keeps_each_event_within_1_to_k_and_notices_lead_their_removal():
    events = BASE + _ev((110, "add", "a"), (120, "add", "b"), (130, "add", "c"),  # the third would make 5
                        (150, "remove", "n0"), (160, "remove", "n1"), (170, "remove", "n2"), (180, "remove", "a"),
                        (400, "add", "late"))  # outside the window
    s = build_schedule(events, start_s=100, window_s=200, k=4, compression=10, notice_share=1.0, seed=3)
    assert (s.k0, s.duration_s, s.notice_s, s.trace_events) == (2, 20.0, 12.0, 7)
    assert s.dropped == 2  # the fifth node, and the removal that would leave none
    assert [(a.at, a.kind) for a in s.actions if a.kind == "add"] == [(1.0, "add"), (2.0, "add")]
    removes = [a for a in s.actions if a.kind == "remove"]
    assert [a.at for a in removes] == [5.0, 6.0, 7.0] and all(a.notice for a in removes)
    for r in removes:  # each notice 12 s ahead, but never before its node was added (slot 2 and 3: at 1 and 2 s)
        n = next(a for a in s.actions if a.kind == "notice" and a.slot == r.slot)
        added = next((a.at for a in s.actions if a.kind == "add" and a.slot == r.slot), 0.0)
        assert n.at == max(added, r.at - 12.0)
    assert [k for _, k in s.availability] == [2, 3, 4, 3, 2, 1]
    assert s.actions == tuple(sorted(s.actions, key=lambda a: (a.at, {"add": 0, "notice": 1, "remove": 2}[a.kind])))


def test_the_schedule_is_the_same_for_the_same_seed_and_notices_follow_the_share():
    events = BASE + _ev(*[(100 + 10 * i, "remove" if i % 2 else "add", f"x{i // 2}") for i in range(40)])
    kw = dict(start_s=100, window_s=1000, k=4, compression=5)
    a = build_schedule(events, notice_share=0.5, seed=1, **kw)
    assert a == build_schedule(events, notice_share=0.5, seed=1, **kw)
    assert not any(x.notice for x in build_schedule(events, notice_share=0.0, seed=1, **kw).actions)
    assert all(x.notice for x in build_schedule(events, notice_share=1.0, seed=1, **kw).actions if x.kind == "remove")


def test_scaled_mapping_follows_alive_times_k_over_32():
    events = BASE + _ev(*[(100 + i, "add", f"g{i}") for i in range(8)],
                        *[(200 + i, "remove", f"g{i}") for i in range(4)])
    s = build_schedule(events, start_s=100, window_s=200, k=4, compression=1, notice_share=0, mapping="scaled")
    # 16 -> 24 alive: 2 -> 3 nodes at the 5th grant (20 alive: 2.5 rounds to 2; 21: 2.625 to 3); back
    # to 20 at the 4th removal
    assert s.k0 == 2 and [k for _, k in s.availability] == [2, 3, 2]
    assert [(a.at, a.kind) for a in s.actions] == [(4.0, "add"), (103.0, "remove")]
    assert s.dropped == 12 - 2
    with pytest.raises(ValueError, match="mapping"):
        build_schedule(events, start_s=100, window_s=200, k=4, compression=1, notice_share=0, mapping="x")


def test_busiest_window_and_the_real_trace_loads(tmp_path):
    events = _ev((0, "add", "a"), (60, "add", "b"), (700, "remove", "a"), (710, "add", "c"), (720, "remove", "b"),
                 (2000, "add", "z"))
    assert busiest_window(events, 120) == 660.0
    p = tmp_path / "t.csv"
    p.write_text("0,add,node1\n60000,remove,node1\n")
    assert load_trace(p) == _ev((0.0, "add", "node1"), (60.0, "remove", "node1"))
    p.write_text("0,grant,node1\n")
    with pytest.raises(ValueError, match="t.csv:1"):
        load_trace(p)


def _rows(spec):
    return [{"time": t, "step": s, "world_size": w} for t, s, w in spec]


def test_goodput_counts_each_step_once_and_charges_stalls_to_the_last_event():
    rows = _rows([(99, 10, 2), (101, 11, 2), (102, 12, 2), (103, 13, 2),
                  # a removal without notice at 103.5: 5 s without a step, resumed from step 11
                  (108.5, 12, 1), (109.5, 13, 1), (110.5, 14, 1), (111.5, 15, 1),
                  # a join at 112: 4 s, no step redone
                  (116, 16, 2), (117, 17, 2), (118, 18, 2)])
    a = analyse(rows, t0=100, t_end=120, gbs=12, events=[(103.5, UNNOTICED), (112.0, JOIN)], ideal=120 * 20,
                availability=[(0, 2), (10, 1)])
    assert (a["step_start"], a["step_end"], a["steps_counted"], a["steps_trained"]) == (10, 18, 8, 10)
    assert a["steps_redone"] == 2
    assert a["goodput_samples_per_s"] == pytest.approx(8 * 12 / 20)
    assert a["goodput_vs_ideal"] == pytest.approx(96 / 2400)
    assert a["median_step_interval_s"] == 1.0
    assert a["stall_s"] == {JOIN: 3.5, NOTICED: 0.0, UNNOTICED: 4.5, "start": 0.0}
    assert a["stalls"] == {JOIN: 1, NOTICED: 0, UNNOTICED: 1, "start": 0}
    # its own steady throughput: one step (12 samples) a second on 1 and on 2 workers; 20 s of it
    assert a["own_throughput_by_size"] == {"1": 12.0, "2": 12.0}
    assert a["goodput_vs_own_ideal"] == pytest.approx(96 / 240)


def test_throughput_and_ideal_integrate_over_availability():
    rows = _rows([(0, 1, 1), (1, 2, 1), (2, 3, 1), (2.5, 4, 2), (3.0, 5, 2), (3.5, 6, 2), (4, 1, 2)])
    thr = throughput_by_size(rows, 12)
    assert thr == {1: 12.0, 2: 24.0}
    # 10 s at 1 node, 5 s at 2, 5 s at 3 (unmeasured: the nearest, 2)
    assert ideal_samples([(0, 1), (10, 2), (15, 3)], 20, thr) == pytest.approx(120 + 120 + 120)
    assert ideal_samples([(0, 2), (30, 1)], 20, thr) == pytest.approx(480)  # the window ends first
    with pytest.raises(ValueError):
        ideal_samples([(0, 1)], 5, {})


def test_loss_agreement_uses_each_steps_latest_loss():
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 9.9}, {"step": 2, "loss": 4.0}, {"step": 3, "loss": 3.0}]
    ok = loss_agreement(rows, [5.0, 4.0002, 3.0])
    assert ok["within_1e-4"] and ok["steps_compared"] == 3 and ok["max_rel_diff"] == pytest.approx(0.0002 / 4.0002)
    assert not loss_agreement(rows, [5.0, 4.001, 3.0])["within_1e-4"]
    assert loss_agreement(rows, [5.0, 4.0, 3.0, 2.0])["missing"] == [4]
    assert not loss_agreement(rows, [5.0, 4.0, 3.0, 2.0])["within_1e-4"]


def test_action_is_a_value():
    assert Action(at=1.0, kind="add", slot=0) == Action(at=1.0, kind="add", slot=0)
