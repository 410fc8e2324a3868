"""Tier 2: float8 training (torchao, emulated on CPU) under FSDP2 and TP, and its checkpoints.

A float8 run saved at dp=2 (FSDP2 with float8 all-gather) resumes at tp=2 with the per-step losses of an
uninterrupted dp=2 float8 run (1e-4 relative: the float8 casts are the same, only the reduction order
differs); its checkpoint holds the fp32 weights under the canonical names, exactly what the ranks held,
and exports like any other. The same checkpoint resumes with float8 switched off, and a checkpoint saved
without float8 resumes with it on (rowwise), each continuing close to the float8 run (float8 rounding
moves the loss by about 1e-3 relative at this size).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.bodies import train_body
from tests.distributed.test_equivalence import merged_params, tiny_cfg
from tests.multiproc import rank_device, run_ranks

pytestmark = pytest.mark.dist
pytest.importorskip("torchao.float8")

STEPS, HALF = 4, 2


def f8_cfg(recipe: str) -> dict:
    c = tiny_cfg()
    c["train"].update(float8=recipe, eval_interval=0)
    c["checkpoint"] = {"interval_steps": HALF, "async_save": False}
    return c


def all_gather_body(cfg_dict: dict, layout: str, steps: int) -> dict:
    """train_body, plus whether the rank's float8 layers all-gather in float8."""
    from parallel.float8 import uses_float8_all_gather
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    cfg = JobConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, layout=Layout.parse(layout), device=rank_device()).build()
    metrics = trainer.fit(steps)
    return {"losses": [m.loss for m in metrics], "float8_all_gather": uses_float8_all_gather(trainer.model)}


@pytest.fixture(scope="module")
def reference() -> dict:
    res = run_ranks(2, all_gather_body, f8_cfg("tensorwise"), "dp=2", STEPS)
    assert all(r["float8_all_gather"] for r in res)
    return res[0]


@pytest.fixture(scope="module")
def saved_at_dp2(tmp_path_factory) -> tuple[str, list[dict]]:
    d = str(tmp_path_factory.mktemp("f8-dp2"))
    return d, run_ranks(2, train_body, f8_cfg("tensorwise"), "dp=2", HALF, d)


def _close(got: list[float], want: list[float], rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=0)


def test_float8_run_saved_at_dp2_resumes_at_tp2(reference, saved_at_dp2, tmp_path):
    d, first = saved_at_dp2
    _close(first[0]["losses"], reference["losses"][:HALF], 1e-4)
    run_dir = str(tmp_path / "run")
    shutil.copytree(d, run_dir)
    second = run_ranks(2, train_body, f8_cfg("tensorwise"), "tp=2", STEPS, run_dir, return_params=False)
    for r in second:
        assert r["resumed_from"] == HALF
        _close(r["losses"], reference["losses"][HALF:], 1e-4)


def test_float8_checkpoint_holds_fp32_master_weights_under_canonical_names(saved_at_dp2, tmp_path):
    from models.llama import build_model
    from parallel.checkpoint import load_full_model_state
    from parallel.export import export_checkpoint
    from workers.config import JobConfig

    d, first = saved_at_dp2
    state, manifest = load_full_model_state(f"{d}/checkpoints")
    assert manifest["step"] == HALF
    plain = build_model(JobConfig.from_dict(f8_cfg("none")).model.build())
    assert {n: (tuple(p.shape), torch.float32) for n, p in plain.named_parameters()} == {
        n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    for name, t in merged_params(first).items():
        torch.testing.assert_close(state[name], t, rtol=0, atol=0, msg=name)
    out = export_checkpoint(f"{d}/checkpoints", str(tmp_path / "export"))
    assert (out / "config.json").exists()


def test_float8_switched_off_and_on_across_a_resume(reference, saved_at_dp2, tmp_path):
    d, _ = saved_at_dp2
    run_dir = str(tmp_path / "run")
    shutil.copytree(d, run_dir)
    (off,) = run_ranks(1, train_body, f8_cfg("none"), "dp=1", STEPS, run_dir, return_params=False)
    assert off["resumed_from"] == HALF
    _close(off["losses"], reference["losses"][HALF:], 1e-2)
    assert off["losses"] != reference["losses"][HALF:]  # float8 really was off
    (on,) = run_ranks(1, train_body, f8_cfg("rowwise"), "dp=1", STEPS + 1, run_dir, return_params=False)
    assert on["resumed_from"] == STEPS  # the checkpoint the float8-off run saved
    assert len(on["losses"]) == 1 and 0 < on["losses"][0] < off["losses"][-1] * 1.1


def test_float8_live_reshard_equals_the_checkpoint_path(tmp_path):
    """A planned resize moves a float8 run's state over the network (parallel.live) from dp=2, where the
    weights are float8 all-gather wrappers, to tp=2: the same shards, data position and next losses as
    resuming from its checkpoint."""
    from tests.distributed.test_live_reshard import CFG, live_body
    from tests.ports import free_port

    cfg = {**CFG, "train": {**CFG["train"], "float8": "tensorwise"}}
    ports = [free_port() for _ in range(3)]
    problems = [p for r in run_ranks(2, live_body, cfg, "dp=2", "tp=2", ports, str(tmp_path)) for p in r]
    assert problems == []
