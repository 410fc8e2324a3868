"""Issue 15 on the coordinator's commands: two quick resizes compose (the second does not undo the
first), a failed checkpoint before stop/pause is an event and not a clean stop, and the coordinator
keeps a bounded window of metrics however long the job."""

from __future__ import annotations

from types import SimpleNamespace

from service.control.metrics_ring import RecentMetrics
from service.pool.group import FailureKind, WorkerFailure
from tests.fakes import advance, make_coordinator
from service.control.commands import Pause, SetWorkers, Stop


def test_two_quick_resizes_compose(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2}, max_workers=4)
    advance(c, lambda c: c.step_done >= 2)
    c.send(SetWorkers(workers=2))          # both queued before the loop applies either
    c.send(SetWorkers(min_workers=2))
    advance(c, lambda c: c.group is not None and c.group.size == 2 and c.step_done >= 4)
    assert (c.policy.config.min_workers, c.policy.config.max_workers) == (2, 2)


def test_a_failed_checkpoint_before_stop_is_an_event_and_not_a_clean_stop(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2})
    advance(c, lambda c: c.step_done >= 7)

    def broken(self, *, blocking=True):
        raise WorkerFailure(FailureKind.WORKER_DIED, "disk full")

    c.group.__class__.checkpoint = broken
    c.send(Stop())
    advance(c, lambda c: c.state.name.is_terminal)
    assert str(c.state.name) == "FAILED"
    ev = [e for e in c.events_since(0) if e["kind"] == "failure"]
    assert ev and ev[-1]["details"] == {"kind": "worker_died", "before": "stop"} and "disk full" in ev[-1]["reason"]
    assert "step 5" in c.status().reason and "stop requested by user" in c.status().reason


def test_a_failed_checkpoint_before_pause_is_an_event_and_the_job_still_pauses(tmp_path):
    c, _, _ = make_coordinator(tmp_path, {"a": 2, "b": 2})
    advance(c, lambda c: c.step_done >= 7)
    c.group.__class__.checkpoint = lambda self, *, blocking=True: (_ for _ in ()).throw(WorkerFailure(FailureKind.WORKER_DIED, "x"))
    c.send(Pause())
    advance(c, lambda c: str(c.state.name) == "PAUSED")
    assert any(e["kind"] == "failure" and e["details"] == {"kind": "worker_died", "before": "pause"}
               for e in c.events_since(0))


def test_the_coordinator_keeps_a_bounded_window_of_a_million_steps():
    def row(step, loss=1.0):  # what RecentMetrics reads of a StepMetrics, cheap enough for a million
        return SimpleNamespace(step=step, loss=loss, val_loss=None)

    m = RecentMetrics(keep=1000)
    for s in range(1, 1_000_001):
        m[s] = row(s)
    assert len(m) == 1000
    assert [r.step for r in m.since(999_997)] == [999_998, 999_999, 1_000_000]
    m[999_999] = row(999_999, loss=2.0)  # a redone step replaces its row in place
    assert m.since(999_998)[0].loss == 2.0 and len(m.since(0)) == 1000
    m[5] = row(5)  # older than the window (a resume from far back): still served in order
    assert [r.step for r in m.since(0)][:2] == [5, 999_002] and len(m) == 1000
    assert [r.step for r in m.since(999_998)] == [999_999, 1_000_000]
