"""Tier 1: which layers `parallel.float8` converts, that names, shapes and dtypes stay, and its refusals."""

from __future__ import annotations

import pytest
import torch

from models.config import model_config
from models.llama import build_model
from parallel.float8 import convert_float8, float8_unavailable_reason, keeps_high_precision
from parallel.parallelize import materialize

pytest.importorskip("torchao.float8")


def _tensors(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_blocks_are_converted_and_the_output_head_is_not(recipe):
    from torchao.float8.float8_linear import Float8Linear

    cfg = model_config("tiny", n_layers=2)
    plain, model = build_model(cfg), build_model(cfg)
    swapped = convert_float8(model, recipe, emulate=True, fsdp_float8_all_gather=False)
    per_block = ["attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert sorted(swapped) == sorted(f"layers.{i}.{n}" for i in range(2) for n in per_block)
    assert not isinstance(model.output, Float8Linear)
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in swapped)
    assert _tensors(model) == _tensors(plain)  # checkpoints, live reshards and export see the same tensors


def test_layers_whose_dims_are_not_multiples_of_16_stay_in_high_precision():
    # dim 40 (heads of 10): no attention projection qualifies; ffn 96 x 40 neither.
    cfg = model_config("tiny", n_layers=1, dim=40, n_heads=4, n_kv_heads=2, ffn_hidden=96)
    model = build_model(cfg)
    assert convert_float8(model, "tensorwise", emulate=True, fsdp_float8_all_gather=False) == []
    assert keeps_high_precision(torch.nn.Linear(48, 32, device="meta"), "layers.0.attention.wq") is False
    assert keeps_high_precision(torch.nn.Linear(48, 32, device="meta"), "output") is True
    assert keeps_high_precision(torch.nn.Linear(48, 40, device="meta"), "layers.0.feed_forward.w1") is True


def test_none_converts_nothing():
    model = build_model(model_config("tiny", n_layers=1))
    assert convert_float8(model, "none", emulate=True, fsdp_float8_all_gather=False) == []


def test_emulated_float8_trains_close_to_fp32_with_fp32_gradients():
    """The emulated float8 forward differs from fp32 (so the casts happen) by what float8's rounding
    explains, and gradients land in the fp32 master weights under the same names."""
    cfg = model_config("tiny", n_layers=2)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for recipe in ("none", "tensorwise", "rowwise"):
        model = build_model(cfg)
        convert_float8(model, recipe, emulate=True, fsdp_float8_all_gather=False)
        materialize(model, seed=0, device=torch.device("cpu"))
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None and g.dtype == torch.float32 for g in grads.values()), recipe
        out[recipe] = logits.detach()
    for recipe in ("tensorwise", "rowwise"):
        err = (out[recipe] - out["none"]).norm() / out["none"].norm()
        assert 1e-4 < err < 5e-2, (recipe, float(err))


def test_refusals_say_what_to_do():
    assert float8_unavailable_reason("none", "cuda", dtype="float32") is None
    assert float8_unavailable_reason("tensorwise", "cpu", dtype="float32") is None  # emulated
    assert "got 'fp8'" in float8_unavailable_reason("fp8", "cpu", dtype="float32")
    assert "set train.dtype: bfloat16" in float8_unavailable_reason("rowwise", "cuda", dtype="float32")
    assert "not supported on device type 'mps'" in float8_unavailable_reason("rowwise", "mps", dtype="bfloat16")


def test_without_torchao_the_reason_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an install without the extra sees
    reason = float8_unavailable_reason("tensorwise", "cpu", dtype="float32")
    assert reason is not None and "install elastron[float8]" in reason


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_bf16_compute_over_fp32_weights(recipe):
    """train.dtype bfloat16 at dp=1: bf16 activations reach float8 layers whose weights stay fp32 (no
    FSDP2 casts them); the float8 casts take the fp32 weight, and its gradient lands in fp32."""
    cfg = model_config("tiny", n_layers=1)
    model = build_model(cfg)
    convert_float8(model, recipe, emulate=True, fsdp_float8_all_gather=False)
    materialize(model, seed=0, device=torch.device("cpu"))
    model.tok_embeddings.compute_dtype = torch.bfloat16  # what parallelize sets for bf16
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(x)
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    w = model.layers["0"].attention.wq.weight
    assert w.dtype == torch.float32 and w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0
