"""The GPU-path options (bf16 mixed precision, activation checkpointing, torch.compile, MFU) on CPU, and on
one GPU where there is one.

Tier 1: parameter and state-dict names do not change under AC or compile; AC really recomputes (counted
ops); compile's availability check. Tier 2 (gloo ranks): every variant of one world size trains in one
spawn (spawning and importing dominate; a variant trains in well under a second), against an fp32
reference of the same layout:

- bf16 within 2e-2 relative of fp32 over 5 steps. bf16 keeps 8 significant bits (unit roundoff 2^-8 =
  3.9e-3), every matmul input is rounded to it, and the differences compound through layers and AdamW
  updates; measured here ~5e-4, so 2e-2 is a loose bound that still fails for a broken cast or a loss
  taken in bf16 at these loss values. It must also differ from fp32 (the cast happened, dp=1 included)
  and agree across dp=1 and dp=2 within 1e-3 (the same cast points, fp32 gradient reduction); bf16
  without FSDP2 (DDP replication, PP, TP: the model casts its weights at use) agrees with dp=1 too.
- AC full and selective: the same fp32 losses within 1e-6 (the same arithmetic, recomputed).
- compile: fp32 losses within 1e-4 of eager (inductor fuses and reorders pointwise ops), under dp=2
  (FSDP) and tp=2.
- a checkpoint saved with AC on resumes with AC off and continues the straight run's losses.

torch.compile's first run compiles the block (about a minute on a 2-core box with a cold inductor cache,
seconds when warm); the compile cases are skipped with the reason where no C++ compiler is found.
CUDA-only tests run `python -m workers.train` on one GPU (bf16, the nccl path) and check a finite loss
and 0 < MFU < 1.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from tests.distributed.test_equivalence import tiny_cfg
from tests.multiproc import run_ranks

STEPS = 5
BF16_RTOL = 2e-2
COMPILE_RTOL = 1e-4
AC_RTOL = 1e-6
ROOT = Path(__file__).resolve().parents[2]


def _cfg(**train) -> dict:
    c = tiny_cfg()
    c["train"].update(train)
    return c


def _compile_reason() -> str | None:
    from parallel.parallelize import compile_unavailable_reason

    return compile_unavailable_reason("cpu")


needs_compiler = pytest.mark.skipif(_compile_reason() is not None, reason=str(_compile_reason()))


# -- rank bodies (spawned children import this module by name) --------------------------------------

def _trainer(cfg_dict: dict, layout: str, run_dir: str | None = None):
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    cfg = JobConfig.from_dict(cfg_dict)
    return Trainer(cfg, layout=Layout.parse(layout, dp_mode=cfg.parallel.dp_mode), device=torch.device("cpu"),
                   run_dir=run_dir).build()


def variants_body(cfgs: dict[str, dict], layout: str, steps: int, layouts: dict[str, str] | None = None) -> dict:
    """Train each named config from scratch under `layout` (or its own entry in `layouts`); per variant:
    losses, MFU values, and the dtype the first attention projection computed in."""
    out = {}
    for name, cfg_dict in cfgs.items():
        trainer = _trainer(cfg_dict, (layouts or {}).get(name, layout))
        seen: list[str] = []
        if not trainer.cfg.train.compile:  # a hook with Python side effects would make dynamo recompile
            first = next(iter(trainer.model.layers.values()))
            first.attention.wq.register_forward_hook(lambda m, a, o: seen.append(str(o.dtype)))
        metrics = trainer.fit(steps)
        out[name] = {"losses": [m.loss for m in metrics], "mfu": [m.mfu for m in metrics],
                     "compute_dtype": seen[0] if seen else None,
                     "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()})}
        trainer.close()
    return out


def single_rank_body(steps: int, with_compile: bool) -> dict:
    """One rank: fp32 reference and bf16 (dp=1: nothing wraps the model, which casts its weights at use),
    a checkpoint saved with AC on and resumed with AC off, and compile on (2 steps) or the check that
    refuses it."""
    import torch._inductor.config as inductor_config

    from workers.config import ConfigError

    out = variants_body({"fp32": _cfg(), "bf16": _cfg(dtype="bfloat16")}, "dp=1", steps)
    with tempfile.TemporaryDirectory() as run_dir:
        t = _trainer(_cfg(activation_checkpointing="full"), "dp=1", run_dir)
        first = [m.loss for m in t.fit(3)]  # fit() commits a checkpoint at its last step
        t.close()
        t = _trainer(_cfg(), "dp=1", run_dir)
        out["ac_resume"] = {"first": first, "resumed_from": t.resumed_from.step,
                            "rest": [m.loss for m in t.fit(steps)]}
        t.close()
    if with_compile:
        out.update(variants_body({"compile": _cfg(compile=True)}, "dp=1", 2))
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        try:
            _trainer(_cfg(compile=True), "dp=1")
            out["no_compiler"] = None
        except ConfigError as e:
            out["no_compiler"] = str(e)
    return out


@pytest.fixture(scope="module")
def one_rank() -> dict:
    (res,) = run_ranks(1, single_rank_body, STEPS, _compile_reason() is None)
    return res


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    cfgs = {"fp32": _cfg(), "bf16": _cfg(dtype="bfloat16"), "ac_full": _cfg(activation_checkpointing="full"),
            "ac_selective": _cfg(activation_checkpointing="selective")}
    # bf16 without FSDP2: DDP replication, TP, PP (the model casts its weights at use)
    layouts = {"bf16_replicate": "dp_replicate=2", "bf16_tp": "tp=2", "bf16_pp": "pp=2"}
    cfgs.update({name: _cfg(dtype="bfloat16") for name in layouts})
    if _compile_reason() is None:
        cfgs["compile"] = _cfg(compile=True)
        # TP hands the first compiled block an async-collective tensor (parallelize._wait_async_output)
        cfgs["tp_fp32"], cfgs["tp_compile"] = _cfg(), _cfg(compile=True)
        layouts.update({"tp_fp32": "tp=2", "tp_compile": "tp=2"})
    res = run_ranks(2, variants_body, cfgs, "dp=2", STEPS, layouts)
    for name in cfgs:
        assert res[0][name]["losses"] == res[1][name]["losses"], f"{name}: ranks report different losses"
    return res[0]


def _close(got: list[float], want: list[float], rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=0)


# -- tier 1 -----------------------------------------------------------------------------------------

def _built(ac: str = "none", compile: bool = False):
    from models.config import model_config
    from models.llama import build_model
    from parallel.parallelize import apply_ac, apply_compile, materialize

    m = build_model(model_config("tiny", n_layers=2))
    apply_ac(m, ac)
    if compile:
        apply_compile(m)
    materialize(m, seed=0, device=torch.device("cpu"))
    return m


@pytest.mark.parametrize("ac,compile", [("full", False), ("selective", False), ("full", True), ("none", True)])
def test_names_are_canonical_under_ac_and_compile(ac, compile):
    """Initial values are keyed by name and checkpoints by DCP's FQNs: neither may gain
    `_checkpoint_wrapped_module.` or `_orig_mod.`; then the values are the same too."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    plain, m = _built(), _built(ac, compile)
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(m.state_dict()) == list(plain.state_dict())
    msd, osd = get_state_dict(m, torch.optim.AdamW(m.parameters()))
    assert list(msd) == list(plain.state_dict())
    for (n, p), (_, q) in zip(m.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), n


