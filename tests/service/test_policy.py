"""Pure tests of the scaling policy, driven by explicit `now` values (tier 1: no clock, no sleeping)."""

from __future__ import annotations

import itertools

import pytest

from service.control.policy import Noop, PolicyConfig, Resize, ScalingPolicy, Wait


def policy(**kw) -> ScalingPolicy:
    size_for = kw.pop("size_for", None)
    return ScalingPolicy(PolicyConfig(**{"settle_seconds": 30.0, **kw}), size_for=size_for)


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    ({"min_workers": 0}, "min_workers"),
    ({"min_workers": True}, "min_workers"),
    ({"max_workers": 0}, "max_workers"),
    ({"min_workers": 4, "max_workers": 2}, "less than min_workers=4"),
    ({"settle_seconds": -1}, "settle_seconds"),
    ({"max_restarts": -1}, "max_restarts"),
    ({"restart_window_s": 0}, "restart_window_s"),
])
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        PolicyConfig(**kw)


@pytest.mark.parametrize("kw", [{"current_workers": -1, "usable_workers": 1},
                                {"current_workers": 1, "usable_workers": 1.5},
                                {"current_workers": False, "usable_workers": 1}])
def test_decide_rejects_bad_counts(kw):
    with pytest.raises(ValueError):
        policy().decide(0.0, **kw)


# -- start, wait ---------------------------------------------------------------------------------------
def test_start_uses_everything_offered_at_once():
    assert policy().decide(0.0, current_workers=0, usable_workers=5) == Resize(
        workers=5, cause="planned", reason="start on 5 workers (5 usable)")
    d = policy(max_workers=4).decide(0.0, current_workers=0, usable_workers=5)
    assert isinstance(d, Resize) and d.workers == 4 and d.cause == "planned"


def test_wait_below_min_workers_says_why():
    d = policy(min_workers=3).decide(0.0, current_workers=0, usable_workers=2)
    assert d == Wait("2 usable workers < min_workers=3")
    d = policy(min_workers=3).decide(100.0, current_workers=4, usable_workers=2, draining={"abcdef0123": 130.0})
    assert isinstance(d, Wait) and "2 usable workers < min_workers=3" in d.reason
    assert "node abcdef01 drains in 30.0 s" in d.reason


def test_steady_state_is_noop():
    p = policy(min_workers=2, max_workers=8)
    assert p.decide(0.0, current_workers=4, usable_workers=4) == Noop()
    assert p.decide(0.0, current_workers=8, usable_workers=12) == Noop()
    assert p.pending_growth is None


# -- shrink --------------------------------------------------------------------------------------------
def test_shrink_on_lost_capacity_is_immediate_failure():
    d = policy(settle_seconds=1e9).decide(0.0, current_workers=4, usable_workers=3)
    assert d == Resize(workers=3, cause="failure",
                       reason="shrink to 3: 3 usable workers < 4 running (capacity lost)")


def test_shrink_ahead_of_drain_is_preemption_with_earliest_deadline():
    draining = {"bbbbbbbbbb": 160.0, "aaaaaaaaaa": 130.0, "cccccccccc": None}
    d = policy().decide(100.0, current_workers=6, usable_workers=2, draining=draining)
    assert isinstance(d, Resize) and (d.workers, d.cause) == (2, "preemption")
    assert "node aaaaaaaa drains in 30.0 s (+2 more draining)" in d.reason


def test_drain_without_deadline_is_named():
    d = policy().decide(0.0, current_workers=3, usable_workers=2, draining={"n1": None})
    assert d.cause == "preemption" and "node n1 is draining (no deadline)" in d.reason


def test_lowered_max_workers_shrinks_with_cause_user():
    d = policy(max_workers=4).decide(0.0, current_workers=6, usable_workers=6)
    assert isinstance(d, Resize) and (d.workers, d.cause) == (4, "user") and "max_workers=4" in d.reason


def test_draining_nodes_without_lost_capacity_do_nothing():
    # A drain on a node we do not count (e.g. another pool) must not disturb a job that has all it needs.
    assert policy().decide(0.0, current_workers=4, usable_workers=4, draining={"n9": 50.0}) == Noop()


