"""Pure tests of the lifecycle table, the journal and the event log (tier 1: milliseconds, no Ray)."""

from __future__ import annotations

import json
import logging
from collections import deque

import pytest

from parallel.layout import Layout
from service.control.events import Event, EventLog, read_events
from service.control.journal import Journal
from service.control.state import TRANSITIONS, IllegalTransition, JobState, can_transition

S = JobState
ALL = list(JobState)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Machine:
    """A journal over a state held here, as the coordinator's journal reads the coordinator's state value:
    `transition` records the move, then makes it."""

    def __init__(self, job_id: str = "job-1", *, state: JobState = JobState.PENDING, sink=None, clock=None):
        self.state = state
        self.journal = Journal(job_id, current=lambda: self.state, sink=sink, clock=clock or FakeClock())

    def transition(self, to, **kw) -> Event:
        event = self.journal.moved(JobState(to), **kw)
        self.state = JobState(to)
        return event

    def note(self, kind, **kw) -> Event:
        return self.journal.note(kind, **kw)


def machine_in(state: JobState, sink=None, clock=None) -> Machine:
    return Machine(state=state, sink=sink, clock=clock)


# -- states and the table -------------------------------------------------------------------------
def test_terminal_and_active_flags():
    assert {s for s in ALL if s.is_terminal} == {S.SUCCEEDED, S.FAILED, S.STOPPED}
    assert {s for s in ALL if s.is_active} == {S.STARTING, S.RUNNING, S.RESIZING, S.RECOVERING}
    assert not any(s.is_active and s.is_terminal for s in ALL)


def test_table_covers_every_state_and_terminals_are_dead_ends():
    assert set(TRANSITIONS) == set(ALL)
    for s in ALL:
        assert (not TRANSITIONS[s]) == s.is_terminal, s
        assert s not in TRANSITIONS[s], f"{s} has a self-loop"


def test_issue_sketch_transitions_are_all_allowed():
    sketch = {
        S.PENDING: {S.STARTING},
        S.STARTING: {S.RUNNING, S.WAITING_FOR_CAPACITY, S.FAILED, S.RECOVERING, S.STOPPED},
        S.RUNNING: {S.RESIZING, S.RECOVERING, S.PAUSED, S.SUCCEEDED, S.FAILED, S.STOPPED},
        S.RESIZING: {S.RUNNING, S.RECOVERING, S.WAITING_FOR_CAPACITY, S.FAILED, S.STOPPED},
        S.RECOVERING: {S.RUNNING, S.WAITING_FOR_CAPACITY, S.FAILED, S.STOPPED},
        S.WAITING_FOR_CAPACITY: {S.STARTING, S.RECOVERING, S.STOPPED, S.FAILED},
        S.PAUSED: {S.STARTING, S.STOPPED},
    }
    for src, dsts in sketch.items():
        assert dsts <= TRANSITIONS[src], (src, dsts - TRANSITIONS[src])
    # The only additions, each documented in service/control/state.py.
    added = {(s, d) for s in ALL for d in TRANSITIONS[s] if d not in sketch.get(s, set())}
    queued = {(S.PENDING, S.QUEUED), (S.STARTING, S.QUEUED), (S.RECOVERING, S.QUEUED), (S.WAITING_FOR_CAPACITY, S.QUEUED)} | {
        (S.QUEUED, d) for d in (S.STARTING, S.RECOVERING, S.WAITING_FOR_CAPACITY, S.PAUSED, S.STOPPED, S.FAILED)}
    assert added == {(S.PENDING, S.STOPPED), (S.PENDING, S.FAILED), (S.WAITING_FOR_CAPACITY, S.PAUSED),
                     (S.PENDING, S.PAUSED), (S.PENDING, S.RUNNING)} | queued


