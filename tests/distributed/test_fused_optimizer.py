"""Tier 2: AdamW's fused kernel and the foreach one with DTensor parameters (FSDP2 and TP) on CPU ranks
joined by gloo.

Fused AdamW is the default on every device (`train.fused_optimizer: null`); this file is where CI runs
the foreach path: the same layouts as tests/distributed/test_equivalence.py, the same 1e-4 bound against
the single-process (fused) run. Fused and foreach differ in the last bits of each update only.
"""

from __future__ import annotations

import pytest
import torch

from tests.bodies import train_body
from tests.distributed.test_equivalence import STEPS, assert_matches, tiny_cfg
from tests.multiproc import rank_device, run_ranks

pytestmark = pytest.mark.dist


def fused_body(cfg_dict: dict, layout: str, steps: int) -> dict:
    """train_body, plus which AdamW implementation each parameter group got."""
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    out = train_body(cfg_dict, layout, steps)
    cfg = JobConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, layout=Layout.parse(layout), device=rank_device()).build()
    out["fused"] = [bool(g.get("fused")) for g in trainer.optimizer.param_groups]
    out["foreach"] = [bool(g.get("foreach")) for g in trainer.optimizer.param_groups]
    return out


def _cfg(fused: bool | None) -> dict:
    c = tiny_cfg()
    c["train"]["fused_optimizer"] = fused
    return c


def test_cpu_default_is_fused():
    from workers.config import JobConfig

    assert JobConfig.from_dict(tiny_cfg()).train.fused_optimizer is None
    (r,) = run_ranks(1, fused_body, _cfg(None), "dp=1", 1)
    assert r["fused"] == [True] * len(r["fused"]) and not any(r["foreach"])


@pytest.fixture(scope="module")
def reference() -> dict:
    (res,) = run_ranks(1, train_body, tiny_cfg(), "dp=1", STEPS)
    return res


@pytest.mark.parametrize("layout", ["dp=2", "tp=2"])  # FSDP2 DTensors; TP DTensors next to plain norms
def test_foreach_adamw_with_dtensor_params_matches_single_process(reference, layout):
    results = run_ranks(2, fused_body, _cfg(False), layout, STEPS)
    for r in results:
        assert r["foreach"] and all(r["foreach"]) and not any(r["fused"]), r["fused"]
    assert_matches(reference, results)


def local_vs_dtensor_body(cfg_dict: dict, layout: str, steps: int) -> dict:
    """The same training under `layout` twice from the same start: with the trainer's AdamW (kernels on
    the local shards) and with torch's own AdamW over the same DTensor parameter groups."""
    from parallel.layout import Layout
    from parallel.optim import LocalAdamW, param_groups
    from tests.bodies import full_params
    from workers.config import JobConfig
    from workers.trainer import Trainer

    cfg = JobConfig.from_dict(cfg_dict)
    out = {}
    for name in ("local", "dtensor"):
        trainer = Trainer(cfg, layout=Layout.parse(layout, dp_mode=cfg.parallel.dp_mode),
                          device=rank_device()).build()
        assert type(trainer.optimizer) is LocalAdamW
        if name == "dtensor":
            hyper = {k: v for k, v in trainer.optimizer.defaults.items() if k != "decoupled_weight_decay"}
            trainer.optimizer = torch.optim.AdamW(param_groups(trainer.params), **hyper)
        metrics = trainer.fit(steps)
        out[name] = {"losses": [m.loss for m in metrics], "grad_norms": [m.grad_norm for m in metrics],
                     "params": full_params(trainer.model)}
    return out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("layout,dp_mode", [("dp=2", "shard"), ("dp=2", "replicate"), ("tp=2", "shard")])
def test_adamw_on_local_shards_is_bitwise_torchs_adamw_on_dtensors(layout, dp_mode, fused):
    cfg = _cfg(fused)
    cfg["parallel"]["dp_mode"] = dp_mode
    for r in run_ranks(2, local_vs_dtensor_body, cfg, layout, 4):
        assert r["local"]["losses"] == r["dtensor"]["losses"] and r["local"]["grad_norms"] == r["dtensor"]["grad_norms"]
        assert r["local"]["params"].keys() == r["dtensor"]["params"].keys()
        for k, v in r["local"]["params"].items():
            assert torch.equal(v, r["dtensor"]["params"][k]), k
