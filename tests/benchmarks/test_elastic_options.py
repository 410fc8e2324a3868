"""benchmarks/elastic.py's pure parts: the job config under --tp, the world size a kill leads to, the
steady scenario's table. The runs themselves (Ray clusters, three systems) are the benchmark's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.elastic import STATES, _cfg, snapshot_costs, steady_table, world_for

ONE_GB = STATES["1gb"]


def test_tp_sets_the_jobs_parallel_tp_and_room_for_two_tp_groups():
    plain = _cfg(ONE_GB, 10, "live")["parallel"]
    tp2 = _cfg(replace(ONE_GB, tp=2), 10, "live")["parallel"]
    assert "tp" not in plain and plain["max_workers"] == 3
    assert tp2["tp"] == 2 and tp2["max_workers"] == 4


@pytest.mark.parametrize("tp, nodes, world", [(None, 3, 3), (None, 2, 2), (2, 3, 4), (2, 2, 4), (2, 1, 2)])
def test_the_world_after_a_loss_is_a_multiple_of_tp_within_the_slots_left(tp, nodes, world):
    assert world_for(replace(ONE_GB, tp=tp), nodes) == world


def test_peer_interval_goes_to_the_checkpoint_section_only_when_set():
    assert "peer_interval" not in _cfg(ONE_GB, 10, "live")["checkpoint"]
    assert _cfg(replace(ONE_GB, peer_interval=0), 10, "storage")["checkpoint"]["peer_interval"] == 0


def test_steady_table_shows_both_medians_and_their_ratio():
    row = {"scenario": "steady", "jobs": [{"peer_interval": 1}, {"peer_interval": 0}],
           "median_step_on_s": 3.0, "median_step_off_s": 2.0, "step_ratio": 1.5,
           "median_interval_on_s": 3.3, "median_interval_off_s": 3.0, "interval_ratio": 1.1}
    text = steady_table([row, {"scenario": "kill"}])
    assert "| every step | 3.00 s | 3.30 s | 1 |" in text
    assert "| off | 2.00 s | 3.00 s | 1 |" in text
    assert "| on ÷ off | 1.500× | 1.100× | |" in text


def test_the_snapshot_costs_are_read_from_the_rows_of_steps_that_took_one():
    rows = [{"step": 4, "snapshot": {"wait_s": 0.5, "agree_s": 0.01, "copy_s": 0.2, "committed": 2}},
            {"step": 5},  # peer_interval 2: no snapshot at this step
            {"step": 6, "snapshot": {"wait_s": 0.0, "agree_s": 0.02, "copy_s": 0.3, "committed": 4}}]
    assert snapshot_costs(rows) == {"take_wait_s": [0.5, 0.0], "take_agree_s": [0.01, 0.02],
                                    "take_copy_s": [0.2, 0.3]}
    assert snapshot_costs([{"step": 1}]) == {}
    row = {"scenario": "steady", "jobs": [{"peer_interval": 1}, {"peer_interval": 0}],
           "median_step_on_s": 3.0, "median_step_off_s": 2.0, "step_ratio": 1.5,
           "median_interval_on_s": 3.3, "median_interval_off_s": 3.0, "interval_ratio": 1.1,
           "median_take_wait_s": 0.25, "median_take_agree_s": 0.02, "median_take_copy_s": 0.25}
    assert "wait for the last round 0.25 s, agree 0.02 s, copy 0.25 s" in steady_table([row])