# -- a drain trains on until it must move (rule 3 with a lead) ------------------------------------------
# now 100; a 4-worker group, one worker on node "n1" (deadline 220: AWS's 120 s notice), lead 30 s: the
# group moves off at 190. Each row: now, usable, leaving, draining, lead -> the decision, written out.
D = {"n1aaaaaaaa": 220.0}
DRAIN_ROWS = [
    # trains on, 90 s before it moves
    (100.0, 3, 1, D, 30.0,
     Noop("node n1aaaaaa drains in 120.0 s; moving off it in 90.0 s, 30.0 s before its deadline", move_at=190.0)),
    # one tick before the lead: still trains on
    (189.5, 3, 1, D, 30.0,
     Noop("node n1aaaaaa drains in 30.5 s; moving off it in 0.5 s, 30.0 s before its deadline", move_at=190.0)),
    # the lead is reached: shrinks, as without a lead
    (190.0, 3, 1, D, 30.0,
     Resize(workers=3, cause="preemption", reason="shrink to 3: 3 usable workers < 4 running; node n1aaaaaa drains in 30.0 s")),
    # no lead (drain_margin 0): at once, the old behaviour
    (100.0, 3, 1, D, None,
     Resize(workers=3, cause="preemption", reason="shrink to 3: 3 usable workers < 4 running; node n1aaaaaa drains in 120.0 s")),
    # a deadline already inside the lead: at once
    (100.0, 3, 1, {"n1aaaaaaaa": 125.0}, 30.0,
     Resize(workers=3, cause="preemption", reason="shrink to 3: 3 usable workers < 4 running; node n1aaaaaa drains in 25.0 s")),
    # a drain without a deadline: at once
    (100.0, 3, 1, {"n1aaaaaaaa": None}, 30.0,
     Resize(workers=3, cause="preemption", reason="shrink to 3: 3 usable workers < 4 running; node n1aaaaaa is draining (no deadline)")),
    # two drains, one without a deadline: at once
    (100.0, 2, 2, {"n1aaaaaaaa": 220.0, "n2bbbbbbbb": None}, 30.0,
     Resize(workers=2, cause="preemption",
            reason="shrink to 2: 2 usable workers < 4 running; node n1aaaaaa drains in 120.0 s (+1 more draining)")),
    # two drains: the earliest deadline sets the move
    (100.0, 2, 2, {"n1aaaaaaaa": 220.0, "n2bbbbbbbb": 160.0}, 30.0,
     Noop("node n2bbbbbb drains in 60.0 s (+1 more draining); moving off it in 30.0 s, 30.0 s before its deadline",
          move_at=130.0)),
    # the drain does not explain the shortfall (one more worker's capacity is gone): at once
    (100.0, 2, 1, D, 30.0,
     Resize(workers=2, cause="preemption", reason="shrink to 2: 2 usable workers < 4 running; node n1aaaaaa drains in 120.0 s")),
    # the leaving workers not known (None): the shortfall is taken to be the drain's
    (100.0, 2, None, D, 30.0,
     Noop("node n1aaaaaa drains in 120.0 s; moving off it in 90.0 s, 30.0 s before its deadline", move_at=190.0)),
    # a drain on a node the group does not use: nothing to move (capacity is lost elsewhere: failure)
    (100.0, 3, 0, D, 30.0,
     Resize(workers=3, cause="failure", reason="shrink to 3: 3 usable workers < 4 running (capacity lost)")),
    (100.0, 4, 0, D, 30.0, Noop()),
    # as many workers offered elsewhere: the group trains on, then moves off at the same size
    (100.0, 4, 1, D, 30.0,
     Noop("node n1aaaaaa drains in 120.0 s; moving off it in 90.0 s, 30.0 s before its deadline", move_at=190.0)),
    (190.0, 4, 1, D, 30.0,
     Resize(workers=4, cause="preemption",
            reason="move to 4 workers off the draining nodes (1 of the 4 running are there); node n1aaaaaa drains in 30.0 s")),
    # ... or onto more (the move takes them too, with no settle time)
    (100.0, 5, 1, D, None,
     Resize(workers=5, cause="preemption",
            reason="move to 5 workers off the draining nodes (1 of the 4 running are there); node n1aaaaaa drains in 120.0 s")),
]


