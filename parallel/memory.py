"""Estimated peak memory per device for training a model under a layout: what the planner weighs
against the memory budget. Pure: no torch import.

In bytes per device, an upper bound for the busiest stage:
  layers = ceil(n_layers / pp)
  P      = (layers * layer_params + E) / tp, where E = embedding + output + final norm when pp == 1 and
           one vocab table + final norm when pp > 1 (the first stage holds the embedding, the last the output)
  state  = P * (param_bytes + 4 grad + 8 AdamW + 4 fp32 master if param_bytes < 4) / dp_shard
  act    = layers * mb * seq_len * dim * 17 * param_bytes / tp
           (34 bytes per hidden element at 16 bits, Korthikanti et al. 2022, with flash attention)
  logits = mb * seq_len * vocab_size * 4 / tp   (fp32 logits for the loss)
  total  = state + act + logits
Each term is non-increasing in tp, pp and dp_shard. Left out: the extra microbatches 1F1B keeps in
flight on early stages, FSDP all-gather buffers and allocator fragmentation; keep headroom in the budget.
"""

from __future__ import annotations

from models.config import ModelConfig
from parallel.layout import Layout


def estimate_memory(model: ModelConfig, layout: Layout, *, micro_batch_size: int, seq_len: int,
                    param_bytes: int = 4) -> float:
    """Estimated peak bytes per device for training `model` under `layout` (formula in the module doc)."""
    for name, v in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len), ("param_bytes", param_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if layout.pp > model.n_layers:
        raise ValueError(f"pp={layout.pp} exceeds n_layers={model.n_layers}")
    table = model.vocab_size * model.dim
    output = 0 if model.tie_embeddings else table  # a tied output projection is the embedding table
    try:  # integers past a float's range (a huge head_size) cannot be estimated: too large for any device
        layer_params = (model.num_params(embedding=False) - output - model.dim) / model.n_layers
    except OverflowError:
        raise ValueError(f"the model has about 10^{len(str(model.num_params()))} parameters, too many to estimate "
                         "its memory") from None
    layers = -(-model.n_layers // layout.pp)
    # One stage holds both ends; under PP the first holds the embedding, the last the output (a tied
    # table's copy there too).
    ends = (table + output if layout.pp == 1 else table) + model.dim
    params = (layers * layer_params + ends) / layout.tp
    per_param = param_bytes + 4 + 8 + (4 if param_bytes < 4 else 0)
    tokens = micro_batch_size * seq_len
    act = layers * tokens * model.dim * 17 * param_bytes / layout.tp
    logits = tokens * model.vocab_size * 4 / layout.tp
    return params * per_param / layout.dp_shard + act + logits
