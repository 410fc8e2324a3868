"""Tier 1: starting from a Hugging Face Llama directory (a small random LlamaForCausalLM made by
transformers, no download): config, checks, weights and logits in one process."""

from __future__ import annotations

import json
import re

import pytest
import torch

from models.llama import build_model
from parallel.hf_import import HFImportError, check_hf_dir, load_hf_weights, model_config_from_hf
from parallel.parallelize import materialize

transformers = pytest.importorskip("transformers")

HF = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
          intermediate_size=48, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
          tie_word_embeddings=False)


def make_hf(path, **overrides):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF, **overrides})).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    return path, make_hf(path)


def test_logits_equal_transformers(hf_dir):
    path, ref = hf_dir
    cfg = model_config_from_hf(path)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.ffn_hidden) == (32, 3, 4, 2, 96, 48)
    model = build_model(cfg)
    materialize(model, seed=123, device=torch.device("cpu"))
    n = load_hf_weights(model, check_hf_dir(path, cfg), cfg)
    assert n == sum(p.numel() * 4 for p in model.parameters())  # every byte read once
    x = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x).float()
        theirs = ref(x).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_init_then_export_gives_back_the_same_weights(hf_dir, tmp_path):
    from safetensors.torch import load_file

    from parallel.export import write_hf

    path, ref = hf_dir
    cfg = model_config_from_hf(path)
    model = build_model(cfg)
    materialize(model, seed=5, device=torch.device("cpu"))
    load_hf_weights(model, check_hf_dir(path, cfg), cfg)
    write_hf({n: p.detach() for n, p in model.named_parameters()}, cfg, tmp_path / "out")
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = load_file(str(path / "model.safetensors"))
    assert back.keys() == want.keys()
    for k in want:
        assert torch.equal(back[k], want[k]), k


@pytest.mark.parametrize("change,needle", [
    (lambda p: (p / "config.json").unlink(), "config.json does not exist"),
    (lambda p: (p / "config.json").write_text("{"), "cannot read"),
    (lambda p: _edit(p, model_type="gpt2"), "model_type 'gpt2' is not supported; supported: llama, mistral"),
    (lambda p: _edit(p, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_scaling type 'yarn' is not supported (supported: default, dynamic, linear, llama3)"),
    (lambda p: _edit(p, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling (llama3) lacks 'low_freq_factor'"),
    (lambda p: _edit(p, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda p: _edit(p, mlp_bias=True), "mlp_bias is not supported"),
    (lambda p: _edit(p, num_hidden_layers=4), "lacks 9 tensor(s)"),
    (lambda p: _edit(p, intermediate_size=40), "config.json implies"),
    (lambda p: (p / "model.safetensors").unlink(), "has no *.safetensors"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 3), "cannot read"),
])
def test_a_bad_directory_is_one_line(hf_dir, tmp_path, change, needle):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(hf_dir[0], path)
    change(path)
    with pytest.raises(HFImportError, match=re.escape(needle)) as e:
        check_hf_dir(path)
    assert "\n" not in str(e.value) and str(e.value).startswith("model.init_from: ")


def _edit(path, **fields):
    d = json.loads((path / "config.json").read_text())
    d.update(fields)
    (path / "config.json").write_text(json.dumps(d))


def test_sharded_checkpoints_with_an_index_load(tmp_path):
    """save_pretrained with a small max_shard_size writes several files and model.safetensors.index.json."""
    ref = make_hf(tmp_path / "s")
    ref.save_pretrained(tmp_path / "s", safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "s" / "model.safetensors.index.json").exists()
    cfg = model_config_from_hf(tmp_path / "s")
    w = check_hf_dir(tmp_path / "s", cfg)
    assert len(w.manifest.files) > 1
    model = build_model(cfg)
    materialize(model, seed=1, device=torch.device("cpu"))
    load_hf_weights(model, w, cfg)
    x = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x).logits, rtol=1e-4, atol=1e-5)
