"""Tier 1: MFU arithmetic and the peak-FLOP/s table."""

import math

import pytest

from models.config import model_config
from workers.mfu import mfu, peak_flops


@pytest.mark.parametrize("name,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),      # SXM
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H100 NVL", "bfloat16", 835e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA GH200 480GB", "bfloat16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100 80GB PCIe", "bfloat16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "float32", 19.5e12),
    ("NVIDIA H100 80GB HBM3", "float32", 67e12),
    ("NVIDIA L40S", "bfloat16", 362e12),
    ("NVIDIA L4", "bfloat16", 121e12),                  # not L40/L40S
    ("NVIDIA A10", "bfloat16", 125e12),                 # not A100
    ("NVIDIA B200", "bfloat16", 2250e12),
    ("AMD Instinct MI300X", "bfloat16", 1307e12),
])
def test_peak_table(name, dtype, peak):
    assert peak_flops(name, dtype) == pytest.approx(peak)


@pytest.mark.parametrize("name,dtype", [
    (None, "bfloat16"),            # CPU: no device name
    ("", "float32"),
    ("cpu", "bfloat16"),
    ("NVIDIA A10G", "bfloat16"),   # not in the table: unknown, not guessed from A10
    ("Tesla V100-SXM2-16GB", "bfloat16"),
    ("NVIDIA B200", "float32"),    # a device in the table without a figure for this dtype
    ("NVIDIA H100 80GB HBM3", "float16"),
])
def test_unknown_peak_is_none(name, dtype):
    assert peak_flops(name, dtype) is None


def test_mfu_arithmetic():
    # 8 GPUs at 989 TFLOP/s, 8B-like 6N=48e9 FLOPs/token: 5,762 tokens/s/GPU (torchtitan's figure) ~ 28%.
    got = mfu(5762 * 8, 48e9, 8, 989e12)
    assert got == pytest.approx(5762 * 48e9 / 989e12)
    assert 0.27 < got < 0.29
    assert mfu(1000.0, 1e9, 1, 1e12) == pytest.approx(1.0)
    assert mfu(1000.0, 1e9, 4, 1e12) == pytest.approx(0.25)  # per-device peak times devices
    assert mfu(0.0, 1e9, 1, 1e12) == 0.0


def test_mfu_is_none_without_a_peak():
    assert mfu(1234.0, 1e9, 2, None) is None


@pytest.mark.parametrize("args", [(1.0, 1.0, 0, 1e12), (1.0, 1.0, 1, 0.0), (-1.0, 1.0, 1, 1e12), (1.0, -1.0, 1, 1e12)])
def test_mfu_rejects_nonsense(args):
    with pytest.raises(ValueError):
        mfu(*args)


def test_with_model_flops():
    """The trainer's inputs: flops_per_token of a preset (6 x non-embedding params + attention)."""
    cfg = model_config("8b")
    fpt = cfg.flops_per_token(8192)
    assert fpt == pytest.approx(6 * cfg.num_params(embedding=False) + 12 * 32 * 4096 * 8192)
    u = mfu(5762.0, fpt, 1, peak_flops("NVIDIA H100 80GB HBM3", "bfloat16"))
    assert 0.3 < u < 0.4  # torchtitan reports 33-39% for this shape on H100s
    assert math.isfinite(u)
