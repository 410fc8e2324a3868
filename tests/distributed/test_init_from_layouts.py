"""Tier 2: a Trainer started from a Hugging Face Llama (model.init_from) under dp, tp=2, pp=2 and 2x2 takes
the first step on the same model transformers computes: its loss equals transformers' loss on the same
batch, and the logits of that step's forward (on every rank holding the output projection: the last
pipeline stage, gathered across TP ranks) equal transformers' logits on the very inputs that rank saw (fp32,
1e-4); and init_from -> 0 steps -> export gives back the very same weights."""

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
    from torch.distributed.tensor import DTensor

    from parallel.layout import Layout
    from tests.multiproc import rank_device
    from workers.config import JobConfig
    from workers.disk_checks import resolve_init_from
    from workers.trainer import Trainer

    cfg = resolve_init_from(JobConfig.from_dict(cfg_dict))  # as the trainer's edge does
    trainer = Trainer(cfg, layout=Layout.parse(layout), device=rank_device(), run_dir=run_dir).build()
    trainer.fit(0)  # 0 steps: only the final save, of the weights as loaded
    # The first step's own forward, before its optimizer update: the inputs this rank is given and the
    # output projection's result for each microbatch, in order (the pipeline schedule runs them in order).
    inputs, logits = [], []
    trainer.on_batch = lambda batch: inputs.append(batch.stacked()[0])
    if trainer.model.output is not None:  # the last pipeline stage only
        trainer.model.output.register_forward_hook(lambda mod, args, out: logits.append(out.detach()))
    m = trainer.train_step()
    # The step's microbatches are its last forwards: a pipeline stage's first step runs one more before
    # them, on uninitialised tensors, to infer its shapes. Under TP the logits are vocab-sharded DTensors:
    # gather them (a collective over the TP ranks, which all hold the output projection).
    assert not logits or len(logits) >= trainer.n_microbatches, len(logits)
    logits = [t.full_tensor() if isinstance(t, DTensor) else t for t in logits[-trainer.n_microbatches:]]
    trainer.close()
    out = {"loss": m.loss, "inputs": inputs[0]}
    if logits:
        out["logits"] = torch.cat(logits)
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).float().eval()
    model.save_pretrained(path)
    return str(path), model


def transformers_logits(model, inputs):
    import torch

    with torch.no_grad():
        return model(inputs).logits.float()


def transformers_loss(model, cfg_dict: dict) -> float:
    """transformers' mean next-token loss on the trainer's first global batch."""
    import torch

    from workers.data import SyntheticSource, global_sample_ids

    d, t = cfg_dict["data"], cfg_dict["train"]
    src = SyntheticSource(num_samples=d["num_samples"], seq_len=d["seq_len"], vocab_size=HF["vocab_size"], seed=SEED)
    ids = global_sample_ids(0, t["global_batch_size"], n_samples=len(src), seed=SEED)
    tokens = torch.from_numpy(__import__("numpy").stack([src.sample(int(i)) for i in ids]))
    logits = transformers_logits(model, tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


@pytest.mark.parametrize("layout", ["dp=2", "tp=2", "pp=2", "dp=2,tp=2"])
def test_first_step_and_export_match_transformers(hf, tmp_path, layout):
    import torch
    from safetensors.torch import load_file

    from parallel.layout import Layout
    from service.server.tools import export_checkpoint

    path, model = hf
    cfg = job(path)
    results = run_ranks(Layout.parse(layout).world_size, first_step_body, cfg, layout, str(tmp_path / "run"))
    want = transformers_loss(model, cfg)
    for r in results:
        assert r["loss"] == pytest.approx(want, rel=1e-4), (layout, r["loss"], want)
    lay = Layout.parse(layout)
    holders = [rank for rank, r in enumerate(results) if "logits" in r]
    assert len(holders) == lay.world_size // lay.pp, (layout, holders)  # every rank of the last stage
    for rank in holders:
        got, x = results[rank]["logits"], results[rank]["inputs"]
        assert got.shape == (*x.shape, HF["vocab_size"]), (layout, rank, got.shape)
        torch.testing.assert_close(got, transformers_logits(model, x), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, rank=rank: f"{layout} rank {rank}: {m}")

    out = export_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "export")  # what `elastron export` runs
    back, orig = load_file(str(out / "model.safetensors")), load_file(f"{path}/model.safetensors")
    assert back.keys() == orig.keys()
    for k in orig:
        assert back[k].equal(orig[k]), k
