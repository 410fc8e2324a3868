"""The chaos run's recovery measurement, on logged events and steps (no cluster)."""

from __future__ import annotations

from benchmarks.chaos import FaultRecord, job_config, paths, recovery


def ev(t: float, kind: str, cause: str = "failure", **details) -> dict:
    return {"time": t, "kind": kind, "cause": cause, "details": details}


def test_a_re_form_just_before_the_fault_does_not_count_as_its_recovery():
    """The first long run reported negative recovery times: a growth finished 0.5 s before the kill
    was taken for the kill's re-form."""
    rec = FaultRecord(index=0, kind="kill_worker", step=20, injected=100.0, expect="failure")
    events = [ev(99.5, "resize", resumed_step=18, steps_lost=0), ev(100.4, "failure"),
              ev(103.0, "resize", resumed_step=16, steps_lost=4)]
    rows = [{"step": 19, "time": 99.8}, {"step": 20, "time": 99.9}, {"step": 17, "time": 104.5}]
    assert recovery(rec, events[:2], rows[:2]) is None  # failure seen, no re-form yet
    assert recovery(rec, events, rows) == (4.5, 4, 16)


def test_two_re_forms_after_one_fault_count_to_the_last():
    rec = FaultRecord(index=1, kind="double", step=40, injected=200.0, expect="failure")
    events = [ev(200.2, "failure"), ev(201.0, "resize", resumed_step=36, steps_lost=4),
              ev(216.0, "failure"), ev(219.0, "resize", resumed_step=36, steps_lost=0)]
    rows = [{"step": 37, "time": 201.5}, {"step": 37, "time": 220.0}]
    assert recovery(rec, events, rows) == (20.0, 4, 36)


def test_the_growth_back_onto_replaced_nodes_and_the_next_fault_are_not_part_of_it():
    rec = FaultRecord(index=2, kind="remove_node", step=60, injected=300.0, expect="failure")
    events = [ev(300.3, "failure"), ev(302.0, "resize", resumed_step=56, steps_lost=4),
              ev(310.0, "resize", cause="grow", resumed_step=64, steps_lost=0),
              ev(320.5, "failure"), ev(323.0, "resize", resumed_step=68, steps_lost=3)]
    rows = [{"step": 57, "time": 302.6}, {"step": 65, "time": 310.4}, {"step": 69, "time": 323.5}]
    assert recovery(rec, events, rows, until=320.0) == (2.6, 4, 56)


def test_the_paths_of_a_faults_re_forms_are_those_recovery_counts():
    """A kill under FSDP formed from peer memory, then a second failure fell back to storage; the growth
    back and the next fault's re-form are not this fault's."""
    rec = FaultRecord(index=3, kind="double", step=80, injected=400.0, expect="failure")
    events = [ev(399.0, "resize", transfer={"path": "live"}), ev(400.3, "failure"),
              ev(402.0, "resize", transfer={"path": "memory", "snapshot_step": 79}),
              ev(405.0, "failure"), ev(409.0, "resize", transfer={"path": "storage"}),
              ev(412.0, "resize", cause="grow", transfer={"path": "live"}),
              ev(420.5, "failure"), ev(423.0, "resize", transfer={"path": "peers"})]
    assert paths(rec, events, until=420.0) == ["memory", "storage"]
    assert paths(rec, events[:2]) == []  # failure seen, no re-form yet


def test_the_chaos_job_names_its_dp_mode_only_when_asked():
    assert "dp_mode" not in job_config(100)["parallel"]
    assert job_config(100, dp_mode="shard")["parallel"]["dp_mode"] == "shard"


def test_a_targeted_schedule_draws_only_the_kinds_asked_for_each_once_per_round():
    from benchmarks.chaos_faults import KINDS, schedule

    assert schedule(5, 3, ("double",)) == ["double"] * 5
    two = schedule(6, 3, ("kill_worker", "double"))
    assert [sorted(two[i:i + 2]) for i in (0, 2, 4)] == [["double", "kill_worker"]] * 3
    full = schedule(len(KINDS), 7)
    assert sorted(full) == sorted(KINDS) and full == schedule(len(KINDS), 7, KINDS)  # the default: all