def _reachable(start: JobState) -> set[JobState]:
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in TRANSITIONS[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_reachable_and_every_live_state_can_stop_and_finish():
    assert _reachable(S.PENDING) == set(ALL)
    for s in ALL:
        if not s.is_terminal:
            assert S.STOPPED in TRANSITIONS[s], f"the user cannot stop a job in {s}"
            assert S.FAILED in _reachable(s) and S.SUCCEEDED in _reachable(s), s


@pytest.mark.parametrize("src", ALL)
def test_every_pair_follows_the_table(src):
    for dst in ALL:
        events: list[Event] = []
        m = machine_in(src, sink=events.append)
        if dst in TRANSITIONS[src]:
            ev = m.transition(dst, reason="because")
            assert m.state is dst and events == [ev]
            assert (ev.from_state, ev.to_state, ev.kind) == (src, dst, "transition")
            assert can_transition(src, dst)
        else:
            with pytest.raises(IllegalTransition) as exc:
                m.transition(dst, reason="because")
            assert f"{src} -> {dst}" in str(exc.value) and "job-1" in str(exc.value)
            assert (exc.value.from_state, exc.value.to_state) == (src, dst)
            assert m.state is src and events == [], "an illegal move must change nothing"
            assert not can_transition(src, dst)


def test_illegal_from_terminal_says_terminal():
    with pytest.raises(IllegalTransition, match="none: it is terminal"):
        machine_in(S.SUCCEEDED).transition(S.RUNNING, reason="again")


# -- data carried by transitions ----------------------------------------------------------------
def test_transition_updates_data_and_event_carries_layouts():
    clock, events = FakeClock(5.0), []
    m = Machine("j", sink=events.append, clock=clock)
    assert (m.state, m.journal.since) == (S.PENDING, 5.0)
    clock.t = 6.0
    m.transition(S.STARTING, reason="picked up")
    clock.t = 7.5
    ev = m.transition("RUNNING", reason="group formed", layout=Layout(dp_shard=2, tp=2), step=0, cause="planned")
    assert (m.state, m.journal.step, m.journal.since, ev.reason, ev.cause) == (S.RUNNING, 0, 7.5, "group formed",
                                                                               "planned")
    assert ev.old_layout is None and ev.new_layout == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    clock.t = 9.0
    m.transition(S.RESIZING, reason="node draining", cause="preemption", step=120)
    ev = m.transition(S.RUNNING, reason="resized", layout=Layout(tp=2), step=120)
    assert ev.old_layout == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    assert ev.new_layout == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1}
    assert m.journal.layout == Layout(tp=2) and ev.step == 120 and ev.time == 9.0
    assert [e.to_state for e in events] == ["STARTING", "RUNNING", "RESIZING", "RUNNING"]


def _plan(layout: Layout):
    from parallel.planner import Plan

    return Plan(layout=layout, world_size=layout.world_size, available=layout.world_size, micro_batch_size=1,
                grad_accum_steps=1, memory_bytes=0.0, reasons=())


def test_a_resize_event_is_built_from_its_reconfiguration_record():
    from service.control.reconfiguration import InPlace, Reconfig

    events = []
    m = machine_in(S.RESIZING, sink=events.append)
    rc = Reconfig(cause="preemption", detected=3.0, step_before=120, old_layout=Layout(dp_shard=2, tp=2)).formed(
        new_layout=Layout(tp=2), resumed_step=118, started=0, stopped=2, world_size=2, transfer=InPlace())
    ev = m.journal.resized(rc, plan=_plan(Layout(tp=2)), reason="shrunk")
    assert (ev.kind, ev.from_state, ev.to_state, ev.step, ev.cause, ev.reason) == (
        "resize", "RESIZING", "RESIZING", 118, "preemption", "shrunk")
    assert ev.old_layout == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    assert ev.new_layout == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1}
    assert ev.details["old_layout"] == ev.old_layout and ev.details["new_layout"] == ev.new_layout
    assert ev.details["transfer"] == {"path": "in place"} and ev.details["steps_lost"] == 2
    assert ev.details["plan"]["layout"] == ev.new_layout and events == [ev] and m.journal.step == 118
    json.loads(ev.to_json())  # the whole record is JSON at this edge
    with pytest.raises(ValueError, match="a formed group"):
        m.journal.resized(Reconfig(cause="planned", detected=1.0, step_before=0), plan=_plan(Layout()), reason="x")


@pytest.mark.parametrize("kwargs, match", [
    ({"reason": ""}, "reason is required"),
    ({"reason": "x", "cause": "cosmic rays"}, "cause must be one of"),
    ({"reason": "x", "step": -1}, "step must be"),
    ({"reason": "x", "step": True}, "step must be"),
])
def test_bad_arguments_raise_and_change_nothing(kwargs, match):
    events = []
    m = machine_in(S.RUNNING, sink=events.append)
    with pytest.raises(ValueError, match=match):
        m.transition(S.RESIZING, **kwargs)
    assert m.state is S.RUNNING and events == []


def test_unknown_state_name_raises():
    with pytest.raises(ValueError):
        machine_in(S.RUNNING).transition("EXPLODED", reason="x")


def test_note_keeps_state_and_records_kind():
    events = []
    m = machine_in(S.RUNNING, sink=events.append)
    ev = m.note("preemption", reason="node abc drains in 30 s", cause="preemption",
                details={"node_id": "abc", "deadline": 1030.0}, step=7)
    assert (ev.kind, ev.from_state, ev.to_state, ev.step, ev.details["node_id"]) == (
        "preemption", "RUNNING", "RUNNING", 7, "abc")
    assert m.state is S.RUNNING and m.journal.step == 7 and events == [ev]
    with pytest.raises(ValueError, match="recorded with moved"):
        m.note("transition", reason="x")


def test_failing_sink_is_logged_and_the_move_stands(caplog):
    def broken(_event):
        raise OSError("disk full")

    m = machine_in(S.RUNNING, sink=broken)
    with caplog.at_level(logging.WARNING, logger="service.control.journal"):
        m.transition(S.PAUSED, reason="user pause", cause="user")
    assert m.state is S.PAUSED
    assert "could not record event" in caplog.text and "disk full" in caplog.text


