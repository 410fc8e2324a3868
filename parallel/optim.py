"""The optimizer and gradient clipping over a layout's parameters: TP DTensors, FSDP2 DTensors and plain
tensors (DDP, a single rank, the norm weights TP leaves plain), on one or several device meshes.

`build_adamw` groups parameters by mesh (foreach and fused kernels take one mesh per call) and runs
AdamW's kernel on the local shards (`LocalAdamW`); `clip_grad_norm_` takes the global norm over every
rank's gradients and, with fused AdamW, folds the clip factor into the kernel instead of a pass of its
own.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam


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


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, *, pp_group=None,
                    optimizer: torch.optim.Optimizer | None = None,
                    uncounted: list[nn.Parameter] = ()) -> torch.Tensor:
    """Global gradient 2-norm over every rank's parameters, and clip to `max_norm` (0 = do not clip).

    Parameters may live on different meshes (TP DTensors, FSDP DTensors, plain tensors on one pipeline
    stage), so norms are taken per (mesh, placements) group, reduced to full values, then combined; with
    PP the squared norms of all stages are summed. `uncounted` gradients are clipped by the same factor
    but left out of the norm: a tied table's second pipeline copy, whose twin the first stage counts.

    Given an `optimizer` whose every group is fused AdamW, the clip costs no pass over the gradients of
    its own: the factor goes to the fused kernel as its `grad_scale` (the protocol GradScaler uses; the
    kernel divides each gradient by it as it reads it, and writes the clipped gradient back), so the
    next `optimizer.step()` applies it. Otherwise one `_foreach_mul_` clips the local gradients.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    skip = {id(p) for p in uncounted}
    for p in params:
        if p.grad is not None and id(p) not in skip:
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
        extra = [p.grad for p in uncounted if p.grad is not None]
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for gs in (*groups.values(), extra) for g in gs]
        torch._foreach_mul_(locals_, coef)
    return total
