"""Tier 2: a Trainer started from each model family (tests/hf_families.py: Llama 3.2 tied + llama3 RoPE,
Qwen2.5 tied + biases, Qwen3 q/k norms, Mistral) under dp=2, tp=2 and pp=2 computes transformers' logits
at step 0 (fp32, 1e-4 relative) on every rank holding the output projection, then takes the same steps
under every layout (a tied table split across pipeline stages stays one tensor: its two copies' gradients
are summed, so the losses agree with dp's); and the step-0 checkpoint exports back to the very same
safetensors, which transformers loads."""

from __future__ import annotations

import pytest

from tests.hf_families import make_hf
from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

SEED = 7
STEPS = 3
LAYOUTS = ("dp=2", "tp=2", "pp=2")


def job(hf_dir: str) -> dict:
    return {"model": {"init_from": hf_dir},
            "data": {"source": "synthetic", "seq_len": 16, "num_samples": 64},
            "train": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 1, "seed": SEED, "lr": 3e-2,
                      "warmup_steps": 0},
            "checkpoint": {"async_save": False}}


def steps_body(jobs: list[tuple[dict, str]], layout: str) -> list[dict]:
    """Each (job, run dir) in turn on this rank: one process start for every family."""
    return [_steps(cfg_dict, layout, run_dir) for cfg_dict, run_dir in jobs]


def _steps(cfg_dict: dict, layout: str, run_dir: str) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.disk_checks import resolve_init_from
    from workers.trainer import Trainer

    cfg = resolve_init_from(JobConfig.from_dict(cfg_dict))
    trainer = Trainer(cfg, layout=Layout.parse(layout), device=torch.device("cpu"), run_dir=run_dir).build()
    trainer.fit(0)  # the weights as loaded, saved for the export
    inputs, logits = [], []
    trainer.on_batch = lambda batch: inputs.append(batch.stacked()[0])
    hook = None
    if trainer.model.output is not None:
        hook = trainer.model.output.register_forward_hook(lambda mod, args, out: logits.append(out.detach()))
    losses = [trainer.train_step().loss]
    if hook is not None:
        hook.remove()
    logits = [t.full_tensor() if isinstance(t, DTensor) else t for t in logits[-trainer.n_microbatches:]]
    losses += [trainer.train_step().loss for _ in range(STEPS - 1)]
    trainer.close()
    out = {"losses": losses, "inputs": inputs[0]}
    if logits:
        out["logits"] = torch.cat(logits)
    return out


FAMILIES = ("llama3.2", "qwen2.5", "qwen3", "mistral")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """family -> layout -> per-rank results, with the reference model and the directories."""
    from parallel.layout import Layout

    root = tmp_path_factory.mktemp("families")
    refs = {f: make_hf(f, root / f / "hf") for f in FAMILIES}
    results = {f: {} for f in FAMILIES}
    for layout in LAYOUTS:
        jobs = [(job(str(root / f / "hf")), str(root / f / layout)) for f in FAMILIES]
        per_rank = run_ranks(Layout.parse(layout).world_size, steps_body, jobs, layout, timeout=600)
        for i, f in enumerate(FAMILIES):
            results[f][layout] = [r[i] for r in per_rank]
    return root, refs, results


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_under_every_layout(family, runs, tmp_path):
    import torch
    from safetensors.torch import load_file

    from service.server.tools import export_checkpoint

    root, refs, results = runs
    ref = refs[family]
    for layout in LAYOUTS:
        for rank, r in enumerate(results[family][layout]):
            if "logits" in r:
                with torch.no_grad():
                    want = ref(r["inputs"]).logits
                rel = ((r["logits"] - want).abs().max() / want.abs().max()).item()
                assert rel <= 1e-4, f"{family} {layout} rank {rank}: step-0 logits differ by {rel:.2e}"
        out = export_checkpoint(root / family / layout / "checkpoints", tmp_path / layout)
        back, orig = load_file(str(out / "model.safetensors")), load_file(str(root / family / "hf" / "model.safetensors"))
        assert back.keys() == orig.keys(), (family, layout)
        for k in orig:
            assert back[k].equal(orig[k]), (family, layout, k)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pp=2")) is type(ref)
    losses = {layout: results[family][layout][0]["losses"] for layout in LAYOUTS}
    for layout in LAYOUTS[1:]:
        assert losses[layout] == pytest.approx(losses["dp=2"], rel=1e-4), (family, layout, losses)
