"""Mixed precision: which dtype the model computes in, and how every layout gets the same arithmetic.

`select_precision(dtype, device_type)` is pure (torch is imported for dtypes only; FSDP2 lazily).
bfloat16 keeps parameters, gradients and optimizer state in fp32 (master weights) and computes in bf16:

- The model casts each weight where it uses it (`models.llama`: `Linear` and `RMSNorm` to their input's
  dtype, the embedding table to `Embedding.compute_dtype`, which `parallelize` sets to `param_dtype`).
  Activations are bf16, norms and RoPE upcast inside (RoPE tables stay fp32), and the loss is taken on
  fp32-upcast logits (`parallel.loss.cross_entropy`). Gradients flow back through the casts into fp32.
- Under FSDP2 (dp_shard > 1, or HSDP) its `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`
  casts the parameters when it unshards them, which makes the model's casts no-ops: the values and the
  cast points are the same (each weight rounded to bf16 once per forward, every matmul on bf16 operands),
  and gradients are reduced and kept in fp32. `cast_forward_inputs` is off: FSDP2 would otherwise round
  the fp32 RoPE tables that blocks take as arguments, which the model without FSDP2 does not.
- Without FSDP2 (dp == 1; DDP replication; TP or PP alone) nothing is wrapped for precision's sake: the
  model's own casts are the only ones, one cast kernel per weight per forward, where FSDP2 on a size-1
  axis (how dp == 1 ran before) pays a cast into its all-gather buffer, a copy through the size-1
  all-gather and a copy out per unit, and in backward a cast, a copy through the reduce-scatter and an
  accumulation per gradient. Losses and parameters of the two are bitwise equal
  (`tests/parallel/test_precision.py`), so an elastic job that moves between dp=1 and dp>1 keeps its
  arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.fsdp import MixedPrecisionPolicy

DTYPES = ("float32", "bfloat16")
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPolicy:
    """What parallelize() does about precision for one (dtype, device)."""

    param_dtype: torch.dtype | None
    """Dtype the model computes in (weights cast at use, or by FSDP2 when it unshards); None computes in the
    parameters' fp32."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are reduced (and kept) in across dp ranks."""

    @property
    def mixed(self) -> bool:
        return self.param_dtype is not None

    def mp_policy(self) -> "MixedPrecisionPolicy":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                                    cast_forward_inputs=False)


def select_precision(dtype: str, device_type: str, *, bf16_supported: bool = True) -> PrecisionPolicy:
    """The precision policy for training in `dtype` ("float32" or "bfloat16") on `device_type` ("cpu" or
    "cuda"), the same under every layout. `bf16_supported` is the device's answer (`torch.cuda.is_bf16_supported()`
    on CUDA; CPUs always emulate bf16, slowly where they lack native support, which is fine for tests).
    float32 keeps today's behaviour exactly: no cast, fp32 reduction, no wrapping beyond FSDP's own."""
    if dtype not in DTYPES:
        raise ValueError(f"train.dtype must be one of {DTYPES}, got {dtype!r}")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device type must be one of {DEVICE_TYPES}, got {device_type!r}")
    if dtype == "float32":
        return PrecisionPolicy(param_dtype=None)
    if not bf16_supported:
        raise ValueError(f"train.dtype is bfloat16 but this {device_type} device does not support bfloat16 "
                         "(CUDA needs compute capability 8.0+, e.g. A100/H100); use float32")
    return PrecisionPolicy(param_dtype=torch.bfloat16)
