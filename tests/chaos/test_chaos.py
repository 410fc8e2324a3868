"""The short chaos run (benchmarks/chaos.py has the long one and the details): every fault kind once,
in a seeded order, injected while a tiny job trains on a `ray.cluster_utils.Cluster` behind the job
API, and the pass criteria asserted: the job reaches its target step; every step's loss is within
1e-4 relative of a fault-free run; no committed checkpoint is lost beyond retention; every resume
loaded a committed checkpoint; the event log shows every fault."""

from __future__ import annotations

import pytest

from benchmarks.chaos import ChaosRun, check, reference_losses, render, summary
from benchmarks.chaos_faults import KINDS

pytestmark = pytest.mark.e2e

STEPS = 600
"""Long enough that the job is still training when the last fault comes (a fault and the regrowth
after it take seconds, during which the job keeps training when it can). The faults come a wall-clock gap
apart, so how many steps they span moves with the step time: in a full-suite run on 2026-12-07 the 7th
came at step 294 of 300, the job ended before it could recover and the 8th never came. Every step after
the last fault is CI time only (the job's and the fault-free reference's), a few milliseconds each."""


def test_every_fault_kind_once_loses_nothing(tmp_path):
    run = ChaosRun(tmp_path, faults=len(KINDS), seed=1, steps=STEPS, gap=6)
    result = run.run()
    problems = check(run, result, reference_losses(tmp_path, STEPS))
    print(render(summary(run, result, problems)))
    assert not problems, "\n".join(problems)
    assert sorted(r.kind for r in result["records"]) == sorted(KINDS)
    assert all(r.survived for r in result["records"])
