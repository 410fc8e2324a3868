"""Tier 1: choosing the mixed-precision policy from (dtype, device, layout), and the config fields."""

import pytest
import torch

from parallel.layout import Layout
from parallel.precision import PrecisionPolicy, select_precision
from workers.config import ConfigError, JobConfig


def test_float32_keeps_todays_behaviour_under_every_layout():
    for layout in (Layout(), Layout(dp_shard=2), Layout(dp_replicate=2), Layout(tp=2), Layout(pp=2)):
        for device in ("cpu", "cuda"):
            p = select_precision("float32", device, layout)
            assert p == PrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, shard_single_rank=False)
            assert not p.mixed


@pytest.mark.parametrize("layout,single", [
    (Layout(), True),                      # dp == 1: wrap on the size-1 dp_shard axis, or nothing casts
    (Layout(tp=2), True),
    (Layout(pp=2), True),
    (Layout(tp=2, pp=2), True),
    (Layout(dp_shard=2), False),           # FSDP wraps anyway
    (Layout(dp_replicate=2), False),
    (Layout(dp_replicate=2, dp_shard=2, tp=2), False),
])
def test_bfloat16_is_fsdp_mixed_precision_with_fp32_reduction(layout, single):
    p = select_precision("bfloat16", "cuda", layout)
    assert p.mixed and p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32
    assert p.shard_single_rank is single
    assert select_precision("bfloat16", "cpu", layout) == p


def test_mp_policy_is_what_fsdp_gets():
    mp = select_precision("bfloat16", "cuda", Layout(dp_shard=2)).mp_policy()
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    assert mp.output_dtype is None  # the loss upcasts logits itself; PP stages send bf16 activations
    mp32 = select_precision("float32", "cpu", Layout(dp_shard=2)).mp_policy()
    assert mp32.param_dtype is None and mp32.reduce_dtype == torch.float32


@pytest.mark.parametrize("args,needle", [
    (("float16", "cuda"), "train.dtype must be one of"),
    (("bfloat16", "mps"), "device type must be one of"),
])
def test_bad_inputs_say_what_is_wrong(args, needle):
    with pytest.raises(ValueError, match=needle):
        select_precision(*args, Layout())


def test_bfloat16_on_a_device_without_it_is_refused():
    with pytest.raises(ValueError, match="does not support bfloat16"):
        select_precision("bfloat16", "cuda", Layout(), bf16_supported=False)
    # float32 does not care
    assert not select_precision("float32", "cuda", Layout(), bf16_supported=False).mixed


def test_config_fields_defaults_and_validation():
    t = JobConfig().train
    assert (t.dtype, t.compile, t.activation_checkpointing) == ("float32", False, "none")
    cfg = JobConfig.from_dict({"train": {"dtype": "bfloat16", "compile": True,
                                         "activation_checkpointing": "selective"}})
    assert (cfg.train.dtype, cfg.train.compile, cfg.train.activation_checkpointing) == ("bfloat16", True, "selective")
    for bad, needle in [({"dtype": "fp16"}, "train.dtype: expected one of"),
                        ({"compile": "yes"}, "train.compile: expected true or false"),
                        ({"activation_checkpointing": True}, "train.activation_checkpointing: expected one of")]:
        with pytest.raises(ConfigError, match=needle):
            JobConfig.from_dict({"train": bad})


def test_loss_is_taken_in_fp32_on_bf16_logits():
    from parallel.parallelize import cross_entropy

    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    targets = torch.randint(0, 7, (2, 3))
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    want = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
    # The chunked loss sums in another order than F.cross_entropy: equal to fp32 rounding, where a loss
    # taken in bf16 would be off by ~1e-3 relative.
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
