"""Pipeline parallelism: split the model by layers into stages that keep canonical names, and build a
torch.distributed.pipelining schedule for one stage per rank.

`stage_layers` is pure; the rest imports torch lazily so the split math stays importable anywhere.

Tied embeddings: the first stage holds the table as `tok_embeddings.weight`, the last as its output
projection's weight, two copies of one tensor. Both start from the same value (initialisation and
checkpoints know the copy by the table's name), and `sync_tied_grads` sums their gradients across the
two stages after every backward, so the same AdamW update keeps them bitwise equal. A checkpoint stores
the table once: both copies are saved under `tok_embeddings.weight` as replicas of the same box.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

SCHEDULES = ("1f1b", "gpipe")


def stage_layers(n_layers: int, pp: int) -> list[list[int]]:
    """Global layer indices held by each of `pp` stages, as even as possible (earlier stages take the
    remainder, since the last stage also holds the output projection and the loss)."""
    if pp < 1 or pp > n_layers:
        raise ValueError(f"pp={pp} must be between 1 and the number of layers ({n_layers})")
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def split_stage(model: "nn.Module", stage: int, pp: int) -> "nn.Module":
    """Prune `model` in place down to pipeline stage `stage` of `pp`. Names of what remains are unchanged."""
    keep = {str(i) for i in stage_layers(len(model.layers), pp)[stage]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != pp - 1:
        model.norm = None
        model.output = None
    return model


def tied_group(mesh, layout):
    """The process group of this rank's first and last pipeline stages (same dp/tp coordinates), for
    `sync_tied_grads`; None without PP, and on the stages between. Only the two members make it (local
    synchronization, as `Layout.build_mesh` makes its groups): one `new_group` on a rank at most, not one
    per pipeline line. Every rank calls it, in the same place after `build_mesh`."""
    import torch.distributed as dist

    from parallel.layout import MeshAxis

    if not layout.pp_enabled:
        return None
    line = mesh[MeshAxis.PP.value].mesh.tolist()  # this rank's pipeline line
    if dist.get_rank() not in (line[0], line[-1]):
        return None
    return dist.new_group([line[0], line[-1]], use_local_synchronization=True)


def sync_tied_grads(model: "nn.Module", group) -> None:
    """Sum the gradient of the tied table over its two pipeline copies (first and last stage; a no-op on
    the stages between, and without a group)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if group is None:
        return
    holder = model.tok_embeddings if model.tok_embeddings is not None else model.output
    if holder is None or holder.weight.grad is None:
        return
    g = holder.weight.grad
    dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)


def build_schedule(
    module: "nn.Module",
    *,
    stage: int,
    pp: int,
    group,
    device: "torch.device",
    n_microbatches: int,
    loss_fn: Callable,
    schedule: str,
):
    """A single-stage-per-rank schedule (1F1B or GPipe) driving `module` as stage `stage`."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    if schedule == "1f1b" and n_microbatches < pp:
        raise ValueError(
            f"1F1B needs at least as many microbatches as stages: {n_microbatches} microbatches < pp={pp}; "
            "lower micro_batch_size or raise global_batch_size"
        )
    pstage = PipelineStage(module, stage, pp, device, group=group)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return cls(pstage, n_microbatches=n_microbatches, loss_fn=loss_fn)
