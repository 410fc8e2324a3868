"""Model FLOPs utilisation: achieved model FLOP/s over the devices' peak.

MFU = tokens/s x model FLOPs per token / (devices x peak FLOP/s per device) (PaLM, appendix B). Model
FLOPs per token come from `ModelConfig.flops_per_token` (6 x non-embedding params + attention scores);
recomputation under activation checkpointing is not counted (that would be hardware FLOPs utilisation),
so MFU does not reward recomputing. Pure: no torch import.

Peaks are the vendors' dense (no 2:4 sparsity) datasheet figures. float32 means plain FP32 on the
CUDA cores, not TF32 tensor cores: Elastron leaves TF32 off, PyTorch's default. Unknown devices and
CPUs have no peak, and their MFU is reported as null rather than guessed.
"""

from __future__ import annotations

import re

T = 1e12

# (pattern on the upper-cased device name, {dtype: peak FLOP/s}). First match wins, so variants come
# before the family name ("H100 PCIe" before "H100", which means SXM). Names as torch.cuda reports them,
# e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "AMD Instinct MI300X".
_PEAKS: list[tuple[str, dict[str, float]]] = [
    (r"\bGH200\b", {"bfloat16": 989 * T, "float32": 67 * T}),
    (r"\bH200\b.*\bNVL\b", {"bfloat16": 835 * T, "float32": 60 * T}),
    (r"\bH200\b", {"bfloat16": 989 * T, "float32": 67 * T}),
    (r"\bH100\b.*\bNVL\b", {"bfloat16": 835 * T, "float32": 60 * T}),
    (r"\bH100\b.*\bPCIE\b", {"bfloat16": 756 * T, "float32": 51 * T}),
    (r"\bH100\b", {"bfloat16": 989 * T, "float32": 67 * T}),  # SXM (HBM3)
    (r"\bH800\b", {"bfloat16": 989 * T, "float32": 67 * T}),
    (r"\bB200\b", {"bfloat16": 2250 * T}),
    (r"\bA100\b", {"bfloat16": 312 * T, "float32": 19.5 * T}),
    (r"\bA800\b", {"bfloat16": 312 * T, "float32": 19.5 * T}),
    (r"\bL40S\b", {"bfloat16": 362 * T, "float32": 91.6 * T}),
    (r"\bL40\b", {"bfloat16": 181 * T, "float32": 90.5 * T}),
    (r"\bL4\b", {"bfloat16": 121 * T, "float32": 30.3 * T}),
    (r"\bA10\b", {"bfloat16": 125 * T, "float32": 31.2 * T}),
    (r"\bMI300X\b", {"bfloat16": 1307 * T, "float32": 163.4 * T}),
    (r"\bMI325X\b", {"bfloat16": 1307 * T, "float32": 163.4 * T}),
]


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device for `dtype` ("bfloat16" or "float32"); None when unknown (CPUs,
    devices not in the table, or a dtype the device has no figure for)."""
    if not device_name:
        return None
    name = device_name.upper()
    for pattern, peaks in _PEAKS:
        if re.search(pattern, name):
            return peaks.get(dtype)
    return None


def mfu(tokens_per_s: float, flops_per_token: float, n_devices: int, peak: float | None) -> float | None:
    """Fraction (0..1) of `n_devices` x `peak` that `tokens_per_s` tokens of `flops_per_token` model FLOPs
    each amount to; None when the peak is unknown. `tokens_per_s` is the whole job's throughput."""
    if peak is None:
        return None
    if peak <= 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak}")
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    if tokens_per_s < 0 or flops_per_token < 0:
        raise ValueError(f"tokens_per_s and flops_per_token must be >= 0, got {tokens_per_s}, {flops_per_token}")
    return tokens_per_s * flops_per_token / (n_devices * peak)
