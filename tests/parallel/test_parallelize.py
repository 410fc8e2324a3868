"""How `parallelize` wraps data parallelism on CPU, and that the cheaper wrappings still checkpoint.

Tier 1: which layouts use DDP instead of FSDP2, and when FSDP2 reshards after forward.
Tier 2 (2 gloo ranks): collectives in one steady-state step (torch.profiler's gloo events) with 2
micro-batches per rank: FSDP2 on CPU gathers each unit once per step (not twice per micro-batch), and
dp_replicate=2 is DDP (plain parameters, no all-gather, bucketed all-reduces only). A run checkpointed
under dp_replicate=2 (plain replicated tensors) resumes under FSDP2 dp=2 and continues the
single-process run (the same checks as tests/distributed/test_resume.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from parallel.layout import Layout
from parallel.parallelize import reshard_after_forward, uses_ddp
from tests.bodies import train_body
from tests.distributed.test_equivalence import tiny_cfg
from tests.multiproc import run_ranks

@pytest.mark.parametrize("layout,expected", [
    ("dp_replicate=2", True),  # fp32 or bf16: the model casts its weights at use
    ("dp_replicate=4", True),
    ("dp=2", False),
    ("dp_replicate=2,dp_shard=2", False),
    ("dp_replicate=2,tp=2", False),
    ("dp_replicate=2,pp=2", False),
    ("dp=1", False),
])
def test_which_layouts_use_ddp(layout, expected):
    assert uses_ddp(Layout.parse(layout)) is expected


@pytest.mark.parametrize("layout,device_type,expected", [
    ("dp=2", "cuda", True),
    ("dp_replicate=2,dp_shard=2", "cuda", True),
    ("dp=2", "cpu", False),  # blocking gloo gathers cost more than the memory saved
    ("dp=2,pp=2", "cuda", False),  # parameters stay gathered across a stage's microbatches
    ("dp=1", "cuda", False),  # single rank: nothing to gather
])
def test_reshard_after_forward(layout, device_type, expected):
    assert reshard_after_forward(Layout.parse(layout), device_type) is expected


# -- tier 2 -------------------------------------------------------------------------------------------

def collectives_body(layouts: list[str]) -> dict:
    """Per layout: the model's class, whether any parameter is a DTensor, micro-batches per rank, and
    gloo collectives by name in the third step (the first builds DDP's reducer, the second rebuilds its
    buckets)."""
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile

    from parallel.parallelize import ReplicatedModule
    from workers.config import JobConfig
    from workers.trainer import Trainer

    out = {}
    for layout in layouts:
        t = Trainer(JobConfig.from_dict(tiny_cfg()), layout=Layout.parse(layout), device=torch.device("cpu")).build()
        t.train_step()
        t.train_step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t.train_step()
        out[layout] = {
            "ddp": isinstance(t.model, ReplicatedModule),
            "dtensors": any(isinstance(p, DTensor) for p in t.model.parameters()),
            "microbatches": t.n_microbatches,
            "units": len(t.model.layers) + 1,
            "gloo": dict(Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))),
        }
        t.close()
    return out


@pytest.mark.dist
def test_collectives_per_step_on_cpu():
    res = run_ranks(2, collectives_body, ["dp=2", "dp_replicate=2"])
    for r in res:
        fsdp, ddp = r["dp=2"], r["dp_replicate=2"]
        assert fsdp["microbatches"] == ddp["microbatches"] == 2
        assert not fsdp["ddp"] and fsdp["dtensors"]
        # One all-gather per FSDP unit per step: not again in backward (reshard_after_forward=False on
        # CPU), not again for the second micro-batch (set_grad_sync keeps units unsharded until the last).
        assert fsdp["gloo"].get("gloo:all_gather") == fsdp["units"], fsdp["gloo"]
        assert ddp["ddp"] and not ddp["dtensors"]
        assert "gloo:all_gather" not in ddp["gloo"] and "gloo:broadcast" not in ddp["gloo"], ddp["gloo"]
        # DDP buckets (a few) plus the trainer's loss all-reduce; FSDP2 would do one per unit.
        assert 2 <= ddp["gloo"].get("gloo:all_reduce", 0) <= 3, ddp["gloo"]


@pytest.mark.dist
def test_checkpoint_saved_under_ddp_resumes_under_fsdp(tmp_path):
    from tests.distributed.test_resume import (
        HALF, TOTAL, assert_losses, assert_params, assert_samples, ckpt_cfg, continue_run, n_ranks,
    )

    (reference,) = run_ranks(1, train_body, tiny_cfg(), "dp=1", TOTAL, record_samples=True)
    run_dir = str(tmp_path / "run")
    first = run_ranks(n_ranks("dp_replicate=2"), train_body, ckpt_cfg(), "dp_replicate=2", HALF, run_dir,
                      return_params=False, record_samples=True)
    second = continue_run(run_dir, "dp=2", TOTAL)
    assert {r["resumed_from"] for r in second} == {HALF}
    assert_losses(reference, first, 0)
    assert_losses(reference, second, HALF)
    assert_params(reference, second)
    assert_samples(reference, first, second)
