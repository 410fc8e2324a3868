"""service.pool.launch.Launcher's wait for starting workers: the placement groups' tables (one GCS call
each) are read when a check is due (placement by `start_timeout_s`, a probe of the nodes), not each time a
start answers. N starts answering one at a time read N tables each before: N(N-1)/2 GCS calls per start of
N workers (a join of 1,024 workers: half a million)."""

from __future__ import annotations

import pytest
import ray.util

from service.pool import launch
from service.pool.calls import Calls
from service.pool.launch import Launcher
from service.pool.roster import Role, WorkerHandle


class _Ref:
    def __init__(self, i: int):
        self.i = i


def _start(n: int, monkeypatch, *, start_timeout_s: float = 60.0, probe_cap_s: float = 60.0) -> int:
    """Start `n` fake workers that answer one per `ray.wait`; the number of placement-group tables read."""
    refs = [_Ref(i) for i in range(n)]
    reads = []

    def wait(pending, num_returns, timeout):
        return [pending[0]], pending[1:]  # one start answers per wait, in order

    monkeypatch.setattr(launch.ray, "wait", wait)
    monkeypatch.setattr(Calls, "get", lambda self, refs, what, timeout=None, also=(): [f"info-{refs[0].i}"])
    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: reads.append(pg) or {"state": "CREATED"})
    calls = Calls(probe_cap_s=probe_cap_s, probe_timeout_s=2.0)
    monkeypatch.setattr(calls, "probe_or_fail", lambda nodes, what: None)
    launcher = Launcher(cfg=None, run_dir="", roster=None, slots=None, calls=calls, start_timeout_s=start_timeout_s,
                        namespace="t")
    handles = [WorkerHandle(actor=None, node_id=f"node{i}", pg=f"pg{i}", role=Role.SPARE, ping=r)
               for i, r in enumerate(refs)]
    assert launcher._await_starts(handles) == [f"info-{i}" for i in range(n)]
    return len(reads)


@pytest.mark.parametrize("n", [8, 64, 1024])
def test_starts_that_answer_before_any_check_is_due_read_no_table(n, monkeypatch):
    assert _start(n, monkeypatch) == 0  # before: n(n-1)/2 (28, 2,016, 523,776)


def test_once_placement_is_due_the_tables_are_read_until_every_group_is_placed_then_not_again(monkeypatch):
    # start_timeout_s 0: placement is due from the start; all placed at the first look, so one look only
    assert _start(64, monkeypatch, start_timeout_s=0.0) == 63
