"""Hugging Face export: our model and the exported `LlamaForCausalLM` must give the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from models.config import ModelConfig, model_config
from models.llama import apply_rope, build_model, init_value, rope_tables
from parallel.export import hf_config, interleaved_to_halves, to_hf_state_dict, write_hf

# init_std=0.1 makes attention sharp enough that a wrong RoPE layout or theta moves the logits by ~1
# (at the default 0.02 attention is nearly uniform and the same mistakes move them by only ~1e-3).
CASES = {
    "tiny_gqa": model_config("tiny", init_std=0.1),  # 4 heads / 2 kv heads: n_rep 2
    "odd_layers_rep4": model_config("tiny", n_layers=3, n_heads=8, n_kv_heads=2, rope_theta=500000.0,
                                    init_std=0.1),
    "tiny_default_init": model_config("tiny"),
}


def _model(cfg: ModelConfig, seed: int = 0):
    model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_value(cfg, name, p.shape, seed))
    return model.eval()


def _state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return dict(_model(cfg).state_dict())


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = CASES[case]
    ours = _model(cfg)
    out = write_hf(ours.state_dict(), cfg, tmp_path / "hf")

    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        out, attn_implementation="eager", output_loading_info=True)
    hf.eval()
    assert hf.dtype == torch.float32
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ours(tokens)
        got = hf(tokens).logits
    # Both are fp32 with the same math in a different op order; observed differences are <= ~3e-6 on
    # logits of magnitude ~4. 1e-5 of the logit scale leaves >10x headroom, while a wrong q/k
    # permutation or rope_theta is off by >1e-3 even at the default (near-uniform attention) init.
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("n_heads,head_dim", [(4, 32), (2, 8)])
def test_permutation_turns_interleaved_rope_into_rotate_half(n_heads, head_dim):
    """perm(rope_interleaved(W x)) == rope_rotate_half(perm(W) x), checked against HF's own RoPE."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    dim, T = 24, 16
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_heads * head_dim, dim, generator=g)
    x = torch.randn(1, T, dim, generator=g)
    cos, sin = rope_tables(head_dim, T, 10000.0)

    ours = apply_rope((x @ w.T).view(1, T, n_heads, head_dim), cos, sin)  # [B, T, H, D]
    ours = (ours.reshape(1, T, -1) @ _row_permutation(n_heads, head_dim)).view(1, T, n_heads, head_dim)

    q = (x @ interleaved_to_halves(w, n_heads).T).view(1, T, n_heads, head_dim).transpose(1, 2)
    hf_cos, hf_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # HF's layout
    theirs, _ = llama.apply_rotary_pos_emb(q, q, hf_cos, hf_sin)
    torch.testing.assert_close(theirs.transpose(1, 2), ours, atol=1e-5, rtol=1e-5)


def _row_permutation(n_heads: int, head_dim: int) -> torch.Tensor:
    """Matrix P with (y @ P)[..., new] = y[..., old] for the per-head interleaved -> halves order."""
    n = n_heads * head_dim
    return interleaved_to_halves(torch.eye(n), n_heads).T


def test_permutation_rows():
    w = torch.arange(8.0).repeat_interleave(2).view(8, 2)  # row r holds r
    assert interleaved_to_halves(w, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_names_and_config():
    cfg = CASES["odd_layers_rep4"]
    hf = to_hf_state_dict(_state(cfg), cfg)
    assert len(hf) == 3 + 9 * cfg.n_layers
    assert hf["model.layers.2.self_attn.k_proj.weight"].shape == (2 * cfg.head_dim, cfg.dim)
    assert hf["model.layers.0.mlp.down_proj.weight"].shape == (cfg.dim, cfg.ffn_hidden)
    c = hf_config(cfg)
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (
        3, 8, 2, 16)
    assert c["rope_theta"] == c["rope_parameters"]["rope_theta"] == 500000.0
    assert c["tie_word_embeddings"] is False and c["torch_dtype"] == "float32"


def test_missing_unexpected_and_misshapen_keys_are_named():
    cfg = CASES["tiny_gqa"]
    state = _state(cfg)
    del state["layers.1.feed_forward.w3.weight"]
    state["layers.9.attention.wq.weight"] = torch.zeros(1)
    state["norm.weight"] = torch.ones(cfg.dim + 1)
    with pytest.raises(ValueError) as e:
        to_hf_state_dict(state, cfg)
    msg = str(e.value)
    assert "missing key(s): layers.1.feed_forward.w3.weight" in msg
    assert "unexpected key(s): layers.9.attention.wq.weight" in msg
    assert f"norm.weight ({cfg.dim + 1},) != ({cfg.dim},)" in msg


def test_mixed_dtypes_refused(tmp_path):
    cfg = CASES["tiny_gqa"]
    state = _state(cfg)
    state["norm.weight"] = state["norm.weight"].bfloat16()
    with pytest.raises(ValueError, match="mixes dtypes"):
        write_hf(state, cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_bf16_state_records_its_dtype(tmp_path):
    cfg = CASES["tiny_gqa"]
    state = {k: v.bfloat16() for k, v in _state(cfg).items()}
    out = write_hf(state, cfg, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_overwrite_refused_then_allowed(tmp_path):
    cfg = CASES["tiny_gqa"]
    state = _state(cfg)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match="not empty; pass --overwrite to replace the files an export writes"):
        write_hf(state, cfg, out)
    assert (out / "keep.txt").read_text() == "old"

    write_hf(state, cfg, out, overwrite=True, max_shard_size="100KB")  # shards and an index
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    write_hf(state, cfg, out, overwrite=True)  # one file again: the older export's shards go, keep.txt stays
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "keep.txt", "model.safetensors"]
    assert (out / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp or backup dirs left


def test_empty_dir_is_fine_and_file_target_refused(tmp_path):
    cfg = CASES["tiny_gqa"]
    state = _state(cfg)
    (tmp_path / "empty").mkdir()
    write_hf(state, cfg, tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        write_hf(state, cfg, tmp_path / "file", overwrite=True)


def test_crash_mid_write_leaves_old_export(tmp_path, monkeypatch):
    import safetensors.torch

    cfg = CASES["tiny_gqa"]
    state = _state(cfg)
    out = tmp_path / "hf"
    write_hf(state, cfg, out)
    before = (out / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_hf(state, cfg, out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before
    with pytest.raises(OSError, match="disk full"):
        write_hf(state, cfg, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_halves_to_interleaved_undoes_the_export_permutation():
    from parallel.export import halves_to_interleaved

    w = torch.randn(12, 5)
    for heads in (1, 2, 3):
        assert torch.equal(halves_to_interleaved(interleaved_to_halves(w, heads), heads), w)
