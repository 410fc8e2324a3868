"""Tier 2: a run checkpointed under one layout and resumed under another continues exactly.

The reference is one uninterrupted 20-step single-process run. Each case trains 10 steps under layout A
(checkpointing asynchronously at step 5, then committing at step 10), resumes under layout B in the same
run directory and trains to step 20. Per-step losses of both halves must match the reference within 1e-4
relative (bit-identical when the layout does not change), so must the final parameters (which makes
the optimizer state, LR schedule and data position part of the check), and the sample ids the ranks
consumed, read in global order, must be exactly the reference's: nothing repeated or skipped across a
DP change. Same tiny config as test_equivalence.py (3 layers, so pp=2 is uneven; train.steps=20 keeps the
LR horizon of both halves the same).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from parallel.layout import Layout
from tests.bodies import train_body
from tests.distributed.test_equivalence import merged_params, tiny_cfg
from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist

TOTAL, HALF = 20, 10
RTOL = 1e-4


def ckpt_cfg() -> dict:
    return {**tiny_cfg(), "checkpoint": {"interval_steps": 5, "keep_last": 2, "async_save": True}}


def n_ranks(layout: str) -> int:
    return Layout.parse(layout).world_size


@pytest.fixture(scope="module")
def reference() -> dict:
    (res,) = run_ranks(1, train_body, tiny_cfg(), "dp=1", TOTAL, record_samples=True)
    return res


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    """Run directory and results after HALF steps under a layout, computed once per layout per module."""
    cache: dict[str, tuple[str, list[dict]]] = {}

    def get(layout: str) -> tuple[str, list[dict]]:
        if layout not in cache:
            d = str(tmp_path_factory.mktemp("first-" + layout.replace("=", "").replace(",", "-")))
            res = run_ranks(n_ranks(layout), train_body, ckpt_cfg(), layout, HALF, d, return_params=False,
                            record_samples=True)
            cache[layout] = (d, res)
        return cache[layout]

    return get


def continue_run(run_dir: str, layout: str, steps: int) -> list[dict]:
    return run_ranks(n_ranks(layout), train_body, ckpt_cfg(), layout, steps, run_dir, record_samples=True)


def assert_losses(reference: dict, results: list[dict], start: int, *, exact: bool = False) -> None:
    ref = torch.tensor(reference["losses"], dtype=torch.float64)
    for r in results:
        n = len(r["losses"])
        assert r["steps"] == list(range(start + 1, start + 1 + n)), f"ran steps {r['steps']}"
        got = torch.tensor(r["losses"], dtype=torch.float64)
        torch.testing.assert_close(got, ref[start:start + n], rtol=0 if exact else RTOL, atol=0)


def assert_params(reference: dict, results: list[dict], *, exact: bool = False) -> None:
    params = merged_params(results)
    assert params.keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        if exact:
            assert torch.equal(params[name], ref), f"{name} differs"
        else:
            rel = ((params[name] - ref).norm() / ref.norm()).item()
            assert rel <= RTOL, f"{name}: relative difference {rel:.2e} > {RTOL:.0e}"


def global_order(results: list[dict]) -> list[int]:
    """Sample ids of one run in global order: per step, the DP ranks' slices in dp_rank order (ranks
    that share a dp_rank, e.g. TP or PP peers, consume the same slice; one of each is read)."""
    by_dp = {r["dp_rank"]: r["samples"] for r in results}
    steps = len(next(iter(by_dp.values())))
    return [i for s in range(steps) for d in sorted(by_dp) for i in by_dp[d][s]]


def assert_samples(reference: dict, *phases: list[dict]) -> None:
    seen = [i for results in phases for i in global_order(results)]
    expected = global_order([reference])
    assert len(seen) == len(expected) == TOTAL * tiny_cfg()["train"]["global_batch_size"]
    assert len(set(seen)) == len(seen), "a sample was consumed twice"
    assert seen == expected, "samples skipped or reordered across the resume"


def test_same_layout_resume_is_bit_identical(reference, first_half, tmp_path):
    src, first = first_half("dp=1")
    run_dir = str(tmp_path / "run")
    shutil.copytree(src, run_dir)
    second = continue_run(run_dir, "dp=1", TOTAL)
    assert second[0]["resumed_from"] == HALF
    assert_losses(reference, first, 0, exact=True)
    assert_losses(reference, second, HALF, exact=True)
    assert_params(reference, second, exact=True)
    assert_samples(reference, first, second)


CASES = [
    pytest.param("tp=2", "dp=1", id="tp2-to-tp1"),
    pytest.param("dp=1", "tp=2", id="tp1-to-tp2"),
    pytest.param("pp=2", "dp=1", id="pp2-to-pp1"),
    pytest.param("dp=1", "pp=2", id="pp1-to-pp2"),
    pytest.param("dp=2", "dp=1", id="fsdp2-to-dp1"),
    pytest.param("dp=1", "dp=2", id="dp1-to-fsdp2"),
    pytest.param("dp=2,tp=2", "pp=2", id="dp2tp2-to-pp2"),
    pytest.param("tp=2,pp=2", "dp_replicate=2", id="tp2pp2-to-replicate2"),
]


@pytest.mark.parametrize("first_layout,second_layout", CASES)
def test_resume_under_another_layout(reference, first_half, tmp_path, first_layout, second_layout):
    src, first = first_half(first_layout)
    run_dir = str(tmp_path / "run")
    shutil.copytree(src, run_dir)
    second = continue_run(run_dir, second_layout, TOTAL)
    assert {r["resumed_from"] for r in second} == {HALF}
    # Format 4, each save's writers chosen by the placement's rule (no fallback to gathering boxes).
    for d, step, layout in ((src, HALF, first_layout), (run_dir, TOTAL, second_layout)):
        with open(os.path.join(d, "checkpoints", f"step-{step:08d}", "manifest.json")) as f:
            doc = json.load(f)
        top = doc["header"]
        assert doc["format_version"] == 4 and top["placement"]["layout"] == Layout.parse(layout).to_dict()
        assert top["indexes"] == n_ranks(layout) and len(doc["sections"]) >= Layout.parse(layout).pp
    assert_losses(reference, first, 0)
    assert_losses(reference, second, HALF)
    assert_params(reference, second)
    assert_samples(reference, first, second)


def test_chain_of_three_layouts(reference, first_half, tmp_path):
    """FSDP dp=2 for steps 1-10, then TP=2 for 11-15, then PP=2 for 16-20."""
    src, first = first_half("dp=2")
    run_dir = str(tmp_path / "run")
    shutil.copytree(src, run_dir)
    second = continue_run(run_dir, "tp=2", 15)
    third = continue_run(run_dir, "pp=2", TOTAL)
    assert {r["resumed_from"] for r in second} == {HALF} and {r["resumed_from"] for r in third} == {15}
    assert_losses(reference, second, HALF)
    assert_losses(reference, third, 15)
    assert_params(reference, third)
    assert_samples(reference, first, second, third)
    ckpts = sorted(n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith("step-"))
    assert ckpts == ["step-00000015", "step-00000020"]  # keep_last=2


def test_cli_resumes_in_the_same_run_dir(tmp_path):
    """`torchrun -m workers.train` under tp=2 to step 4, then a single process under dp=1 to step 6."""
    cfg = tiny_cfg()
    cfg["checkpoint"] = {"interval_steps": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "workers.train", str(path), "--layout", "tp=2", "--steps", "4", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=180, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run(
        [sys.executable, "-m", "workers.train", str(path), "--layout", "dp=1", "--steps", "6",
         "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=180, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    assert "step 4 (saved under dp=1,tp=2,pp=1, now dp=1,tp=1,pp=1)" in second.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
