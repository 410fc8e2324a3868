"""The drain's lead (service.control.drain): how long before a deadline the group moves off its node.
Pure, by literal rows."""

from __future__ import annotations

import pytest

from service.control.drain import DrainLead
from workers.config import ConfigError, JobConfig, ParallelConfig

RULE = DrainLead(margin=1.5, floor_s=5.0, default_move_s=40.0)


@pytest.mark.parametrize("call_s, move_s, lead", [
    (0.5, None, 60.75),   # nothing measured yet: 1.5 x (0.5 + the assumed 40 s)
    (0.5, 2.0, 5.0),      # a fast move: the floor
    (8.0, 1.2, 13.8),     # an 8B step at 20 nodes and its move off: 1.5 x 9.2
    (68.0, 3.2, 106.8),   # a 70B step: the lead is mostly the call a hold lets run
    (0.0, 0.0, 5.0),
])
def test_the_lead_is_the_margin_times_the_call_and_the_move_at_least_the_floor(call_s, move_s, lead):
    assert RULE.lead_s(call_s=call_s, move_s=move_s) == pytest.approx(lead)


def test_margin_zero_moves_off_at_once_whatever_was_measured():
    off = DrainLead(margin=0.0, floor_s=5.0, default_move_s=40.0)
    assert off.lead_s(call_s=0.5, move_s=None) is None
    assert off.lead_s(call_s=0.5, move_s=2.0) is None


@pytest.mark.parametrize("kw, match", [
    ({"margin": -1.0}, "margin"), ({"floor_s": float("inf")}, "floor_s"), ({"default_move_s": True}, "default_move_s"),
])
def test_a_bad_rule_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DrainLead(**{"margin": 1.5, "floor_s": 5.0, "default_move_s": 40.0, **kw})


@pytest.mark.parametrize("call_s, move_s", [(-1.0, None), (0.5, float("nan"))])
def test_bad_measurements_are_refused(call_s, move_s):
    with pytest.raises(ValueError, match="must be a finite number of seconds"):
        RULE.lead_s(call_s=call_s, move_s=move_s)


def test_the_job_config_carries_the_rule_with_its_bounds():
    assert DrainLead.of(ParallelConfig()) == RULE  # the defaults
    cfg = JobConfig.from_dict({"parallel": {"drain_margin": 0.0, "drain_floor_s": 1.0, "drain_move_s": 2.0}})
    assert DrainLead.of(cfg.parallel) == DrainLead(margin=0.0, floor_s=1.0, default_move_s=2.0)
    with pytest.raises(ConfigError, match="parallel.drain_margin"):
        JobConfig.from_dict({"parallel": {"drain_margin": -0.5}})
    with pytest.raises(ConfigError, match="parallel.drain_move_s"):
        JobConfig.from_dict({"parallel": {"drain_move_s": 1e6}})
