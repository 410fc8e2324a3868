"""One state handler at a time, on a fake group: the state it returns is its whole outcome."""

from __future__ import annotations

from service.control.states import Ended, Recovering, Running
from service.control.state import JobState
from service.pool.group import FailureKind
from tests.fakes import advance, make_coordinator


def running(tmp_path, nodes=None, **kw):
    c, cluster, G = make_coordinator(tmp_path, nodes or {"a": 2, "b": 2}, **kw)
    advance(c, lambda c: isinstance(c.state, Running) and c.state.record is None and c.step_done >= 2)
    return c, cluster, G


def test_a_chunk_that_trains_stays_running_and_advances_the_step(tmp_path):
    c, cluster, _ = running(tmp_path)
    before = c.step_done
    out = c._on_running(c.state, c.watcher.poll())
    assert isinstance(out, Running) and c.step_done > before and c.metrics[c.step_done].step == c.step_done


def test_a_worker_that_raises_in_a_chunk_moves_the_job_to_recovering(tmp_path):
    c, cluster, G = running(tmp_path)
    G.fail_next.append(FailureKind.WORKER_RAISED)
    out = c._on_running(c.state, c.watcher.poll())
    assert isinstance(out, Recovering) and out.cause == "failure" and out.record.step_before == c.step_done
    assert [f.kind for f in c.failures] == [FailureKind.WORKER_RAISED]


def test_a_worker_death_on_a_node_found_dead_counts_as_that_nodes_loss(tmp_path):
    c, cluster, G = running(tmp_path)
    cluster.dead.add("b")  # the watcher has not seen it yet: the probe beside the salvage finds it
    G.fail_next.append(FailureKind.WORKER_DIED)
    out = c._on_running(c.state, c.watcher.latest)
    assert isinstance(out, Recovering)
    assert [f.kind for f in c.failures] == [FailureKind.NODE_LOST]  # one node loss, one kind


def test_a_node_the_watcher_lists_dead_is_a_node_loss_without_a_chunk(tmp_path):
    c, cluster, G = running(tmp_path)
    cluster.dead.add("b")
    out = c._on_running(c.state, c.watcher.poll())
    assert isinstance(out, Recovering) and [f.kind for f in c.failures] == [FailureKind.NODE_LOST]


def test_the_last_step_done_ends_the_job(tmp_path):
    c, cluster, _ = running(tmp_path, steps=3)
    advance(c, lambda c: c.step_done >= 3)
    group = c.group
    out = c._on_running(c.state, c.watcher.poll())
    assert isinstance(out, Ended) and out.final is JobState.SUCCEEDED
    c._enter(out)
    assert c.group is None and group.members == []  # what the state holds is what the job holds
