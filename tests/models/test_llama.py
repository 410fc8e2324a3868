"""Tier 1: the model alone (single process, no torch.distributed)."""

import pytest
import torch

from models.config import PRESETS, model_config
from models.llama import Transformer, build_model, init_value
from parallel.pipeline import split_stage, stage_layers


def materialized(cfg, seed=0) -> Transformer:
    m = build_model(cfg)
    m.to_empty(device="cpu")
    m.init_buffers("cpu")
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(init_value(cfg, name, p.shape, seed))
    return m


def test_num_params_matches_module_for_every_preset():
    for name, cfg in PRESETS.items():
        m = build_model(cfg)  # meta device: no memory even for 8b
        assert sum(p.numel() for p in m.parameters()) == cfg.num_params(), name
        assert all(p.device.type == "meta" for p in m.parameters())


def test_preset_sizes_are_what_their_names_say():
    approx = {"tiny": 1e6, "small": 25e6, "125m": 125e6, "1b": 1.1e9, "8b": 8e9}
    for name, target in approx.items():
        n = PRESETS[name].num_params()
        assert 0.8 * target < n < 1.2 * target, (name, n)


def test_init_depends_on_seed_and_name_only():
    cfg = model_config("tiny")
    a = init_value(cfg, "layers.1.attention.wq.weight", (128, 128), seed=3)
    b = init_value(cfg, "layers.1.attention.wq.weight", (128, 128), seed=3)
    c = init_value(cfg, "layers.2.attention.wq.weight", (128, 128), seed=3)
    d = init_value(cfg, "layers.1.attention.wq.weight", (128, 128), seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    assert torch.equal(init_value(cfg, "norm.weight", (128,), 0), torch.ones(128))


def test_forward_shapes_and_causality():
    cfg = model_config("tiny", n_layers=2)
    m = materialized(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    y = m(x)
    assert y.shape == (2, 16, cfg.vocab_size)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % cfg.vocab_size
    y2 = m(x2)
    torch.testing.assert_close(y[:, :10], y2[:, :10])  # the future does not leak into the past
    assert not torch.allclose(y[:, 10:], y2[:, 10:])


def test_pipeline_stages_keep_canonical_names_and_compose_to_the_full_model():
    cfg = model_config("tiny", n_layers=3)
    full = materialized(cfg)
    names = {n for n, _ in full.named_parameters()}
    stages = [split_stage(materialized(cfg), s, 2) for s in range(2)]
    stage_names = [{n for n, _ in s.named_parameters()} for s in stages]
    assert stage_names[0] | stage_names[1] == names and not stage_names[0] & stage_names[1]
    assert "tok_embeddings.weight" in stage_names[0] and "output.weight" in stage_names[1]
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    torch.testing.assert_close(stages[1](stages[0](x)), full(x))


def test_stage_layers_is_balanced_and_covers_all_layers():
    for n in range(1, 12):
        for pp in range(1, n + 1):
            split = stage_layers(n, pp)
            assert [i for s in split for i in s] == list(range(n))
            sizes = [len(s) for s in split]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_equals_repeated_kv_heads(dtype):
    """K/V heads are not repeated in memory (SDPA's enable_gqa), and the result is what repeating gives,
    for the global head counts and for TP's local ones (4/2 heads over tp=2: 2 query heads on 1 K/V)."""
    from models.llama import causal_attention

    g = torch.Generator().manual_seed(0)
    for hq, hkv in ((4, 2), (2, 1), (4, 4)):
        q, k, v = (torch.randn(2, h, 16, 8, generator=g).to(dtype) for h in (hq, hkv, hkv))
        rep = hq // hkv
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        torch.testing.assert_close(causal_attention(q, k, v), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not a multiple"):
        causal_attention(torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))


def test_building_the_meta_model_computes_nothing():
    """The meta model draws no default init and computes no RoPE table: on the meta device those run
    torch's Python references, whose first call imports torch._dynamo (over a second of a fresh process's
    build). Checked in a fresh interpreter, where nothing has imported it yet."""
    import subprocess
    import sys

    code = ("import sys, torch; from models.config import model_config; from models.llama import build_model; "
            "m = build_model(model_config('tiny')); "
            "assert m.rope_cos.is_meta and m.rope_cos.shape == (m.cfg.max_seq_len, m.cfg.head_dim // 2); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