@pytest.mark.parametrize("now, usable, leaving, draining, lead, expected", DRAIN_ROWS)
def test_a_drain_trains_on_until_its_lead_then_moves(now, usable, leaving, draining, lead, expected):
    d = policy().decide(now, current_workers=4, usable_workers=usable, leaving=leaving, draining=draining,
                        drain_lead_s=lead)
    assert d == expected


def test_a_drain_hold_resets_a_pending_growth_and_a_bad_lead_is_refused():
    p = policy(settle_seconds=30.0)
    p.decide(0.0, current_workers=4, usable_workers=6)
    assert p.pending_growth == (6, 0.0)
    assert p.decide(10.0, current_workers=4, usable_workers=3, leaving=1, draining=D, drain_lead_s=30.0).move_at == 190.0
    assert p.pending_growth is None
    for bad in (-1.0, "30", float("nan")):
        with pytest.raises(ValueError, match="drain_lead_s"):
            p.decide(0.0, current_workers=4, usable_workers=3, draining=D, drain_lead_s=bad)
    with pytest.raises(ValueError, match="leaving"):
        p.decide(0.0, current_workers=4, usable_workers=3, draining=D, leaving=-1)


# -- grow and the settle timer ------------------------------------------------------------------------
def test_grow_only_after_settle_seconds():
    p = policy(settle_seconds=30.0)
    assert p.decide(0.0, current_workers=4, usable_workers=6) == Noop("growth to 6 settling: 0.0 of 30 s")
    assert p.pending_growth == (6, 0.0)
    assert isinstance(p.decide(29.9, current_workers=4, usable_workers=6), Noop)
    d = p.decide(30.0, current_workers=4, usable_workers=6)
    assert isinstance(d, Resize) and (d.workers, d.cause) == (6, "grow")
    assert "unchanged for 30.0 s (settle_seconds=30)" in d.reason
    assert p.pending_growth is None


def test_a_settled_growth_held_by_the_caller_waits_keeping_its_timer():
    why = {6: "its joining workers start and warm up"}
    asked = []
    p = ScalingPolicy(PolicyConfig(settle_seconds=10.0), hold_growth=lambda n: asked.append(n) or why[n])
    assert p.decide(0.0, current_workers=4, usable_workers=6) == Noop("growth to 6 settling: 0.0 of 10 s")
    assert asked == []  # not asked before the growth has settled
    assert p.decide(12.0, current_workers=4, usable_workers=6) == Noop(
        "growth to 6 settled (12.0 s); waiting while its joining workers start and warm up")
    assert asked == [6] and p.pending_growth == (6, 0.0)
    why[6] = ""
    d = p.decide(15.0, current_workers=4, usable_workers=6)
    assert isinstance(d, Resize) and (d.workers, d.cause) == (6, "grow") and "unchanged for 15.0 s" in d.reason
    assert p.pending_growth is None


def test_flap_below_current_resets_the_timer():
    p = policy(settle_seconds=30.0)
    assert isinstance(p.decide(0.0, current_workers=4, usable_workers=6), Noop)
    assert p.decide(10.0, current_workers=4, usable_workers=4) == Noop()  # the new node vanished
    assert p.pending_growth is None
    assert isinstance(p.decide(20.0, current_workers=4, usable_workers=6), Noop)  # back: timer restarts at 20
    assert isinstance(p.decide(45.0, current_workers=4, usable_workers=6), Noop)  # 30 s since t=0, but only 25 since 20
    assert p.decide(50.0, current_workers=4, usable_workers=6).workers == 6


