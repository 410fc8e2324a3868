"""benchmarks/elastic_raytrain.py's pure parts: an event's phases from the loop's and Ray's records of a
recorded kill (no Ray), the attempt a group belongs to, the world sizes of an event, the settings record."""

from __future__ import annotations

import pytest

from benchmarks.elastic_raytrain import PHASES, attempt_at, phases, settings, world_sizes

T_EVENT = 1000.0
# Ray's attempt records (`ray_attempts`) of a kill: the old group, a start that timed out asking for the
# dead node's slots, the group that trained at the new size
OLD = {"attempt_id": "a", "status": "ERRORED", "start": 900.0, "end": 1004.0, "workers": 4}
STALE = {"attempt_id": "b", "status": "PENDING", "start": 1005.0, "end": None, "workers": 4}
NEW = {"attempt_id": "c", "status": "RUNNING", "start": 1066.0, "end": None, "workers": 2}
# the new group's "start" records, one per rank, as the loop writes them
STARTS = [
    {"rank": 0, "process_started": 1067.0, "entered": 1069.0, "load_started": 1070.0, "time": 1070.5},
    {"rank": 1, "process_started": 1067.5, "entered": 1069.4, "load_started": 1070.2, "time": 1070.6},
]
FIRST_STEP = 1071.0


def test_each_phase_ends_at_the_slowest_ranks_record_and_they_sum_to_event_to_first_step():
    got = phases(t_event=T_EVENT, first_step_time=FIRST_STEP, starts=STARTS, old_attempt=OLD, new_attempt=NEW)
    assert list(got) == list(PHASES)
    assert got == pytest.approx({"detection": 4.0, "restart": 62.0, "actors": 1.5,
                                 "worker start + process group": 1.9,
                                 "build": 0.8, "checkpoint load": 0.4, "first step": 0.4})
    assert sum(got.values()) == pytest.approx(FIRST_STEP - T_EVENT)


def test_without_rays_attempt_records_the_first_phases_go_to_the_actors():
    got = phases(t_event=T_EVENT, first_step_time=FIRST_STEP, starts=STARTS, old_attempt=None, new_attempt=None)
    assert got["detection"] is None and got["restart"] is None
    assert got["actors"] == pytest.approx(67.5)
    assert sum(v for v in got.values() if v is not None) == pytest.approx(FIRST_STEP - T_EVENT)


def test_a_process_started_before_its_attempt_tells_nothing_and_its_time_goes_to_the_next_phase():
    pooled = [{**STARTS[0], "process_started": 950.0}, {**STARTS[1], "process_started": 960.0}]
    got = phases(t_event=T_EVENT, first_step_time=FIRST_STEP, starts=pooled, old_attempt=OLD, new_attempt=NEW)
    assert got["actors"] is None
    assert got["worker start + process group"] == pytest.approx(1069.4 - 1066.0)
    assert sum(v for v in got.values() if v is not None) == pytest.approx(FIRST_STEP - T_EVENT)


def test_a_group_that_found_no_checkpoint_has_an_empty_load_and_its_build_measured():
    # no checkpoint registered before the kill: the loop loaded nothing (load_s None)
    fresh = [{**r, "load_started": None, "load_s": None} for r in STARTS]
    got = phases(t_event=T_EVENT, first_step_time=FIRST_STEP, starts=fresh, old_attempt=OLD, new_attempt=NEW)
    assert got["build"] == pytest.approx(1070.6 - 1069.4) and got["checkpoint load"] == 0.0
    assert sum(got.values()) == pytest.approx(FIRST_STEP - T_EVENT)


def test_a_group_that_never_entered_its_function_is_refused():
    with pytest.raises(ValueError, match="never entered"):
        phases(t_event=T_EVENT, first_step_time=FIRST_STEP, starts=[], old_attempt=OLD, new_attempt=NEW)


def test_a_group_belongs_to_the_last_attempt_started_before_it_entered():
    attempts = [OLD, STALE, NEW]
    assert attempt_at(attempts, 950.0) is OLD
    assert attempt_at(attempts, 1069.0) is NEW
    assert attempt_at(attempts, 1005.0) is STALE
    assert attempt_at(attempts, 800.0) is None


@pytest.mark.parametrize("scenario, nodes, slots, max_workers, sizes", [
    ("kill", 3, 1, 3, (3, 2)),   # elastic.py's shape
    ("join", 2, 1, 3, (2, 3)),
    ("kill", 4, 2, 8, (8, 6)),   # ranks.py at N=8
    ("drain", 2, 2, 4, (4, 2)),  # ranks.py at N=4
    ("join", 3, 2, 8, (6, 8)),
    ("join", 4, 2, 8, (8, 8)),   # no room to grow: max_workers
])
def test_world_sizes_before_and_after_an_event(scenario, nodes, slots, max_workers, sizes):
    assert world_sizes(scenario, nodes=nodes, slots_per_node=slots, max_workers=max_workers) == sizes


def test_an_event_that_leaves_no_node_is_refused():
    with pytest.raises(ValueError, match="leaves no worker"):
        world_sizes("kill", nodes=1, slots_per_node=2, max_workers=2)
    with pytest.raises(ValueError, match="scenario must be one of"):
        world_sizes("resize", nodes=2, slots_per_node=2, max_workers=4)


def test_settings_record_what_is_set_beside_rays_default(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    monkeypatch.delenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", raising=False)
    got = settings(5.0)
    assert got["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == {"default_s": 2.0, "set_s": 0.5}
    assert got["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == {"default_s": 60.0, "set_s": 60.0}
    assert got["elastic_resize_monitor_interval_s"] == {"default_s": 60.0, "set_s": 5.0}
    assert got["autoscaling_coordinator_tick_s"] == {"default_s": 20.0, "set_s": 20.0}
