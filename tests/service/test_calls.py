"""The waits on workers' calls, without Ray running: when a wait probes, what a failed call becomes, and
which nodes a probe that finds one dead names (the Ray-backed waits are in test_worker_group.py and
test_start_probe.py)."""

from __future__ import annotations

from itertools import islice

import pytest
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

import service.pool.calls as calls
from service.pool.calls import Calls, failure, probe_gaps
from service.pool.group import FailureKind, WorkerFailure
from workers.strict import ConfigError


def test_a_wait_probes_half_a_second_in_then_doubling_up_to_its_cap():
    assert list(islice(probe_gaps(5.0), 6)) == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert list(islice(Calls(probe_cap_s=1.5, probe_timeout_s=1.0).gaps(), 4)) == [0.5, 1.0, 1.5, 1.5]


@pytest.mark.parametrize(("error", "kind", "text"), [
    (RayActorError(), FailureKind.WORKER_DIED, "a worker died during form: The actor experienced an error"),
    (GetTimeoutError("late"), FailureKind.TIMED_OUT, "workers did not finish form within 30s"),
    (RayTaskError("join", "Traceback (most recent call last): ...", ConfigError("model.preset 'big' is unknown")),
     FailureKind.CONFIG_REJECTED, "a worker raised during form: model.preset 'big' is unknown"),
    (RayTaskError("join", "Traceback (most recent call last): ...", RuntimeError("its peer left")),
     FailureKind.WORKER_RAISED, "a worker raised during form: its peer left"),
])
def test_a_failed_call_becomes_a_worker_failure_of_its_kind(error, kind, text):
    f = failure(error, "form", 30.0)
    assert f.kind is kind and str(f).startswith(text), (f.kind, str(f))


def test_a_probe_that_finds_nodes_silent_fails_with_those_nodes_only(monkeypatch):
    asked = []
    monkeypatch.setattr(calls, "probe_nodes", lambda nodes, timeout_s: asked.append((nodes, timeout_s)) or {"aaaa1111"})
    c = Calls(probe_cap_s=3.0, probe_timeout_s=1.25)
    c.probe_or_fail(["aaaa1111"], "during a step")  # all answer: no failure
    with pytest.raises(WorkerFailure) as e:
        c.probe_or_fail(["aaaa1111", "bbbb2222cccc", "dddd3333eeee"], "during a step")
    assert e.value.kind is FailureKind.NODE_LOST and e.value.nodes == {"bbbb2222cccc", "dddd3333eeee"}
    assert str(e.value) == "node(s) bbbb2222, dddd3333 stopped answering during a step"
    assert asked == [(["aaaa1111"], 1.25), (["aaaa1111", "bbbb2222cccc", "dddd3333eeee"], 1.25)]
