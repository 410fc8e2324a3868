"""Choosing the mixed-precision policy from (dtype, device), the config fields, and that weights cast at
use give the arithmetic FSDP2's mixed precision gives.

Tier 1: the policy and its validation. Tier 2 (one gloo rank, FSDP2 needs a process group): dp=1 in bf16
runs the model unwrapped, its weights cast where they are used, and trains bitwise like FSDP2's
`MixedPrecisionPolicy` on a size-1 mesh (how dp=1 ran before, and what every FSDP2 layout does): the
same losses and parameters over steps with gradient accumulation, with one fp32 -> bf16 cast per weight
per forward, where FSDP2 copies each weight three times (cast into the all-gather buffer, through the
all-gather, out of it) and each gradient twice more in backward.
"""

import pytest
import torch

from parallel.layout import Layout
from parallel.precision import PrecisionPolicy, select_precision
from tests.multiproc import run_ranks
from workers.config import ConfigError, JobConfig


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float32_computes_in_the_parameters_dtype(device):
    p = select_precision("float32", device)
    assert p == PrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    assert not p.mixed


def test_bfloat16_is_bf16_compute_with_fp32_reduction():
    p = select_precision("bfloat16", "cuda")
    assert p.mixed and p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32
    assert select_precision("bfloat16", "cpu") == p


def test_mp_policy_is_what_fsdp_gets():
    mp = select_precision("bfloat16", "cuda").mp_policy()
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    assert mp.output_dtype is None  # the loss upcasts logits itself; PP stages send bf16 activations
    assert mp.cast_forward_inputs is False  # the fp32 RoPE tables blocks take stay fp32, as without FSDP2
    mp32 = select_precision("float32", "cpu").mp_policy()
    assert mp32.param_dtype is None and mp32.reduce_dtype == torch.float32


@pytest.mark.parametrize("args,needle", [
    (("float16", "cuda"), "train.dtype must be one of"),
    (("bfloat16", "mps"), "device type must be one of"),
])
def test_bad_inputs_say_what_is_wrong(args, needle):
    with pytest.raises(ValueError, match=needle):
        select_precision(*args)


def test_bfloat16_on_a_device_without_it_is_refused():
    with pytest.raises(ValueError, match="does not support bfloat16"):
        select_precision("bfloat16", "cuda", bf16_supported=False)
    # float32 does not care
    assert not select_precision("float32", "cuda", bf16_supported=False).mixed


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
    from parallel.loss import cross_entropy

    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    targets = torch.randint(0, 7, (2, 3))
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    want = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
    # The chunked loss sums in another order than F.cross_entropy: equal to fp32 rounding, where a loss
    # taken in bf16 would be off by ~1e-3 relative.
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)


# -- tier 2: weights cast at use against FSDP2 on a size-1 mesh --------------------------------------

def _casts(fn, weights: set[int]) -> dict[str, int]:
    """What `fn()` runs: fp32 -> bf16 casts of the weights (by storage address in `weights`), other fp32
    -> bf16 casts (activations, their gradients), and copies of bf16 data."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    counts = {"weight casts": 0, "other casts": 0, "bf16 copies": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            src = args[1] if func is aten.copy_.default else args[0] if args else None
            if isinstance(src, torch.Tensor):
                if func in (aten._to_copy.default, aten.copy_.default) and src.dtype == torch.float32:
                    dst = kwargs.get("dtype") if func is aten._to_copy.default else args[0].dtype
                    if dst == torch.bfloat16:
                        counts["weight casts" if src.data_ptr() in weights else "other casts"] += 1
                elif func in (aten.copy_.default, aten.split_with_sizes_copy.default, aten.cat.default,
                              aten._foreach_copy_.default) and src.dtype == torch.bfloat16:
                    counts["bf16 copies"] += 1
            return func(*args, **kwargs)

    with Count():
        fn()
    return counts


def cast_at_use_body(steps: int, accum: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from models.config import PRESETS
    from models.llama import build_model
    from parallel.loss import cross_entropy
    from parallel.parallelize import materialize, parallelize

    cfg = PRESETS["tiny"]
    layout = Layout()
    bf16 = select_precision("bfloat16", "cpu")
    out = {}
    for name in ("cast_at_use", "fsdp_size1"):
        with torch.device("meta"):
            model = build_model(cfg)
        mesh = layout.build_mesh("cpu")
        parallelize(model, layout=layout, mesh=mesh, precision=bf16)
        if name == "fsdp_size1":
            for block in model.layers.values():
                fully_shard(block, mesh=mesh["dp_shard"], mp_policy=bf16.mp_policy(), reshard_after_forward=False)
            fully_shard(model, mesh=mesh["dp_shard"], mp_policy=bf16.mp_policy(), reshard_after_forward=False)
        materialize(model, seed=0, device=torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        g = torch.Generator().manual_seed(1)
        losses, counts = [], None

        def micro_batch(last: bool) -> None:
            if name == "fsdp_size1":
                model.set_requires_gradient_sync(last)
            x = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
            logits = model(x[:, :-1])
            out.setdefault(f"{name} logits dtype", str(logits.dtype))
            loss = cross_entropy(logits, x[:, 1:]) / accum
            loss.backward()
            losses.append(loss.item())

        for step in range(steps):
            for i in range(accum):
                if step == 1 and i == 0:
                    weights = {(p.to_local() if hasattr(p, "to_local") else p).data_ptr() for p in model.parameters()}
                    counts = _casts(lambda: micro_batch(False), weights)
                else:
                    micro_batch(i == accum - 1)
            opt.step()
            opt.zero_grad()
        out[name] = {"losses": losses, "counts": counts, "n_params": len(list(model.parameters())),
                     "wrapped": type(model).__name__,
                     "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                                for n, p in model.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def cast_at_use() -> dict:
    (res,) = run_ranks(1, cast_at_use_body, 3, 2)
    return res


def test_weights_cast_at_use_train_bitwise_like_fsdp_mixed_precision(cast_at_use):
    new, ref = cast_at_use["cast_at_use"], cast_at_use["fsdp_size1"]
    assert new["wrapped"] == "Transformer" and ref["wrapped"] != "Transformer"  # dp=1: nothing wraps it
    assert cast_at_use["cast_at_use logits dtype"] == "torch.bfloat16"
    assert len(new["losses"]) == 6
    assert new["losses"] == ref["losses"]
    assert new["params"].keys() == ref["params"].keys()
    for n, p in new["params"].items():
        assert p.dtype == torch.float32, n  # master weights stay fp32
        assert torch.equal(p, ref["params"][n]), n


def test_weights_cast_at_use_cast_once_and_copy_nothing(cast_at_use):
    new, ref = cast_at_use["cast_at_use"], cast_at_use["fsdp_size1"]
    # One micro-batch (forward and backward): each weight is cast once, no bf16 data is copied.
    assert new["counts"]["weight casts"] == new["n_params"] == ref["counts"]["weight casts"]
    assert new["counts"]["bf16 copies"] == 0
    # FSDP2: each cast weight copied again at least once (out of the all-gather buffer; the copy into it
    # and the gather run in FSDP2's own op and the process group, which this count does not see)
    assert ref["counts"]["bf16 copies"] >= ref["n_params"]
    assert new["counts"]["other casts"] == ref["counts"]["other casts"]  # activations: the same arithmetic
