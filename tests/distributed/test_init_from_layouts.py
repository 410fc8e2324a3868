"""Tier 2: a Trainer started from a Hugging Face Llama (model.init_from) under dp, tp=2, pp=2 and 2x2 takes
the first step on the same model transformers computes: its loss equals transformers' loss on the same
batch (fp32, 1e-4 relative), and init_from -> 0 steps -> export gives back the very same weights."""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

SEED = 7
HF = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
          intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False)


def job(hf_dir: str) -> dict:
    return {"model": {"init_from": hf_dir},
            "data": {"source": "synthetic", "seq_len": 16, "num_samples": 64},
            "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 1, "seed": SEED},
            "checkpoint": {"async_save": False}}


def first_step_body(cfg_dict: dict, layout: str, run_dir: str) -> dict:
    import torch

    from parallel.layout import Layout
    from workers.config import JobConfig, resolve_init_from
    from workers.trainer import Trainer

    cfg = resolve_init_from(JobConfig.from_dict(cfg_dict))  # as the trainer's edge does
    trainer = Trainer(cfg, layout=Layout.parse(layout), device=torch.device("cpu"), run_dir=run_dir).build()
    trainer.fit(0)  # 0 steps: only the final save, of the weights as loaded
    m = trainer.train_step()
    trainer.close()
    return {"loss": m.loss}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).float().eval()
    model.save_pretrained(path)
    return str(path), model


def transformers_loss(model, cfg_dict: dict) -> float:
    """transformers' mean next-token loss on the trainer's first global batch."""
    import torch

    from workers.data import SyntheticSource, global_sample_ids

    d, t = cfg_dict["data"], cfg_dict["train"]
    src = SyntheticSource(num_samples=d["num_samples"], seq_len=d["seq_len"], vocab_size=HF["vocab_size"], seed=SEED)
    ids = global_sample_ids(0, t["global_batch_size"], n_samples=len(src), seed=SEED)
    tokens = torch.from_numpy(__import__("numpy").stack([src.sample(int(i)) for i in ids]))
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


@pytest.mark.parametrize("layout", ["dp=2", "tp=2", "pp=2", "dp=2,tp=2"])
def test_first_step_and_export_match_transformers(hf, tmp_path, layout):
    from safetensors.torch import load_file

    from parallel.layout import Layout
    from service.tools import export_checkpoint

    path, model = hf
    cfg = job(path)
    results = run_ranks(Layout.parse(layout).world_size, first_step_body, cfg, layout, str(tmp_path / "run"))
    want = transformers_loss(model, cfg)
    for r in results:
        assert r["loss"] == pytest.approx(want, rel=1e-4), (layout, r["loss"], want)

    out = export_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "export")  # what `elastron export` runs
    back, orig = load_file(str(out / "model.safetensors")), load_file(f"{path}/model.safetensors")
    assert back.keys() == orig.keys()
    for k in orig:
        assert back[k].equal(orig[k]), k
