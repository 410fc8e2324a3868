"""The training loss: mean next-token cross-entropy, taken in fp32 without materialising fp32 logits whole.

With `train.compile` the per-chunk work runs as compiled kernels (`compiled=True`): each chunk's upcast,
log-sum-exp, gradient and write into the gradient buffer fuse into a few kernels that read the logits'
chunk twice, where eager runs a dozen kernels per chunk, each over the chunk's fp32 copy. At a 128k
vocabulary a step of 8k tokens is 64 chunks: eager that was ~19 ms per step of elementwise kernels on an
H200 (the `aten::copy_`, `aten::sub` and `aten::mul_` of the 8B-shape profile in docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor


CE_CHUNK_ELEMENTS = 1 << 24
"""Logit elements (tokens x vocabulary) the chunked loss upcasts to fp32 at a time: 64 MiB, ~2k tokens of
a 32k vocabulary, enough rows per chunk that the kernels stay efficient."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, compiled: bool = False) -> torch.Tensor:
    """Mean next-token loss over all tokens.

    Vocab-sharded DTensor logits (TP's `loss_parallel`) take DTensor's vocab-parallel loss, which holds
    only a 1/tp slice of the vocabulary per rank. Plain logits take `chunked_cross_entropy`, which never
    holds the fp32 upcast of the whole [tokens, vocab] matrix; `compiled` runs its chunks compiled."""
    if isinstance(logits, DTensor):
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    return chunked_cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), compiled=compiled)


def loss_function(compiled: bool):
    """The loss a trainer uses: `cross_entropy`, with its chunks compiled where `train.compile` is on."""
    return functools.partial(cross_entropy, compiled=True) if compiled else cross_entropy


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                          chunk_elements: int = CE_CHUNK_ELEMENTS, compiled: bool = False) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), targets)` (mean, ignore_index -100) on [N, V] logits, computed
    chunk_elements // V tokens at a time in fp32.

    The gradient is computed in the same pass and kept in the logits' dtype, the size of the gradient
    backward would produce anyway; so neither the fp32 logits nor the fp32 log-probabilities that
    autograd would save for backward ever exist whole (4 + 4 bytes per logit, against 2 for bf16 logits).
    `compiled` computes the same arithmetic through torch.compile (values equal to rounding)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"chunked_cross_entropy wants [N, V] logits and [N] targets, got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    chunk = max(1, chunk_elements // logits.shape[1])
    return _ChunkedCrossEntropy.apply(logits, targets, chunk, compiled)


def _chunk(x: torch.Tensor, t: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """The loss summed over one chunk's valid tokens; with `grad`, d(that sum)/dx written into it
    (softmax - onehot, zero on ignored rows), rounded to its dtype."""
    x = x.float()
    valid = t != -100
    t = t.masked_fill(~valid, 0).unsqueeze(1)
    lse = torch.logsumexp(x, dim=1, keepdim=True)
    total = ((lse - x.gather(1, t)).squeeze(1) * valid).sum()
    if grad is not None:
        p = (x - lse).exp_()
        p.scatter_add_(1, t, torch.full_like(t, -1, dtype=p.dtype))
        p.mul_(valid.unsqueeze(1))
        grad.copy_(p)
    return total


def _scaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`grad * scale` in fp32, rounded once to grad's dtype (as autograd through `.float()` would)."""
    return (grad.float() * scale).to(grad.dtype)


@functools.cache
def _compiled(fn):
    # dynamic=False: the full chunks of a step all have one shape, compiled once.
    return torch.compile(fn, fullgraph=True, dynamic=False)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, compiled: bool) -> torch.Tensor:
        # Compiled: every chunk of the step's one shape; a shorter last one after full ones (2 tokens of
        # 8,192 at a 128k vocabulary) runs eager rather than costing a compile of its own shape.
        body = _compiled(_chunk) if compiled else _chunk
        grad = torch.empty_like(logits) if logits.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        count = (targets != -100).sum()
        n = logits.shape[0]
        for start in range(0, n, chunk):
            end = start + chunk
            fn = body if end <= n or start == 0 else _chunk
            total += fn(logits[start:end], targets[start:end], None if grad is None else grad[start:end])
        ctx.chunk, ctx.compiled = chunk, compiled
        ctx.save_for_backward(grad, count)
        return total / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad, count = ctx.saved_tensors
        scale = grad_out.float() / count
        if grad.dtype == torch.float32:
            return grad * scale, None, None, None
        if ctx.compiled:  # one fused kernel: the fp32 product never exists whole
            return _compiled(_scaled)(grad, scale), None, None, None
        # Eager: scale in fp32 and round once (into `out`, no rounded copy), chunked as in forward.
        out = torch.empty_like(grad)
        for start in range(0, grad.shape[0], ctx.chunk):
            out[start:start + ctx.chunk] = grad[start:start + ctx.chunk].float() * scale
        return out, None, None, None
