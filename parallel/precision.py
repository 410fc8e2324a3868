"""Mixed precision: which dtype the model computes in, and how a layout without FSDP gets it too.

`select_precision(dtype, device_type, layout)` is pure (torch is imported for dtypes only; FSDP2 lazily).
bfloat16 means FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: parameters and
optimizer state stay fp32 (master weights), each block's parameters are cast to bf16 when FSDP2
unshards them, activations are bf16, gradients are reduced and stored in fp32, and the loss is taken on
fp32-upcast logits (`parallelize.cross_entropy`).

dp == 1 (no FSDP wrapping otherwise) is wrapped with `fully_shard` on the size-1 dp_shard axis rather than
run under `torch.autocast`, for three reasons:

- Same numerics under every layout. An elastic job moves between dp=1 and dp>1; with one mechanism the
  cast points never change (cast once per parameter, every op on bf16 inputs, norms and RoPE upcast
  inside the model), so a resize does not change the arithmetic mid-run. Autocast has an op-level
  policy of its own (matmuls in bf16 on fp32 weights, some ops kept in fp32) and would give dp=1 runs
  systematically different losses from dp=2 runs.
- One code path for optimizer, clipping and checkpoints, which already handle FSDP2 DTensors on a size-1
  shard axis (pure dp_replicate layouts use a (dp_replicate, 1) mesh).
- Cost on one rank: the "all-gather" is a local cast-and-copy, and the bf16 copy is kept between forward
  and backward (2 bytes/param against the 16 of fp32 params, grads and AdamW state), so it is done once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from parallel.layout import Layout

DTYPES = ("float32", "bfloat16")
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPolicy:
    """What parallelize() does about precision for one (dtype, device, layout)."""

    param_dtype: torch.dtype | None
    """Dtype FSDP2 casts parameters to for forward/backward; None computes in the parameters' fp32."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are reduced (and kept) in across dp ranks."""
    shard_single_rank: bool = False
    """Wrap with fully_shard on the size-1 dp_shard axis when dp == 1, so the cast still happens."""

    @property
    def mixed(self) -> bool:
        return self.param_dtype is not None

    def mp_policy(self) -> "MixedPrecisionPolicy":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


def select_precision(dtype: str, device_type: str, layout: "Layout", *, bf16_supported: bool = True) -> PrecisionPolicy:
    """The precision policy for training in `dtype` ("float32" or "bfloat16") on `device_type` ("cpu" or
    "cuda") under `layout`. `bf16_supported` is the device's answer (`torch.cuda.is_bf16_supported()`
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
    return PrecisionPolicy(param_dtype=torch.bfloat16, shard_single_rank=layout.dp == 1)