def test_changing_offer_restarts_the_timer_and_grows_once_to_the_final_size():
    p = policy(settle_seconds=30.0)
    p.decide(0.0, current_workers=4, usable_workers=5)
    assert isinstance(p.decide(20.0, current_workers=4, usable_workers=6), Noop)  # another node arrived
    assert p.pending_growth == (6, 20.0)
    assert isinstance(p.decide(35.0, current_workers=4, usable_workers=6), Noop)
    assert p.decide(50.0, current_workers=4, usable_workers=6) == Resize(
        workers=6, cause="grow",
        reason="grow to 6: 6 usable workers > 4 running, unchanged for 30.0 s (settle_seconds=30)")


def test_wait_and_shrink_reset_a_pending_growth():
    p = policy(min_workers=2, settle_seconds=30.0)
    p.decide(0.0, current_workers=4, usable_workers=6)
    assert isinstance(p.decide(10.0, current_workers=4, usable_workers=1), Wait)
    assert p.pending_growth is None
    p.decide(20.0, current_workers=4, usable_workers=6)
    assert p.decide(25.0, current_workers=4, usable_workers=3).cause == "failure"
    assert p.pending_growth is None
    assert isinstance(p.decide(49.0, current_workers=3, usable_workers=6), Noop)  # timer starts again here


def test_zero_settle_grows_immediately():
    assert policy(settle_seconds=0).decide(0.0, current_workers=2, usable_workers=3).cause == "grow"


def test_growth_capped_by_max_workers_and_unchanged_offer_above_cap_is_stable():
    p = policy(max_workers=8, settle_seconds=10.0)
    p.decide(0.0, current_workers=6, usable_workers=9)
    assert isinstance(p.decide(5.0, current_workers=6, usable_workers=12), Noop)  # offer still min(12, 8) = 8
    assert p.pending_growth == (8, 0.0)
    assert p.decide(10.0, current_workers=6, usable_workers=12).workers == 8


# -- size_for: only the sizes a layout can use --------------------------------------------------------
def even(n: int) -> int | None:
    return n - n % 2 or None


def test_size_for_avoids_pointless_resizes():
    p = policy(size_for=even, settle_seconds=0)
    assert p.decide(0.0, current_workers=4, usable_workers=5) == Noop()
    assert p.decide(0.0, current_workers=4, usable_workers=7).workers == 6
    assert p.decide(0.0, current_workers=4, usable_workers=3).workers == 2  # shrink to a usable size
    assert p.decide(0.0, current_workers=0, usable_workers=5).workers == 4


def test_size_for_none_means_wait():
    d = policy(size_for=even).decide(0.0, current_workers=2, usable_workers=1)
    assert d == Wait("no usable layout on 1 offered workers (min_workers=1)")


def test_size_for_below_min_workers_means_wait():
    d = policy(min_workers=3, size_for=even).decide(0.0, current_workers=0, usable_workers=3)
    assert isinstance(d, Wait) and "no usable layout on 3" in d.reason


def test_non_monotone_size_for_never_shrinks_a_healthy_group():
    p = policy(size_for=lambda n: {7: 4}.get(n, n))
    assert p.decide(0.0, current_workers=6, usable_workers=7) == Noop()


def test_size_for_cannot_invent_workers():
    with pytest.raises(ValueError, match="more workers than offered"):
        policy(size_for=lambda n: n + 1).decide(0.0, current_workers=0, usable_workers=3)


# -- exhaustive sweep against a direct statement of the rules -----------------------------------------
@pytest.mark.parametrize("min_w, max_w", [(1, None), (2, None), (1, 4), (3, 5)])
def test_sweep_matches_the_rules(min_w, max_w):
    for current, usable in itertools.product(range(0, 9), range(0, 9)):
        p = policy(min_workers=min_w, max_workers=max_w, settle_seconds=10.0)
        d = p.decide(0.0, current_workers=current, usable_workers=usable)
        offered = usable if max_w is None else min(usable, max_w)
        case = (current, usable, d)
        if usable < min_w:
            assert isinstance(d, Wait), case
        elif current == 0:
            assert d == Resize(workers=offered, cause="planned", reason=d.reason), case
        elif offered < current:
            assert isinstance(d, Resize) and d.workers == offered and d.cause in ("failure", "user"), case
            assert min_w <= d.workers <= usable, case
        elif offered > current:
            assert isinstance(d, Noop) and "settling" in d.reason, case  # never grows on first sight
            later = p.decide(10.0, current_workers=current, usable_workers=usable)
            assert later == Resize(workers=offered, cause="grow", reason=later.reason), case
        else:
            assert d == Noop(), case


