"""Tier 2: `parallel.sharding` predicts exactly the boxes `parallelize()` gives every rank.

The live-reshard planner (`parallel.exchange`) plans from predicted boxes before any process group of
the new layout exists, so each layout kind is checked against the real DTensors (or plain tensors under
DDP): FSDP over 3 ranks (uneven), FSDP x TP (strided shards, uneven vocab rows), TP inside a pipeline
with uneven stages, and replication; and a model with every option that adds or shares a tensor (tied
table on both pipeline ends, attention biases, q/k norms, an independent head size).
"""

from __future__ import annotations

import pytest

from tests.multiproc import rank_device, run_ranks

pytestmark = pytest.mark.dist

SHAPE = {"preset": "tiny", "n_layers": 3, "vocab_size": 261, "ffn_hidden": 90}
OPTIONS = {"family": "qwen3", "qk_norm": True, "qkv_bias": True, "out_bias": True, "tie_embeddings": True,
           "head_size": 48}


def boxes_body(layout_text: str, options: dict | None = None) -> list[str]:
    import torch
    import torch.distributed as dist

    from models.config import model_config
    from models.llama import build_model
    from parallel.checkpoint.state import local_box, named_state
    from parallel.layout import Layout
    from parallel.parallelize import materialize, parallelize
    from parallel.sharding import Box, boxes

    layout = Layout.parse(layout_text)
    cfg = model_config(SHAPE["preset"], **{k: v for k, v in SHAPE.items() if k != "preset"}, **(options or {}))
    full = {n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()}
    model = build_model(cfg)
    device = rank_device()
    parallelize(model, layout=layout, mesh=layout.build_mesh(device.type))
    materialize(model, seed=0, device=device)
    want = boxes(layout, full, cfg.n_layers, optimizer_states=(), tied=cfg.tie_embeddings)[dist.get_rank()]
    got = {}
    for name, t in named_state(model).items():
        local, offsets = local_box(t)
        if local.numel():
            got[f"model.{name}"] = Box(offsets, tuple(local.shape))
    return [f"rank {dist.get_rank()} {k}: parallelize gives {got.get(k)}, sharding predicts {want.get(k)}"
            for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]


@pytest.mark.parametrize("layout,options", [("dp=3", None), ("dp_shard=2,tp=2", None), ("pp=2,tp=2", None),
                                            ("dp_replicate=2", None), ("dp_shard=2,pp=2,tp=2", OPTIONS)])
def test_predicted_boxes_match_parallelize(layout, options):
    from parallel.layout import Layout

    problems = [p for rank in run_ranks(Layout.parse(layout).world_size, boxes_body, layout, options) for p in rank]
    assert problems == []