# -- events and the log ---------------------------------------------------------------------------
def _event(i: int = 0, **kw) -> Event:
    base = dict(time=100.0 + i, job_id="j", kind="transition", from_state="RUNNING", to_state="RESIZING",
                reason=f"r{i}", old_layout={"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}, new_layout=None,
                step=i, cause="grow", details={"n": [1, 2]})
    return Event(**{**base, **kw})


def test_event_json_round_trip_and_forward_compat():
    ev = _event(3)
    assert Event.from_dict(json.loads(ev.to_json())) == ev
    assert Event.from_dict({**ev.to_dict(), "added_by_a_newer_writer": 1}) == ev
    minimal = Event.from_dict({"time": 1, "job_id": "j", "kind": "checkpoint"})
    assert minimal.details == {} and minimal.cause is None
    with pytest.raises(ValueError, match="missing"):
        Event.from_dict({"time": 1, "kind": "x"})
    with pytest.raises(ValueError, match="JSON object"):
        Event.from_dict([1, 2])
    with pytest.raises(ValueError, match="job_id"):
        Event(time=1, job_id="", kind="x")


def test_state_enum_serialises_as_plain_string():
    ev = machine_in(S.RUNNING).transition(S.SUCCEEDED, reason="done")
    d = json.loads(ev.to_json())
    assert d["from_state"] == "RUNNING" and d["to_state"] == "SUCCEEDED"
    assert JobState(Event.from_dict(d).to_state) is S.SUCCEEDED


def test_event_log_memory_only_and_since():
    log = EventLog()
    assert [log.append(_event(i)) for i in range(5)] == [0, 1, 2, 3, 4]
    assert len(log) == 5 and [e.step for e in log.since(3)] == [3, 4] and log.since(5) == []
    assert log.events == log.since(0)
    with pytest.raises(ValueError):
        log.since(-1)
    with pytest.raises(ValueError):
        log.append({"kind": "transition"})


def test_event_log_writes_one_flushed_line_per_event(tmp_path):
    path = tmp_path / "run" / "nested" / "events.jsonl"  # parent dirs do not exist yet
    log = EventLog(path)
    assert not path.parent.exists(), "the constructor must not touch the disk"
    for i in range(3):
        log.append(_event(i))
        lines = path.read_text().splitlines()  # visible before any close: flushed per line
        assert len(lines) == i + 1 and json.loads(lines[-1])["step"] == i
    assert read_events(path) == log.events


def test_a_journal_into_log_file_and_back(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    m = Machine("job-7", sink=log, clock=FakeClock())
    m.transition(S.STARTING, reason="start")
    m.transition(S.RUNNING, reason="up", layout=Layout(dp_shard=4), step=0, cause="planned")
    m.note("checkpoint", reason="saved", step=50, details={"path": "ckpt/50"})
    m.transition(S.RECOVERING, reason="worker 3 died", cause="failure", step=50)
    assert EventLog.load(path).events == log.events
    assert [e.kind for e in read_events(path)] == ["transition", "transition", "checkpoint", "transition"]


def test_load_tolerates_truncated_last_line_and_appends_cleanly(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    for i in range(3):
        log.append(_event(i))
    whole = path.read_bytes()
    path.write_bytes(whole + _event(3).to_json().encode()[:25])  # a crash mid-write
    with caplog.at_level(logging.WARNING, logger="service.control.events"):
        assert [e.step for e in read_events(path)] == [0, 1, 2]
        resumed = EventLog.load(path)
    assert "truncated last line" in caplog.text
    assert path.read_bytes() == whole, "load must cut the torn line off"
    resumed.append(_event(4))
    assert [e.step for e in read_events(path)] == [0, 1, 2, 4]
    assert [e.step for e in resumed.events] == [0, 1, 2, 4]


def test_load_keeps_a_complete_last_line_missing_its_newline(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(_event(0).to_json() + "\n" + _event(1).to_json())
    log = EventLog.load(path)
    assert [e.step for e in log.events] == [0, 1]
    log.append(_event(2))
    assert [e.step for e in read_events(path)] == [0, 1, 2]


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(_event(0).to_json() + "\n{not json\n" + _event(2).to_json() + "\n")
    with pytest.raises(ValueError, match="line 2"):
        read_events(path)


def test_load_of_missing_file_is_empty_and_creates_on_append(tmp_path):
    path = tmp_path / "new" / "events.jsonl"
    log = EventLog.load(path)
    assert len(log) == 0 and not path.exists()
    log.append(_event(0))
    assert read_events(path) == [_event(0)]


def test_the_recovery_page_shows_the_lifecycle_as_the_code_has_it():
    """docs/recovery.md embeds the diagram and the state table generated from TRANSITIONS and the state
    values: a move added to the table or a field added to a state fails here until it is regenerated."""
    from pathlib import Path

    from service.control.diagram import generated, mermaid

    page = (Path(__file__).resolve().parents[2] / "docs" / "recovery.md").read_text()
    assert generated() in page
    assert sum(line.count("-->") for line in mermaid().splitlines()) == \
        1 + sum(len(d) for d in TRANSITIONS.values()) + sum(s.is_terminal for s in ALL)
