"""Apply a Layout to a (meta-device) model: pipeline split, TP, activation checkpointing, compile,
FSDP2/HSDP, then materialise weights.

Order matters: split the stage first (so no rank allocates layers it does not own), then swap its
linear layers for float8 ones where `train.float8` asks (`parallel.float8`, names unchanged), then TP (parameters
become DTensors on the tp axis), then activation checkpointing and torch.compile per block (torchtitan's
order: both see the TP-sharded block, and FSDP2's hooks stay outside them), then FSDP2 (adds the dp
axes), and only then materialise, so that each rank allocates just its own shard. Initial values come
from `models.llama.init_into`, which depends only on the seed, the canonical name and the global index:
every layout starts from the same global weights, and each rank generates only its own shard's values.
Nothing here renames a parameter: checkpointing replaces a block's
`forward` and compile uses `nn.Module.compile()`, neither of which inserts a wrapper module
(`_checkpoint_wrapped_module.`, `_orig_mod.`) into the names that initialisation and checkpoints key on.

Pure replication (dp_replicate > 1, nothing else) is DDP rather than FSDP2 on a (dp_replicate, 1)
mesh: the composable `replicate()` keeps the model's class and names, builds its DDP reducer lazily at
the first forward (so after `materialize`, which DDP needs: it broadcasts rank 0's values), and buckets
gradients into a few all-reduces per step, where FSDP2 issues one per unit inside backward.
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch
from torch import nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from models.llama import init_into
from parallel.checkpoint.state import local_box
from parallel.float8 import convert_float8
from parallel.layout import Layout, MeshAxis
from parallel.pipeline import split_stage
from parallel.precision import PrecisionPolicy
from parallel.tensor_parallel import apply_tp
from parallel.unset import mark_unset

_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    else {"broadcast_buffers": False})
"""DDP's switch for not syncing buffers on every forward: `forward_sync_buffers` in torch 2.13 (the pinned
version, which deprecates `broadcast_buffers`); torch 2.11, the one on the GPU machines this project is
measured on, knows only `broadcast_buffers`."""


ACMode = Literal["none", "full", "selective"]
AC_MODES: tuple[str, ...] = ("none", "full", "selective")


def dp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: 1-D dp_shard, or 2-D (dp_replicate, dp_shard) for HSDP/replication;
    None with dp == 1."""
    if layout.dp == 1:
        return None
    if layout.dp_replicate == 1:
        return mesh[MeshAxis.DP_SHARD.value]
    return mesh[(MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)]


def uses_ddp(layout: Layout) -> bool:
    """Whether `parallelize` replicates with DDP instead of FSDP2: data parallelism by replication only, no
    TP or PP. DDP cannot take TP's DTensor parameters without localising them, and PP stages sync their
    own gradients. bf16 works the same as fp32 here: the model casts its fp32 weights at use
    (`parallel.precision`), so DDP reduces fp32 gradients, as FSDP2's `reduce_dtype` would."""
    return (layout.dp_replicate > 1 and layout.dp_shard == 1 and not layout.tp_enabled
            and not layout.pp_enabled)


def reshard_after_forward(layout: Layout, device_type: str) -> bool:
    """Whether FSDP2 frees the unsharded parameters after a unit's forward (and gathers them again for
    its backward).

    Not with PP: every microbatch runs forward and backward separately, and keeping parameters unsharded
    between them avoids an all-gather per microbatch (torchtitan does the same). Not on a single dp rank:
    "resharding" would only drop the bf16 copy and recast it in backward. Not on CPU: gloo collectives
    block and overlap nothing, so the second gather costs a unit's all-gather plus copy-in/out in every
    backward (measured: 20 all-gathers per step instead of 5, docs/benchmarks.md), while the memory it
    saves, P * (1 - 1/dp_shard) * bytes per parameter at the peak, matters little on a CPU host."""
    return not layout.pp_enabled and layout.dp > 1 and device_type != "cpu"


