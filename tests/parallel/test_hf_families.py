"""Tier 1: every model family starts from Hugging Face weights with transformers' logits, and its export
loads back into transformers with the same logits (fp32, 1e-4 relative): Llama 3.1/3.2 RoPE scaling
(llama3, linear, dynamic), tied embeddings, attention biases (Llama, Qwen2), q/k norms with an
independent head_dim (Qwen3), Mistral."""

from __future__ import annotations

import json

import pytest
import torch

from models.llama import build_model
from parallel.export import write_hf
from parallel.hf_import import check_hf_dir, load_hf_weights, model_config_from_hf
from parallel.parallelize import materialize
from tests.hf_families import FAMILIES, make_hf

transformers = pytest.importorskip("transformers")


def ours(path):
    cfg = model_config_from_hf(path)
    model = build_model(cfg)
    materialize(model, seed=3, device=torch.device("cpu"))
    load_hf_weights(model, check_hf_dir(path, cfg), cfg)
    return cfg, model


def assert_close_rel(got, want, what):
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel <= 1e-4, f"{what}: max relative difference {rel:.2e}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_export_round_trip_match_transformers(family, tmp_path):
    ref = make_hf(family, tmp_path / "hf")
    cfg, model = ours(tmp_path / "hf")
    x = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x).logits
        assert_close_rel(model(x), want, f"{family} import")

    state = {n: p.detach() for n, p in model.named_parameters()}
    write_hf(state, cfg, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(back) is type(ref)
    with torch.no_grad():
        assert_close_rel(back(x).logits, want, f"{family} export")
    assert model_config_from_hf(tmp_path / "out") == cfg  # the export describes the very same model


def test_tied_embeddings_are_one_tensor():
    from models.config import ModelConfig

    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, ffn_hidden=32, tie_embeddings=True)
    model = build_model(cfg)
    materialize(model, seed=1, device=torch.device("cpu"))
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters()].count("tok_embeddings.weight") == 1
    assert "output.weight" not in dict(model.named_parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_a_sliding_window_shorter_than_seq_len_is_refused(tmp_path):
    from workers.config import ConfigError, JobConfig
    from workers.disk_checks import resolve_init_from

    make_hf("mistral", tmp_path / "hf")
    job = {"model": {"init_from": str(tmp_path / "hf")}, "data": {"source": "synthetic", "seq_len": 48}}
    with pytest.raises(ConfigError, match=r"data.seq_len=48 is longer than the model's sliding_window=32; .* "
                                          r"set data.seq_len <= 32"):
        resolve_init_from(JobConfig.from_dict(job))


@pytest.mark.parametrize("fields,needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     "rope_scaling type 'yarn' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor is not supported"),
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported; supported: llama, mistral, qwen2, qwen3"),
])
def test_what_is_still_refused_names_the_field(tmp_path, fields, needle):
    from models.hf_config import HFImportError

    make_hf("llama3.2", tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    if "rope_scaling" in fields:
        d.pop("rope_parameters", None)  # transformers 5 writes the scaling there; the refusal reads either
    d.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(HFImportError, match=needle):
        model_config_from_hf(tmp_path)
