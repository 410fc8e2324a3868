"""benchmarks/elastic.py's pure parts: the job config under --tp, the world size a kill leads to, the
steady scenario's table. The runs themselves (Ray clusters, three systems) are the benchmark's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.elastic import (STATES, _cfg, first_step_time, rows_before, snapshot_costs, steady_summary, steady_table,
                                world_for)
from service.control.reconfiguration import Reconfig

ONE_GB = STATES["1gb"]


def test_tp_sets_the_jobs_parallel_tp_and_room_for_two_tp_groups():
    plain = _cfg(ONE_GB, 10, "live")["parallel"]
    tp2 = _cfg(replace(ONE_GB, tp=2), 10, "live")["parallel"]
    assert "tp" not in plain and plain["max_workers"] == 3
    assert tp2["tp"] == 2 and tp2["max_workers"] == 4


@pytest.mark.parametrize("tp, nodes, world", [(None, 3, 3), (None, 2, 2), (2, 3, 4), (2, 2, 4), (2, 1, 2)])
def test_the_world_after_a_loss_is_a_multiple_of_tp_within_the_slots_left(tp, nodes, world):
    assert world_for(replace(ONE_GB, tp=tp), nodes) == world


def test_peer_interval_and_budget_go_to_the_checkpoint_section_only_when_set():
    plain = _cfg(ONE_GB, 10, "live")["checkpoint"]
    assert "peer_interval" not in plain and "peer_budget" not in plain
    assert _cfg(replace(ONE_GB, peer_interval=0), 10, "storage")["checkpoint"]["peer_interval"] == 0
    assert _cfg(replace(ONE_GB, peer_budget=0.0), 10, "live")["checkpoint"]["peer_budget"] == 0.0


def test_the_emulated_accelerator_joins_the_model_overrides_of_both_systems_only_when_set():
    assert _cfg(ONE_GB, 10, "live")["model"] == {"preset": "small", "overrides": {"n_layers": 30}}
    emulated = replace(ONE_GB, emulate_s_per_sample=2.5)
    assert _cfg(emulated, 10, "live")["model"] == {"preset": "small",
                                                  "overrides": {"n_layers": 30, "emulate_s_per_sample": 2.5}}
    assert emulated.model_section == _cfg(emulated, 10, "live")["model"]  # what Ray Train builds
    assert ONE_GB.model == {"preset": "small", "overrides": {"n_layers": 30}}  # the state's own is untouched


def _job(mode: str, steps: list[float], gaps: list[float], copies: list[float] = ()) -> dict:
    return {"mode": mode, "step_time_s": steps, "interval_s": gaps,
            **({"take_wait_s": [0.0] * len(copies), "take_agree_s": [0.01] * len(copies), "take_copy_s": list(copies)}
               if copies else {})}


def test_steady_summary_pools_each_modes_jobs_and_divides_by_off():
    jobs = [_job("every step", [3.0, 3.2], [3.3, 3.5], [0.2, 0.2]), _job("off", [2.0, 2.0], [2.0, 2.2]),
            _job("paced (default)", [2.1, 2.0, 2.2, 2.0], [2.2, 2.0, 2.4, 2.0], [0.2]),
            _job("every step", [3.1], [3.4], [0.3])]
    modes = steady_summary(jobs)
    assert list(modes) == ["every step", "off", "paced (default)"]
    every, off, paced = modes.values()
    assert every["jobs"] == 2 and every["median_step_s"] == 3.1 and every["median_interval_s"] == 3.4
    assert every["snapshots_per_step"] == 1.0 and every["median_take_copy_s"] == 0.2
    assert every["interval_ratio"] == pytest.approx(3.4 / 2.1) and off["step_ratio"] == 1.0
    assert paced["snapshots_per_step"] == 0.25 and paced["median_interval_s"] == 2.1
    assert "median_take_copy_s" not in off
    text = steady_table([{"scenario": "steady", "modes": modes}, {"scenario": "kill"}])
    assert "| every step | 3.10 s | 3.40 s | 1.619× | 1.00 | wait 0.00 s, agree 0.01 s, copy 0.20 s | 2 |" in text
    assert "| off | 2.00 s | 2.10 s | 1.000× | 0.00 | - | 1 |" in text
    assert "| paced (default) | 2.05 s | 2.10 s | 1.000× | 0.25 |" in text


def test_the_snapshot_costs_are_read_from_the_rows_of_steps_that_took_one():
    rows = [{"step": 4, "snapshot": {"wait_s": 0.5, "agree_s": 0.01, "copy_s": 0.2, "committed": 2}},
            {"step": 5},  # peer_interval 2: no snapshot at this step
            {"step": 6, "snapshot": {"wait_s": 0.0, "agree_s": 0.02, "copy_s": 0.3, "committed": 4}}]
    assert snapshot_costs(rows) == {"take_wait_s": [0.5, 0.0], "take_agree_s": [0.01, 0.02],
                                    "take_copy_s": [0.2, 0.3]}
    assert snapshot_costs([{"step": 1}]) == {}


def test_the_stall_starts_at_the_old_groups_last_step_not_at_a_redone_steps_row():
    # the old group trained steps 11-13 (a kill after 13); the new group resumed from step 12's snapshot
    # and redid step 13: metrics.jsonl holds both runs of step 13, the coordinator's rows only the second
    logged = [{"step": 11, "time": 100.0}, {"step": 12, "time": 103.0}, {"step": 13, "time": 106.0},
              {"step": 13, "time": 115.0}, {"step": 14, "time": 118.0}]
    failed = Reconfig(cause="failure", detected=107.0, step_before=13)  # formed nothing: no first step
    formed = Reconfig(cause="failure", detected=108.0, step_before=13, resumed_step=12, first_step_time=115.0)
    end = first_step_time([failed, formed])
    old = rows_before(logged, end)
    assert end == 115.0 and [r["time"] for r in old] == [100.0, 103.0, 106.0]
    assert end - old[-1]["time"] == 9.0  # the newest row of step 13 would give 115 - 115 = 0; of 14, -3
    with pytest.raises(ValueError, match="no step ended before"):
        rows_before(logged, 99.0)
