"""Tier 2: a tied embedding table is checkpointed once and resumes under another layout. A run saved under
pp=2 (first and last stage each hold a copy) continues under dp=2, and one saved under dp=2 continues under
pp=2 (the last stage reads its copy from the same `tok_embeddings.weight`), and one saved under pp=2
continues under pp=2 (each stage reads its own section of the top manifest and the tied table's), with
the losses of a straight dp=2 run (fp32, 1e-4 relative)."""

from __future__ import annotations

import pytest

from tests.bodies import train_body
from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist

CFG = {"model": {"preset": "tiny", "overrides": {"n_layers": 2, "tie_embeddings": True}},
       "data": {"source": "synthetic", "seq_len": 16, "num_samples": 256},
       "train": {"steps": 4, "global_batch_size": 4, "micro_batch_size": 1, "seed": 3, "lr": 1e-2, "warmup_steps": 0},
       "checkpoint": {"async_save": False, "interval_steps": 2}}


@pytest.fixture(scope="module")
def straight():
    return run_ranks(2, train_body, CFG, "dp=2", 4, None, return_params=False)[0]["losses"]


@pytest.mark.parametrize("first,second", [("pp=2", "dp=2"), ("dp=2", "pp=2"), ("pp=2", "pp=2")])
def test_tied_table_resumes_across_layouts(tmp_path, straight, first, second):
    a = run_ranks(2, train_body, CFG, first, 2, str(tmp_path), return_params=False)
    b = run_ranks(2, train_body, CFG, second, 4, str(tmp_path), return_params=False)
    assert b[0]["resumed_from"] == 2
    got = [*next(r["losses"] for r in a), *b[0]["losses"]]
    assert got == pytest.approx(straight, rel=1e-4), (first, second, got, straight)
