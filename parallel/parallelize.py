"""Apply a Layout to a (meta-device) model: pipeline split, TP, activation checkpointing, compile,
FSDP2/HSDP, then materialise weights.

Order matters: split the stage first (so no rank allocates layers it does not own), then TP (parameters
become DTensors on the tp axis), then activation checkpointing and torch.compile per block (torchtitan's
order: both see the TP-sharded block, and FSDP2's hooks stay outside them), then FSDP2 (adds the dp
axes), and only then materialise, so that each rank allocates just its own shard. Initial values come
from `models.llama.init_value`, which depends only on the seed and the canonical name: every layout
starts from the same global weights. Nothing here renames a parameter: checkpointing replaces a block's
`forward` and compile uses `nn.Module.compile()`, neither of which inserts a wrapper module
(`_checkpoint_wrapped_module.`, `_orig_mod.`) into the names that initialisation and checkpoints key on.

Pure replication (dp_replicate > 1, nothing else) is DDP rather than FSDP2 on a (dp_replicate, 1)
mesh: the composable `replicate()` keeps the model's class and names, builds its DDP reducer lazily at
the first forward (so after `materialize`, which DDP needs: it broadcasts rank 0's values), and buckets
gradients into a few all-reduces per step, where FSDP2 issues one per unit inside backward.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adam import adam

from models.llama import init_value
from parallel.layout import Layout, MeshAxis
from parallel.pipeline import split_stage
from parallel.precision import PrecisionPolicy
from parallel.tensor_parallel import apply_tp


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
) -> nn.Module:
    """Turn the full meta-device model into this rank's part of it under `layout` (in place).

    `precision` comes from `parallel.precision.select_precision` (default: fp32, today's behaviour);
    `activation_checkpointing` and `compile` apply per transformer block."""
    precision = precision or PrecisionPolicy(param_dtype=None)
    if layout.pp_enabled:
        split_stage(model, mesh.get_local_rank(MeshAxis.PP.value), layout.pp)
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
        replicate(model, process_group=mesh[MeshAxis.DP_REPLICATE.value].get_group(),
                  forward_sync_buffers=False)
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
def materialize(model: nn.Module, *, seed: int, device: torch.device, init: bool = True) -> None:
    """Allocate this rank's shards on `device` and fill them with its slice of the global initial values
    (`init=False`: leave them unset, for a caller that overwrites every element, e.g. a live reshard)."""
    model.to_empty(device=device)
    model.init_buffers(device)
    if not init:
        return
    cfg = model.cfg
    for name, p in model.named_parameters():
        full = init_value(cfg, name, tuple(p.shape), seed).to(device)
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank holds the same full value, so each slices locally (no scatter).
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gathered (global) values of the parameters this rank's stage holds, on CPU. Collective over the
    stage's TP/DP ranks; every rank of the stage must call it."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        out[name] = t.detach().cpu().clone()
    return out


def param_groups(params: list[nn.Parameter]) -> list[dict]:
    """Optimizer param groups, one per device mesh (plain tensors in their own group).

    Foreach optimizer kernels cannot mix DTensors of different meshes, or DTensors and plain tensors (TP
    without sequence parallel leaves norm weights plain). Every group gets the same hyper-parameters; the
    LR is set from the global step for all groups, so the number of groups never matters for resuming.
    """
    groups: dict[object, list[nn.Parameter]] = defaultdict(list)
    for p in params:
        groups[p.device_mesh if isinstance(p, DTensor) else None].append(p)
    return [{"params": ps} for ps in groups.values()]


def build_adamw(params: list[nn.Parameter], *, fused: bool, **hyper) -> torch.optim.AdamW:
    """AdamW over `param_groups(params)`: the fused kernel or the foreach one (each group holds tensors of
    one mesh, which both need)."""
    impl = {"fused": True} if fused else {"foreach": True}
    return LocalAdamW(param_groups(params), **hyper, **impl)


class LocalAdamW(torch.optim.AdamW):
    """AdamW whose kernels run on the local shards of DTensor parameters.

    The update is element-wise: where a parameter, its gradient and its moments have the same placements,
    each rank's shards line up element for element, so the kernels on the local tensors write the same
    bytes as on the DTensors. What is saved is DTensor dispatch: the sharding propagation of each kernel
    over every tensor of a group, which a fresh trainer (every re-form builds one) pays in full on its
    first step, 1.6 s of a 3.8 s first step (cProfile) for the 1 GB benchmark state on 2 CPU ranks. The
    state stays DTensors, as checkpoints and live transfers expect. A group whose gradients are placed
    otherwise than its parameters goes through DTensor dispatch as before."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if _aligned(params, grads):
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (
                    [_local(t) for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
            beta1, beta2 = group["betas"]
            adam(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
                has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])
        return loss


def _aligned(params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    """Whether every gradient is placed as its parameter (the moments are made like the parameter)."""
    return all(isinstance(p, DTensor) == isinstance(g, DTensor)
               and (not isinstance(p, DTensor) or (p.placements == g.placements and p.device_mesh == g.device_mesh))
               for p, g in zip(params, grads))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


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


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, *, pp_group=None,
                    optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Global gradient 2-norm over every rank's parameters, and clip to `max_norm` (0 = do not clip).

    Parameters may live on different meshes (TP DTensors, FSDP DTensors, plain tensors on one pipeline
    stage), so norms are taken per (mesh, placements) group, reduced to full values, then combined; with
    PP the squared norms of all stages are summed.

    Given an `optimizer` whose every group is fused AdamW, the clip costs no pass over the gradients of
    its own: the factor goes to the fused kernel as its `grad_scale` (the protocol GradScaler uses; the
    kernel divides each gradient by it as it reads it, and writes the clipped gradient back), so the
    next `optimizer.step()` applies it. Otherwise one `_foreach_mul_` clips the local gradients.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            groups[key].append(g)
    device = next(iter(params)).device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, 2.0, foreach=True)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = sq + n.float() ** 2
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    if optimizer is not None and all(g.get("fused") for g in optimizer.param_groups):
        scale = torch.clamp((total + 1e-6) / max_norm, min=1.0) if max_norm > 0 else None
        optimizer.grad_scale = scale
        optimizer.found_inf = torch.zeros((), device=device) if scale is not None else None
        return total
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for gs in groups.values() for g in gs]
        torch._foreach_mul_(locals_, coef)
    return total


CE_CHUNK_ELEMENTS = 1 << 24
"""Logit elements (tokens x vocabulary) the chunked loss upcasts to fp32 at a time: 64 MiB, ~2k tokens of
a 32k vocabulary, enough rows per chunk that the kernels stay efficient."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over all tokens.

    Vocab-sharded DTensor logits (TP's `loss_parallel`) take DTensor's vocab-parallel loss, which holds
    only a 1/tp slice of the vocabulary per rank. Plain logits take `chunked_cross_entropy`, which never
    holds the fp32 upcast of the whole [tokens, vocab] matrix."""
    if isinstance(logits, DTensor):
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    return chunked_cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                          chunk_elements: int = CE_CHUNK_ELEMENTS) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), targets)` (mean, ignore_index -100) on [N, V] logits, computed
    chunk_elements // V tokens at a time in fp32.

    The gradient is computed in the same pass and kept in the logits' dtype, the size of the gradient
    backward would produce anyway; so neither the fp32 logits nor the fp32 log-probabilities that
    autograd would save for backward ever exist whole (4 + 4 bytes per logit, against 2 for bf16 logits)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"chunked_cross_entropy wants [N, V] logits and [N] targets, got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    chunk = max(1, chunk_elements // logits.shape[1])
    return _ChunkedCrossEntropy.apply(logits, targets, chunk)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        want_grad = logits.requires_grad
        grad = torch.empty_like(logits) if want_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        count = (targets != -100).sum()
        for start in range(0, logits.shape[0], chunk):
            x = logits[start:start + chunk].float()
            t = targets[start:start + chunk]
            valid = t != -100
            t = t.masked_fill(~valid, 0).unsqueeze(1)
            lse = torch.logsumexp(x, dim=1, keepdim=True)
            total += ((lse - x.gather(1, t)).squeeze(1) * valid).sum()
            if want_grad:
                p = (x - lse).exp_()  # softmax; d loss_sum / d x = softmax - onehot, zero on ignored rows
                p.scatter_add_(1, t, torch.full_like(t, -1, dtype=p.dtype))
                p.mul_(valid.unsqueeze(1))
                grad[start:start + chunk] = p
        ctx.chunk = chunk
        ctx.save_for_backward(grad, count)
        return total / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad, count = ctx.saved_tensors
        scale = grad_out.float() / count
        if grad.dtype == torch.float32:
            return grad * scale, None, None
        # Scale in fp32 and round once, as autograd through `.float()` would; chunked, as in forward.
        out = torch.empty_like(grad)
        for start in range(0, grad.shape[0], ctx.chunk):
            out[start:start + ctx.chunk] = grad[start:start + ctx.chunk].float() * scale
        return out, None, None


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
