"""The training loss: mean next-token cross-entropy, taken in fp32 without materialising fp32 logits whole.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


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
