"""The planner's plan is what the trainer runs: the micro batch it chose to fit parallel.memory_budget_gb
reaches the ranks whole (it was once recomputed on the rank without the budget, and silently dropped)."""

from __future__ import annotations

import pytest

from parallel.layout import Layout
from parallel.memory import estimate_memory
from parallel.planner import plan
from tests.bodies import worker_plan_body
from tests.multiproc import run_ranks
from workers.config import JobConfig, job_constraints

SPEC = {"data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 1, "global_batch_size": 8, "micro_batch_size": 4},
        "checkpoint": {"interval_steps": 100}}


@pytest.mark.dist
def test_the_trainer_runs_the_micro_batch_the_planner_chose_for_the_memory_budget(tmp_path):
    m = JobConfig.from_dict(SPEC).model.build()
    one, two = (estimate_memory(m, Layout(), micro_batch_size=mb, seq_len=16) for mb in (1, 2))
    budgeted = JobConfig.from_dict({**SPEC, "parallel": {"memory_budget_gb": (one + two) / 2 / 2**30}})
    p = plan(1, m, job_constraints(budgeted, max_workers=1))
    # the planner shrank the micro batch (the budget-free choice is the asked 4: it divides the 8 samples)
    assert (p.micro_batch_size, p.grad_accum_steps) == (1, 8)
    assert "micro_batch_size=1 (asked 4): smaller to fit the memory budget" in p.reasons

    [got] = run_ranks(1, worker_plan_body, budgeted.to_dict(), p.to_dict(), str(tmp_path))
    assert (got["micro_batch_size"], got["n_microbatches"], got["steps"]) == (1, 8, [1])
    assert got["shapes"] == [[(1, 16)] * 8]  # eight forward/backward passes of one sample each
