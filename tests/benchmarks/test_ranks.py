"""benchmarks/ranks.py's pure parts and benchmarks/growth.py: the phases read from a recorded event (no
Ray), the fits of a cost against the world size and the choice between them."""

from __future__ import annotations

import math

import pytest

from benchmarks.growth import Growth, choose, fit
from benchmarks.ranks import AFTER, PHASES, job_config, loss_check, phases, ray_phase_table, side_by_side, start_nodes

NS = [2, 4, 8, 16, 32]

# A live resize recorded by this benchmark (Reconfig.to_dict and the coordinator's timeline after the event,
# rounded): the phases must come out of its fields and sum to event -> first step.
T_EVENT = 1000.0
LIVE = {
    "cause": "user", "detected": 1000.05, "step_before": 7, "world_size": 3, "resumed_step": 7,
    "first_step_time": 1001.90,
    "transfer": {"path": "live", "step": 7, "bytes_moved": 4096, "handover_s": 0.30, "start_s": 0.10,
                 "from_standby": 0, "transfer_s": 0.40, "form_s": 0.60,
                 "form_parts": {"pg_s": 0.25, "pg.rendezvous_s": 0.05, "pg.connect_s": 0.20, "build_s": 0.30},
                 "transfer_parts": {"rendezvous": 0.15, "rendezvous.rendezvous_s": 0.04,
                                    "rendezvous.connect_s": 0.11, "plan": 0.02, "send_recv": 0.10}},
}
TIMELINE = [["-> RESIZING", 0.05], ["resize", 1.45], ["-> RUNNING", 1.46], ["checkpoint", 2.0]]


def test_a_live_events_phases_come_from_its_record_and_sum_to_event_to_first_step():
    got = phases(LIVE, t_event=T_EVENT, timeline=TIMELINE, commit_time=1002.5)
    assert list(got) == [*PHASES, *AFTER]
    assert got["decision"] == pytest.approx(0.05)
    assert got["actors"] == pytest.approx(0.10)
    assert got["handover"] == pytest.approx(0.20)
    assert got["rendezvous"] == pytest.approx(0.05 + 0.04)
    assert got["connections"] == pytest.approx(0.20 + 0.11)
    assert got["plan"] == pytest.approx(0.02)
    assert got["transfer"] == pytest.approx(0.40 - 0.15 - 0.02)
    assert got["form"] == pytest.approx(0.60 - 0.25)
    assert got["first step"] == pytest.approx(1001.90 - 1000.0 - 1.45)
    assert got["coordinator"] == pytest.approx(1.45 - 0.05 - (0.30 + 0.40 + 0.60))
    assert sum(got[p] for p in PHASES) == pytest.approx(LIVE["first_step_time"] - T_EVENT)
    assert got["durable checkpoint"] == pytest.approx(0.60)


def test_a_storage_event_has_no_transfer_phases_and_no_durable_checkpoint():
    rc = {**LIVE, "transfer": {"path": "storage", "start_s": 0.5, "standby": 1, "form_s": 0.7,
                               "form_parts": {"pg_s": 0.2, "pg.rendezvous_s": 0.1, "pg.connect_s": 0.1}}}
    got = phases(rc, t_event=T_EVENT, timeline=TIMELINE)
    assert got["handover"] == got["plan"] == got["transfer"] == 0.0
    assert got["actors"] == pytest.approx(0.5) and got["form"] == pytest.approx(0.5)
    assert sum(got[p] for p in PHASES) == pytest.approx(rc["first_step_time"] - T_EVENT)
    assert got["durable checkpoint"] is None


def test_an_event_that_never_formed_is_refused():
    with pytest.raises(ValueError, match="did not finish"):
        phases(LIVE, t_event=T_EVENT, timeline=[["-> RESIZING", 0.05]])


@pytest.mark.parametrize("growth, f", [
    (Growth.CONSTANT, lambda n: 0.4),
    (Growth.LOG, lambda n: 0.1 + 0.3 * math.log(n)),
    (Growth.LINEAR, lambda n: 0.1 + 0.05 * n),
    (Growth.QUADRATIC, lambda n: 0.1 + 0.01 * n + 0.002 * n * n),
])
def test_the_simplest_model_that_fits_is_chosen_with_its_coefficients(growth, f):
    got = choose(NS, [f(n) for n in NS])
    assert got.best.growth == growth
    assert got.best.at(1024) == pytest.approx(f(1024), rel=1e-6)


def test_noise_below_the_tolerance_does_not_buy_curvature():
    ys = [0.50, 0.497, 0.503, 0.499, 0.506]  # constant, within 5 ms
    assert choose(NS, ys, tolerance_s=0.01, tolerance_rel=0.0).best.growth == Growth.CONSTANT
    exact = choose(NS, ys, tolerance_s=0.0, tolerance_rel=0.0)  # no tolerance: the least residual that grows
    assert exact.best.growth != Growth.CONSTANT
    assert exact.best.rms_s == min(f.rms_s for f in exact.fits if f.coefficients[-1] >= 0)