def parallelize(
    model: nn.Module,
    *,
    layout: Layout,
    mesh: DeviceMesh,
    sequence_parallel: bool = False,
    loss_parallel: bool = True,
    precision: PrecisionPolicy | None = None,
    activation_checkpointing: ACMode = "none",
    compile: bool = False,
    float8: str = "none",
) -> nn.Module:
    """Turn the full meta-device model into this rank's part of it under `layout` (in place).

    `precision` comes from `parallel.precision.select_precision` (default: fp32, today's behaviour);
    `activation_checkpointing` and `compile` apply per transformer block; `float8` is a recipe of
    `parallel.float8` (emulated on CPU), applied to this stage before it is sharded."""
    precision = precision or PrecisionPolicy(param_dtype=None)
    if layout.pp_enabled:
        split_stage(model, mesh.get_local_rank(MeshAxis.PP.value), layout.pp)
    if float8 != "none":
        convert_float8(model, float8, emulate=mesh.device_type == "cpu",
                       fsdp_float8_all_gather=layout.dp_shard > 1 and not uses_ddp(layout))
    if model.tok_embeddings is not None:
        model.tok_embeddings.compute_dtype = precision.param_dtype
    if layout.tp_enabled:
        apply_tp(model, mesh[MeshAxis.TP.value], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    apply_ac(model, activation_checkpointing)
    if compile:
        apply_compile(model)
    if uses_ddp(layout):
        # Lazy: the DDP reducer (and its broadcast of rank 0's parameters) is built at the first forward,
        # after materialize(). No buffers are synced per forward: the only ones, the RoPE tables, are
        # computed identically on every rank (and DDP is built over the parameters only anyway).
        replicate(model, process_group=mesh[MeshAxis.DP_REPLICATE.value].get_group(), **_NO_FORWARD_BUFFER_SYNC)
        return model
    fsdp = dp_mesh(mesh, layout)
    if fsdp is not None:
        mp = precision.mp_policy()
        reshard = reshard_after_forward(layout, mesh.device_type)
        for block in model.layers.values():
            fully_shard(block, mesh=fsdp, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=fsdp, mp_policy=mp, reshard_after_forward=reshard)
    return model


# -- activation checkpointing ------------------------------------------------------------------------

def _selective_policy():
    """Selective (op-level) checkpointing: keep the outputs of matmuls, attention and TP collectives,
    recompute the cheap memory-bound rest (norms, RoPE, SiLU x gate, residual adds, casts). Roughly
    Korthikanti et al.'s trade: most activation memory of a block is in those elementwise results, most
    of its FLOPs (and all of its communication) in what is kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            c10d.all_reduce.default, c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpoint_block(block: nn.Module, mode: str) -> None:
    """Recompute `block`'s forward in backward. The block's own `forward` is replaced by a checkpointed
    call of the original, so no wrapper module enters the parameter names."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    inner = block.forward
    context_fn = {}
    if mode == "selective":
        context_fn = {"context_fn": partial(create_selective_checkpoint_contexts, _selective_policy())}

    def forward(*args, **kwargs):
        # The model has no dropout, so there is no RNG state to replay.
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **context_fn, **kwargs)

    block.forward = forward


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing per transformer block: none, full (keep only each block's input) or
    selective (see `_selective_policy`)."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return
    for block in model.layers.values():
        _checkpoint_block(block, mode)


# -- torch.compile -----------------------------------------------------------------------------------

def compile_unavailable_reason(device_type: str) -> str | None:
    """Why torch.compile (inductor) cannot run on `device_type` here, or None if it can: on CPU inductor
    builds C++ kernels and needs a C++ compiler; on CUDA it generates Triton kernels."""
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:  # InvalidCxxCompiler, or a private API that moved
            return (f"torch.compile on CPU needs a C++ compiler (g++ or clang++, or set CXX) and none was "
                    f"found ({type(e).__name__}); install one or set train.compile: false")
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return ("torch.compile on CUDA needs Triton, which is not installed; install triton or set "
                    "train.compile: false")
        return None
    return f"torch.compile is not supported on device type {device_type!r}"


def apply_compile(model: nn.Module) -> None:
    """Compile each transformer block (not the whole model: blocks are identical, so one graph is
    reused, and pipeline stages hold different blocks). `nn.Module.compile()` compiles in place, so
    parameter names do not gain `_orig_mod.`."""
    for block in model.layers.values():
        block.compile(fullgraph=True)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_wait_async_output)


def _wait_async_output(module: nn.Module, args, out):
    """Under TP the embedding's output redistribution is asynchronous and hands the first block an
    AsyncCollectiveTensor. Fed straight into a compiled block, its gradient comes back as a plain tensor
    where DTensor's Redistribute backward wants a DTensor (torch 2.13, CPU and gloo at least), so it is
    waited for here; `clone()` (not `wait()`) keeps the autograd edge to the embedding."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return out.clone() if isinstance(out, AsyncCollectiveTensor) else out


@torch.no_grad()
def materialize(model: nn.Module, *, seed: int, device: torch.device, init: bool = True) -> int:
    """Allocate this rank's shards on `device` and, with `init`, fill them with their part of the global
    initial values (`init_shards`); returns the random values drawn. `init=False`: leave them unset
    (`parallel.unset`), for a caller that overwrites every element (a checkpoint load, a live reshard),
    and initialise with `init_shards` only if nothing was loaded."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own copy of a shared Parameter
    model.init_buffers(device)
    if not init:
        mark_unset(model.parameters())
        return 0
    return init_shards(model, seed=seed)


@torch.no_grad()
def init_shards(model: nn.Module, *, seed: int) -> int:
    """Fill this rank's (allocated) shards with their box of each parameter's global initial value
    (`models.llama.init_into`), generated on their device: a rank draws the values of its own shard only,
    never a whole tensor. Returns how many random values this rank drew."""
    cfg = model.cfg
    drawn = 0
    for name, p in model.named_parameters():
        local, offsets = local_box(p)
        if local.numel():
            drawn += init_into(cfg, name, tuple(p.shape), seed, local, offsets)
    return drawn


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gathered (global) values of the parameters this rank's stage holds, on CPU. Collective over the
    stage's TP/DP ranks; every rank of the stage must call it."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        out[name] = t.detach().cpu().clone()
    return out


def reshard_after_eval(model: nn.Module) -> None:
    """Put FSDP2's sharded parameters back after forward-only passes. Without a backward nothing
    reshards the units that keep their parameters after forward: the module would keep exposing the
    unsharded (bf16 under mixed precision) tensors as its parameters, and a checkpoint or a live
    hand-over right after an evaluation would read those instead of the fp32 shards."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def set_grad_sync(model: nn.Module, sync: bool) -> None:
    """Skip gradient reduction on all but the last microbatch of an accumulation (FSDP2 or DDP).

    On CPU, FSDP2 units also keep their parameters unsharded from one microbatch to the next instead of
    gathering them again: there they are not resharded after forward either
    (`reshard_after_forward`), so holding them through backward adds nothing to the peak. On GPUs it
    would hold the whole model unsharded through the accumulation, so they reshard as usual."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        if next(model.parameters()).device.type == "cpu":
            model.set_reshard_after_backward(sync)
    elif isinstance(model, ReplicatedModule):
        model.set_requires_gradient_sync(sync)
