"""Tier 2: Hugging Face weights load straight into any layout, each rank reading only its slices.

Every rank's shard of every parameter must equal the same slice of the model loaded in one process
(which tests/parallel/test_hf_import.py checks against transformers' logits), under FSDP, TP, a
pipeline and FSDP x TP; and no rank reads the whole checkpoint when it holds a part of it.
"""

from __future__ import annotations

import pytest

from tests.multiproc import rank_device, run_ranks

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")


def layout_body(path: str, layout_text: str) -> dict:
    import torch
    import torch.distributed as dist

    from models.llama import build_model
    from parallel.checkpoint.state import local_box
    from parallel.hf_import import check_hf_dir, load_hf_weights, model_config_from_hf
    from parallel.layout import Layout
    from parallel.parallelize import materialize, parallelize

    cfg = model_config_from_hf(path)
    weights = check_hf_dir(path, cfg)
    full = build_model(cfg)
    materialize(full, seed=1, device=torch.device("cpu"))
    load_hf_weights(full, weights, cfg)
    want = dict(full.named_parameters())
    layout = Layout.parse(layout_text)
    model = build_model(cfg)
    device = rank_device()
    parallelize(model, layout=layout, mesh=layout.build_mesh(device.type))
    materialize(model, seed=2, device=device)
    nbytes = load_hf_weights(model, weights, cfg)
    bad = []
    for name, t in model.state_dict(keep_vars=True).items():
        local, offs = local_box(t)
        ref = want[name].detach()[tuple(slice(o, o + n) for o, n in zip(offs, local.shape))]
        if not torch.equal(local.cpu(), ref):
            bad.append(f"rank {dist.get_rank()} {name}")
    return {"bad": bad, "read": nbytes, "total": sum(p.numel() * 4 for p in full.parameters())}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=96, intermediate_size=48, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("layout", ["dp=2", "tp=2", "pp=2", "dp_shard=2,tp=2"])
def test_hf_weights_load_into_every_layout(hf_dir, layout):
    from parallel.layout import Layout

    results = run_ranks(Layout.parse(layout).world_size, layout_body, hf_dir, layout)
    assert [b for r in results for b in r["bad"]] == []
    assert all(r["read"] < r["total"] for r in results)  # nobody reads a full copy