def test_a_fit_that_turns_negative_is_not_chosen():
    ys = [0.13, 0.14, 0.33, 0.78, 1.26]  # a quadratic with c < 0 fits these best, and goes negative by N=1024
    got = choose(NS, ys, tolerance_s=0.0, tolerance_rel=0.0)
    assert next(f for f in got.fits if f.growth == Growth.QUADRATIC).coefficients[-1] < 0
    assert got.best.growth == Growth.LINEAR and got.best.at(1024) > 0


def test_a_fit_says_what_is_wrong_with_its_points():
    with pytest.raises(ValueError, match="one cost per size"):
        fit([2, 4], [1.0], Growth.LINEAR)
    with pytest.raises(ValueError, match="at least 3 points"):
        fit([2, 4], [1.0, 2.0], Growth.QUADRATIC)
    # three sizes: a quadratic would pass through them exactly, so it is not one of the candidates
    assert [f.growth for f in choose([4, 8, 16], [1.0, 2.0, 5.0]).fits] == [Growth.CONSTANT, Growth.LOG, Growth.LINEAR]
    with pytest.raises(ValueError, match="no model"):
        choose([4, 4], [1.0, 2.0])


def test_the_job_divides_its_batch_at_both_sizes_of_a_resize_and_nodes_follow_the_event():
    for n in NS:
        gbs = job_config(n, 0.1)["train"]["global_batch_size"]
        assert gbs % n == 0 and gbs % max(1, 3 * n // 4) == 0
    assert start_nodes("resize", 8) == 4 and start_nodes("join", 8) == 3
    with pytest.raises(ValueError, match="N >= 4"):
        start_nodes("kill", 2)


def test_losses_are_compared_step_by_step_relative():
    ref = [2.0, 1.5, 1.0]
    assert loss_check({"1": 2.0, "2": 1.5, "3": 1.00005}, ref) == {"steps": 3, "max_rel": pytest.approx(5e-5),
                                                                  "ok": True}
    assert not loss_check({"1": 2.0, "2": 1.6}, ref)["ok"]


# One event per system at N=4 as the runs write them (fields the tables read; Ray Train's from measure_ray).
ELASTRON_KILL = {"system": "elastron", "scenario": "kill", "n": 4, "event_to_first_step_s": 2.0, "steps_redone": 0,
                 "world_size_before": 4, "world_size_after": 2, "load_avg_1m": 12.0}
ELASTRON_RESIZE = {**ELASTRON_KILL, "scenario": "resize", "world_size_after": 3, "load_avg_1m": 11.0}
RAY_KILL = {"system": "raytrain", "scenario": "kill", "n": 4, "event_to_first_step_s": 71.0, "timed_out": False,
            "steps_redone_or_lost": 3, "stall_s": 71.05, "world_size_before": 4, "world_size_after": 2, "worker_group_starts": 3,
            "load_avg_1m": 14.0, "t_event": 1000.0, "first_step_time": 1071.0,
            "phases": {"detection": 4.0, "restart": 62.0, "actors": None, "worker start + process group": 3.4,
                       "build": 0.8,
                       "checkpoint load": 0.4, "first step": 0.4}}


def test_side_by_side_has_both_systems_per_event_and_says_resize_has_no_ray_train_counterpart():
    got = side_by_side([ELASTRON_RESIZE, ELASTRON_KILL, RAY_KILL]).splitlines()
    assert got[2] == ("| resize | 4 | 2.00 s | 0 | no counterpart (Ray Train has no user-driven resize) | — | — | "
                      "11 / — |")
    assert got[3] == "| kill | 4 | 2.00 s | 0 | 71.00 s | 3 | 35.5× | 12 / 14 |"


def test_a_ray_train_run_without_a_step_at_the_new_size_has_no_ratio():
    timed_out = {**RAY_KILL, "timed_out": True, "event_to_first_step_s": 480.0, "notes": "no step"}
    assert side_by_side([ELASTRON_KILL, timed_out]).splitlines()[2].endswith("| — | — | 12 / 14 |")


def test_ray_trains_phase_table_shows_an_unrecorded_phase_as_a_dash_and_the_sum():
    got = ray_phase_table([ELASTRON_KILL, RAY_KILL])
    assert "| actors | — |" in got and "| restart | 62.000 |" in got
    assert "| event → first step | 71.000 |" in got and "| steps redone | 3 |" in got
    assert "→ this one | 71.05 |" in got
    assert "| world sizes | 4→2 |" in got