def _op_counts(ac: str) -> Counter:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    m = _built(ac)
    x = torch.randint(0, 256, (2, 16))
    with Count() as c:
        m(x).float().sum().backward()
    return c.ops


def test_ac_recomputes_what_it_should():
    """Equal losses alone would not show AC is on. Full recomputes each block's matmuls, attention and
    pointwise ops in backward; selective serves matmuls and attention from what it saved and recomputes
    only the pointwise ops (counted: silu once per block, rsqrt per norm)."""
    none, full, sel = _op_counts("none"), _op_counts("full"), _op_counts("selective")
    attn = "_scaled_dot_product_flash_attention_for_cpu"
    assert full["mm"] > none["mm"] and full[attn] == 2 * none[attn] and full["silu"] == 2 * none["silu"]
    assert sel["mm"] == none["mm"] and sel[attn] == none[attn]
    assert sel["silu"] == 2 * none["silu"] and sel["rsqrt"] > none["rsqrt"]


def test_unknown_ac_mode_is_refused():
    from parallel.parallelize import apply_ac

    with pytest.raises(ValueError, match="activation checkpointing must be one of"):
        apply_ac(_built(), "some")


def test_compile_check_names_the_missing_compiler():
    import torch._inductor.config as inductor_config

    from parallel.parallelize import compile_unavailable_reason

    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        reason = compile_unavailable_reason("cpu")
    assert reason is not None and "C++ compiler" in reason and "train.compile: false" in reason
    assert "not supported" in compile_unavailable_reason("mps")


# -- tier 2: one rank -------------------------------------------------------------------------------

@pytest.mark.dist
def test_bf16_on_one_rank_casts_and_stays_close(one_rank):
    fp32, bf16 = one_rank["fp32"], one_rank["bf16"]
    assert fp32["compute_dtype"] == "torch.float32" and bf16["compute_dtype"] == "torch.bfloat16"
    assert bf16["param_dtypes"] == ["torch.float32"]  # fp32 master weights
    assert all(math.isfinite(x) for x in bf16["losses"])
    assert bf16["losses"] != fp32["losses"]
    _close(bf16["losses"], fp32["losses"], BF16_RTOL)
    assert fp32["mfu"] == [None] * STEPS and bf16["mfu"] == [None] * STEPS  # CPU: no peak, MFU null