# -- a scheduler's grant (service.sharing.scheduler) ------------------------------------------------------------
def test_a_grant_caps_the_start_and_a_grant_below_min_is_a_wait_that_says_so():
    p = policy(min_workers=2)
    assert p.decide(0.0, current_workers=0, usable_workers=8, granted=3) == Resize(
        workers=3, cause="planned", reason="start on 3 workers (granted 3 by the scheduler)")
    # the grant, not the cluster's usable count, is what a scheduled job starts on: said even when they agree
    assert p.decide(0.0, current_workers=0, usable_workers=2, granted=2).reason == \
        "start on 2 workers (granted 2 by the scheduler)"
    assert p.decide(0.0, current_workers=0, usable_workers=8, granted=1) == Wait(
        "the scheduler grants 1 workers < min_workers=2", by_scheduler=True)  # the job is QUEUED
    assert p.decide(0.0, current_workers=0, usable_workers=1, granted=None) == Wait(
        "1 usable workers < min_workers=2", by_scheduler=False)  # the cluster is why: WAITING_FOR_CAPACITY


def test_a_smaller_grant_is_a_planned_shrink_not_a_failure():
    d = policy(min_workers=2).decide(0.0, current_workers=4, usable_workers=8, granted=2)
    assert d == Resize(workers=2, cause="planned", reason="shrink to 2: the scheduler grants 2 workers")


def test_a_larger_grant_grows_at_once_without_settling():
    p = policy(min_workers=2, settle_seconds=300.0)
    assert p.decide(0.0, current_workers=2, usable_workers=8, granted=6) == Resize(
        workers=6, cause="grow", reason="grow to 6: the scheduler grants 6 workers")
    # without a grant the same offer settles first
    assert isinstance(p.decide(0.0, current_workers=2, usable_workers=6), Noop)


def test_a_grant_above_what_is_usable_changes_nothing():
    p = policy(min_workers=1)
    assert p.decide(0.0, current_workers=4, usable_workers=4, granted=8) == Noop()
    d = p.decide(0.0, current_workers=4, usable_workers=2, granted=8)
    assert d.cause == "failure" and d.workers == 2


@pytest.mark.parametrize("granted", [-1, 1.5, True])
def test_bad_grants_are_refused(granted):
    with pytest.raises(ValueError, match="granted"):
        policy().decide(0.0, current_workers=0, usable_workers=4, granted=granted)


def test_a_users_resize_is_an_input_that_acts_at_once_in_either_direction():
    p = ScalingPolicy(PolicyConfig(min_workers=1, max_workers=4, settle_seconds=60.0))
    grow = p.decide(0.0, current_workers=2, usable_workers=4, requested=True)
    assert grow == Resize(workers=4, cause="user", reason="resize to 4 workers requested by user")
    # without the request the same offer waits out the settle time
    assert isinstance(p.decide(1.0, current_workers=2, usable_workers=4), Noop)
    p.config = PolicyConfig(min_workers=1, max_workers=1, settle_seconds=60.0)
    assert p.decide(2.0, current_workers=2, usable_workers=4, requested=True) == \
        Resize(workers=1, cause="user", reason="resize to 1 workers requested by user")
    # a request that changes nothing is no resize
    assert isinstance(p.decide(3.0, current_workers=1, usable_workers=4, requested=True), Noop)


def test_the_reason_for_too_few_workers_says_what_the_caller_knows():
    d = ScalingPolicy(PolicyConfig(min_workers=1)).decide(
        0.0, current_workers=0, usable_workers=0, short_because="each worker needs 1 GPU and the cluster has none")
    assert isinstance(d, Wait) and d.reason == \
        "0 usable workers < min_workers=1 (each worker needs 1 GPU and the cluster has none)"
