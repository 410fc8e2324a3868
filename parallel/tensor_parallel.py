"""Tensor parallelism for the Llama model with DTensor (Megatron-style column/row split).

Embedding is vocab-parallel (row-wise over vocab), attention/MLP are column-then-row parallel, and the
output projection is column-parallel over the vocabulary so the loss can run vocab-parallel
(`torch.distributed.tensor.parallel.loss_parallel`). With sequence parallel the norms and the residual
stream between TP regions are sharded along the sequence dimension. Per-head q/k norms (Qwen3) see the
local heads only: their weight is replicated and their input is taken as sharded on the head dim, so
its gradient is summed over the TP ranks. Both the embedding and the output are split on the
vocabulary (dim 0 of their weights), so a tied table is one DTensor that both modules hold again.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallel.sharding import TP_BLOCK_SHARD_DIM


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard `model` (possibly one pipeline stage of it) over `tp_mesh`, in place."""
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    model.tie_weights()  # sharding made two Parameters of a tied table

    for block in model.layers.values():
        # Column-parallel (dim 0) or row-parallel (dim 1), from the table the resize planner reads too.
        plan: dict[str, object] = {
            name: ColwiseParallel() if dim == 0 else RowwiseParallel(output_layouts=seq)
            for name, dim in TP_BLOCK_SHARD_DIM.items()
        }
        if block.attention.q_norm is not None:
            heads = SequenceParallel(sequence_dim=2, use_local_output=True)  # [B, T, local heads, head_dim]
            plan.update({"attention.q_norm": heads, "attention.k_norm": heads})
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            })
        parallelize_module(block, tp_mesh, plan)