@pytest.mark.dist
def test_checkpoint_saved_with_ac_resumes_without(one_rank):
    ref, r = one_rank["fp32"]["losses"], one_rank["ac_resume"]
    assert r["resumed_from"] == 3
    _close(r["first"], ref[:3], AC_RTOL)
    _close(r["rest"], ref[3:], AC_RTOL)


@pytest.mark.dist
@needs_compiler
def test_compile_on_one_rank(one_rank):
    got = one_rank["compile"]["losses"]
    assert len(got) == 2
    _close(got, one_rank["fp32"]["losses"][:2], COMPILE_RTOL)


@pytest.mark.dist
def test_compile_without_a_compiler_is_a_config_error(one_rank):
    msg = one_rank["no_compiler"]
    assert msg is not None and msg.startswith("train.compile:") and "C++ compiler" in msg


# -- tier 2: two ranks (dp=2, FSDP) ------------------------------------------------------------------

@pytest.mark.dist
def test_bf16_fsdp_close_to_fp32(two_ranks, one_rank):
    fp32, bf16 = two_ranks["fp32"], two_ranks["bf16"]
    assert bf16["compute_dtype"] == "torch.bfloat16" and bf16["param_dtypes"] == ["torch.float32"]
    assert all(math.isfinite(x) for x in bf16["losses"])
    assert bf16["losses"] != fp32["losses"]
    _close(bf16["losses"], fp32["losses"], BF16_RTOL)
    _close(bf16["losses"], one_rank["bf16"]["losses"], 1e-3)  # same numerics at dp=1 and dp=2


@pytest.mark.dist
@pytest.mark.parametrize("variant,rtol", [
    ("bf16_replicate", 1e-6),  # DDP: fp32 gradients all-reduced, as FSDP2's reduce_dtype (measured 8.5e-8)
    # bf16 activations between stages: equal where oneDNN runs AVX512-BF16 kernels; with AMX (4.8e-5) or
    # AVX2 (2.1e-6) kernels the two layouts' matmuls round differently (ONEDNN_MAX_CPU_ISA, 2026-11-26)
    ("bf16_pp", 1e-4),
    ("bf16_tp", 1e-3),         # row-parallel partial sums are added in bf16 (measured 1.4e-4)
])
def test_bf16_without_fsdp_casts_and_matches_dp1(two_ranks, one_rank, variant, rtol):
    got = two_ranks[variant]
    assert got["compute_dtype"] == "torch.bfloat16" and got["param_dtypes"] == ["torch.float32"]
    assert got["losses"] != two_ranks["fp32"]["losses"]
    _close(got["losses"], two_ranks["fp32"]["losses"], BF16_RTOL)
    _close(got["losses"], one_rank["bf16"]["losses"], rtol)


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["ac_full", "ac_selective"])
def test_ac_gives_identical_losses(two_ranks, mode):
    _close(two_ranks[mode]["losses"], two_ranks["fp32"]["losses"], AC_RTOL)


@pytest.mark.dist
@needs_compiler
def test_compile_with_fsdp_matches_eager(two_ranks):
    _close(two_ranks["compile"]["losses"], two_ranks["fp32"]["losses"], COMPILE_RTOL)


@pytest.mark.dist
@needs_compiler
def test_compile_with_tp_matches_eager(two_ranks):
    _close(two_ranks["tp_compile"]["losses"], two_ranks["tp_fp32"]["losses"], COMPILE_RTOL)


# -- on a GPU ---------------------------------------------------------------------------------------

def _train_on_gpu(tmp_path: Path, **train) -> list[dict]:
    cfg = _cfg(steps=2, **train)
    cfg["resources"] = {"device": "cuda"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "workers.train", str(path), "--layout", "dp=1", "--steps", "2",
                           "--run-dir", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_step_reports_mfu(tmp_path):
    rows = _train_on_gpu(tmp_path, dtype="bfloat16")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
    from workers.mfu import peak_flops

    if peak_flops(torch.cuda.get_device_name(), "bfloat16") is not None:
        assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_compile_and_selective_ac(tmp_path):
    from parallel.parallelize import compile_unavailable_reason

    if (why := compile_unavailable_reason("cuda")) is not None:
        pytest.skip(why)
    rows = _train_on_gpu(tmp_path, dtype="bfloat16", compile=True, activation_checkpointing="selective")
    assert all(math.isfinite(r["loss"]) for r in rows)
