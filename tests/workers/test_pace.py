"""workers.pace: when peer snapshots are taken, from the steps' own times (pure)."""

from __future__ import annotations

import pytest

from workers.pace import PROBE_EVERY, Pace


def run(pace: Pace, steps: list[tuple[float, bool]], *, take_s: float = 0.1, proposals: dict[int, int] | None = None):
    """Drive `pace` as Worker.run does over `steps` ((seconds, busy) per step, 1-based), taking a
    snapshot whenever it is due with `take_s` of cost; other ranks' proposals by step (the largest
    wins). Returns the steps that took one."""
    taken = []
    for step, (seconds, busy) in enumerate(steps, start=pace.start + 1):
        pace.step_ended(seconds, busy=busy)
        if pace.due(step):
            k = max(pace.propose(), (proposals or {}).get(step, 0))
            pace.taken(step, k, take_s)
            taken.append(step)
    return taken


@pytest.mark.parametrize("every, start, first", [(1, 0, 1), (3, 0, 3), (3, 4, 6), (5, 10, 15), (1, 7, 8)])
def test_the_first_snapshot_follows_the_first_multiple_of_the_interval_after_the_start(every, start, first):
    assert Pace(every=every, budget=0.1, start=start).next_due == first


def test_budget_zero_takes_one_exactly_every_interval_whatever_it_costs():
    pace = Pace(every=2, budget=0.0)
    assert run(pace, [(1.0, True)] * 10, take_s=5.0) == [2, 4, 6, 8, 10]
    assert not pace.costs and not pace.clean  # nothing measured


def test_a_snapshot_costing_half_a_step_is_taken_every_fifth_step_at_a_tenth_budget():
    # clean steps 1.0 s; the step after a snapshot runs beside its round: 1.4 s; the take 0.1 s:
    # one snapshot costs 0.5 s, a tenth of 5 steps
    pace = Pace(every=1, budget=0.1)
    busy_after = set()
    taken = []
    for step in range(1, 40):
        busy = step in busy_after
        pace.step_ended(1.4 if busy else 1.0, busy=busy)
        if pace.due(step):
            pace.taken(step, pace.propose(), 0.1)
            taken.append(step)
            busy_after.add(step + 1)
    assert taken[:3] == [1, 2, 7]  # the first cost is known at the second take
    assert all(b - a == 5 for a, b in zip(taken[2:], taken[3:])), taken
    assert pace.interval == 5


def test_a_busy_step_faster_than_the_median_offsets_one_slower_as_noise_does():
    # two steps beside one round, one 0.3 s slower than the median clean step and one 0.3 s faster: the
    # box's noise, not the round's cost; the snapshot cost its take alone (counting only the slower step,
    # as the pace once did, made it 0.32 s: every 4th step)
    pace = Pace(every=1, budget=0.1)
    for _ in range(3):
        pace.step_ended(1.0, busy=False)
    pace.taken(3, pace.propose(), 0.02)
    pace.step_ended(1.3, busy=True)
    pace.step_ended(0.7, busy=True)
    assert pace.propose() == 1 and list(pace.costs) == [pytest.approx(0.02)]


@pytest.mark.parametrize("take_s, slowdown, budget, interval", [
    (0.01, 0.0, 0.1, 1),     # a GPU box: the copy is cheap, the round does not slow the step
    (0.05, 0.05, 0.1, 1),    # 0.1 s per 1 s step: exactly the budget
    (0.05, 0.06, 0.1, 2),
    (0.1, 0.9, 0.1, 10),
    (0.1, 0.9, 0.5, 2),
    (0.1, 5.0, 0.1, 50),     # capped at the durable checkpoint's interval
])
def test_the_interval_is_the_smallest_within_the_budget(take_s, slowdown, budget, interval):
    pace = Pace(every=1, budget=budget, cap=50)
    pace.step_ended(1.0, busy=False)
    pace.taken(1, pace.propose(), take_s)
    pace.step_ended(1.0 + slowdown, busy=True)
    pace.step_ended(1.0, busy=False)
    assert pace.propose() == interval


def test_the_largest_proposal_of_any_rank_is_the_interval_every_rank_keeps():
    pace = Pace(every=1, budget=0.1)
    assert run(pace, [(1.0, False)] * 6, take_s=0.0, proposals={2: 3}) == [1, 2, 5, 6]


def test_with_no_clean_step_the_interval_grows_past_the_busy_steps_until_one_is_clean():
    # a round that lasts longer than a step: every step runs beside one, until the interval leaves room
    pace = Pace(every=1, budget=0.1)
    pace.taken(0, pace.propose(), 0.1)
    intervals = []
    for _ in range(3):
        for _ in range(pace.interval):
            pace.step_ended(2.0, busy=True)
        pace.taken(pace.next_due, k := pace.propose(), 0.1)
        intervals.append(k)
    assert intervals == [2, 3, 4]
    assert not pace.costs  # no clean baseline: no cost measured


def test_at_the_shortest_interval_one_snapshot_in_PROBE_EVERY_leaves_a_step_clean():
    pace = Pace(every=1, budget=0.5)
    pace.step_ended(1.0, busy=False)
    proposals = []
    for step in range(1, 2 * PROBE_EVERY):  # one probe in these, not two
        if step > 1:
            pace.step_ended(1.05, busy=True)  # cheap: the interval stays 1, and no step is clean
        pace.taken(step, k := pace.propose(), 0.01)
        proposals.append(k)
    assert proposals.count(2) == 1 and proposals.index(2) == PROBE_EVERY


def test_a_cap_below_every_still_keeps_every():
    assert Pace(every=4, budget=0.1, cap=2).propose() == 4


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every must be > 0"):
        Pace(every=0, budget=0.1)
