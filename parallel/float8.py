"""float8 training (`train.float8`): the model's linear layers compute their matmuls in float8 through
torchao's `Float8Linear`, with fp32 master weights and optimizer state kept as they are.

`convert_float8(model, ...)` runs inside `parallelize`, after the pipeline split and before TP, FSDP2,
activation checkpointing and compile (torchtitan converts before it parallelises too): TP and FSDP2 then
shard `Float8Linear` weights like any other. What stays in high precision is what torchtitan leaves
there: the output head (its float8 error lands straight in the logits) and any linear whose in or out
features are not multiples of 16 (float8 GEMMs need them). The swap keeps every parameter name, shape
and fp32 dtype, so checkpoints, live reshards and `elastron export` see the same tensors with float8 on
or off, and a run can resume or reshard with it switched either way.

Recipes: `tensorwise` (one scale per tensor; under FSDP2 the weights are cast to float8 before the
all-gather, half the bytes of a bf16 one, with the scales of all units computed in one go after each
optimizer step) and `rowwise` (one scale per row, more accurate; FSDP2 gathers in the compute dtype, as
torchao requires). TP keeps its ordinary plans, so its collectives stay in the compute dtype (torchtitan's
float8 TP styles are not used). Float8 GEMMs need compute capability 8.9+ (H100, L4, ...); on CPU
torchao's emulation runs the same casts and scales with high-precision matmuls, so the wiring is tested
without a GPU.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

FLOAT8_RECIPES: tuple[str, ...] = ("none", "tensorwise", "rowwise")
SKIPPED_FQNS: tuple[str, ...] = ("output",)
"""Linear layers left in high precision by name (torchtitan's default filter)."""


def float8_unavailable_reason(recipe: str, device_type: str, *, dtype: str) -> str | None:
    """Why `recipe` cannot train on `device_type` here, or None if it can (always None for "none")."""
    if recipe not in FLOAT8_RECIPES:
        return f"must be one of {', '.join(FLOAT8_RECIPES)}, got {recipe!r}"
    if recipe == "none":
        return None
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"float8 training needs torchao ({e}); install elastron[float8]"
    if device_type == "cpu":
        return None  # emulated
    if device_type != "cuda":
        return f"float8 training is not supported on device type {device_type!r}; set train.float8: none"
    if dtype != "bfloat16":
        return f"float8 on CUDA computes the rest of the model in bf16: set train.dtype: bfloat16 (got {dtype})"
    if torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        return (f"float8 matmuls need compute capability 8.9+ (H100, L4, ...), this GPU has {major}.{minor}; "
                "set train.float8: none")
    return None


def keeps_high_precision(module: nn.Module, fqn: str) -> bool:
    """Whether `module` (a linear layer at `fqn`) stays out of float8: a skipped name, or dims that are not
    multiples of 16."""
    out_features, in_features = module.weight.shape
    return fqn.split(".")[-1] in SKIPPED_FQNS or in_features % 16 != 0 or out_features % 16 != 0


def float8_config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool):
    """torchao's Float8LinearConfig for `recipe`; `fsdp_float8_all_gather` only applies to tensorwise."""
    from torchao.float8 import Float8LinearConfig

    cfg = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_float8_all_gather and recipe == "tensorwise")


def convert_float8(model: nn.Module, recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool) -> list[str]:
    """Swap the eligible linear layers of `model` (meta device or materialised) for `Float8Linear` in
    place; return the names of the swapped ones. "none" swaps nothing."""
    if recipe == "none":
        return []
    from torchao.float8 import convert_to_float8_training

    swapped: list[str] = []

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or keeps_high_precision(module, fqn):
            return False
        swapped.append(fqn)
        return True

    convert_to_float8_training(
        model, module_filter_fn=eligible,
        config=float8_config(recipe, emulate=emulate, fsdp_float8_all_gather=fsdp_float8_all_gather))
    return swapped


def uses_float8_all_gather(model: nn.Module) -> bool:
    """Whether any of `model`'s float8 layers all-gathers its weight in float8 under FSDP2."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    if linear is None:  # torchao never imported: nothing was converted (and a run without it needs none)
        return False
    return any(isinstance(m, linear.Float8Linear) and m.config.enable_fsdp_float8_all_gather
               for m in model.modules())


def precompute_scales_after_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """With float8 all-gather, compute every float8 weight's scale in one all-reduce after each optimizer
    step (torchtitan does the same), instead of one per FSDP2 unit as it gathers. No-op otherwise."""
    if not uses_float8_all_gather(model):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
