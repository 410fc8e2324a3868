"""JobStatus: the one status record, and the final states defined once."""

from __future__ import annotations

from service.control.state import TERMINAL, JobState
from service.control.status import JobStatus


def test_terminal_states_are_the_enum_s_and_match_their_strings():
    assert {s for s in JobState if s.is_terminal} == TERMINAL
    assert "FAILED" in TERMINAL and "RUNNING" not in TERMINAL


def test_a_crashed_loop_reports_failed_unless_the_job_had_finished():
    running = JobStatus(state="RUNNING", reason="training")
    assert running.with_runner(running=False, error="boom", pid=1).state == "FAILED"
    done = JobStatus(state="SUCCEEDED", reason="done")
    assert done.with_runner(running=False, error="boom", pid=1).state == "SUCCEEDED"


def test_finalized_takes_the_last_transition_or_reports_the_coordinator_gone():
    lay = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}
    ev = [{"kind": "transition", "to_state": "SUCCEEDED", "reason": "done", "cause": None, "time": 5.0,
           "new_layout": lay, "step": 10}]
    st = JobStatus(state="RUNNING", world_size=2).finalized(ev, why="gone", now=9.0)
    assert (st.state, st.step, st.world_size, st.running, st.degrees) == ("SUCCEEDED", 10, 0, False,
                                                                         {"dp": 2, "tp": 1, "pp": 1})
    ev[0]["to_state"] = "RUNNING"
    st = JobStatus(state="RUNNING").finalized(ev, why="actor died", now=9.0)
    assert st.state == "FAILED" and "actor died" in st.reason and st.since == 9.0


def test_a_stored_status_round_trips_through_its_dict():
    st = JobStatus(state="RUNNING", layout={"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1}, mfu=0.1)
    d = st.to_dict()
    assert d["degrees"] == {"dp": 2, "tp": 1, "pp": 1}
    assert JobStatus.from_dict(d) == st
