"""Apply a Layout to a (meta-device) model: pipeline split, TP, FSDP2/HSDP, then materialise weights.

Order matters: split the stage first (so no rank allocates layers it does not own), then TP (parameters
become DTensors on the tp axis), then FSDP2 (adds the dp axes), and only then materialise, so that each
rank allocates just its own shard. Initial values come from `models.llama.init_value`, which depends
only on the seed and the canonical name: every layout starts from the same global weights.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from models.llama import init_value
from parallel.layout import Layout, MeshAxis
from parallel.pipeline import split_stage
from parallel.tensor_parallel import apply_tp


def dp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: 1-D dp_shard, or 2-D (dp_replicate, dp_shard) for HSDP/replication."""
    if layout.dp == 1:
        return None
    if layout.dp_replicate == 1:
        return mesh[MeshAxis.DP_SHARD.value]
    return mesh[(MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)]


def parallelize(
    model: nn.Module,
    *,
    layout: Layout,
    mesh: DeviceMesh,
    sequence_parallel: bool = False,
    loss_parallel: bool = True,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Turn the full meta-device model into this rank's part of it under `layout` (in place)."""
    if layout.pp_enabled:
        split_stage(model, mesh.get_local_rank(MeshAxis.PP.value), layout.pp)
    if layout.tp_enabled:
        apply_tp(model, mesh[MeshAxis.TP.value], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    fsdp = dp_mesh(mesh, layout)
    if fsdp is not None:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        # With PP every microbatch runs forward and backward separately; keeping parameters unsharded
        # between them avoids an all-gather per microbatch (torchtitan does the same).
        for block in model.layers.values():
            fully_shard(block, mesh=fsdp, mp_policy=mp, reshard_after_forward=not layout.pp_enabled)
        fully_shard(model, mesh=fsdp, mp_policy=mp, reshard_after_forward=not layout.pp_enabled)
    return model


@torch.no_grad()
def materialize(model: nn.Module, *, seed: int, device: torch.device) -> None:
    """Allocate this rank's shards on `device` and fill them with its slice of the global initial values."""
    model.to_empty(device=device)
    model.init_buffers(device)
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


def set_grad_sync(model: nn.Module, sync: bool) -> None:
    """Skip FSDP gradient reduction on all but the last microbatch of an accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, *, pp_group=None) -> torch.Tensor:
    """Global gradient 2-norm over every rank's parameters, and clip to `max_norm` (0 = do not clip).

    Parameters may live on different meshes (TP DTensors, FSDP DTensors, plain tensors on one pipeline
    stage), so norms are taken per (mesh, placements) group, reduced to full values, then combined; with
    PP the squared norms of all stages are summed.
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
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for gs in groups.values() for g in gs]
        torch._foreach_mul_(locals_, coef)
    return total


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over all tokens (works on vocab-sharded DTensor logits under loss_parallel)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
