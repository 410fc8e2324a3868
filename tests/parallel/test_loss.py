"""Tier 1: the chunked cross-entropy is the plain one (loss and gradient), chunk size aside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.loss import chunked_cross_entropy, cross_entropy


def _plain(logits, targets):
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(x.float(), targets)
    loss.backward()
    return loss.detach(), x.grad


def _chunked(logits, targets, chunk_elements):
    x = logits.detach().clone().requires_grad_()
    loss = chunked_cross_entropy(x, targets, chunk_elements=chunk_elements)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("chunk_elements", [1, 7 * 50, 10 * 50, 10**9])  # 1 token, uneven, even, one chunk
def test_chunked_loss_equals_plain_loss_fp32(chunk_elements):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g) * 3
    targets = torch.randint(0, 50, (37,), generator=g)
    targets[[3, 20]] = -100  # ignored tokens count neither in the mean nor in the gradient
    loss, grad = _chunked(logits, targets, chunk_elements)
    ref_loss, ref_grad = _plain(logits, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
    assert grad[[3, 20]].abs().max() == 0


def test_chunked_loss_equals_plain_loss_bf16():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 300, generator=g) * 2).bfloat16()
    targets = torch.randint(0, 300, (64,), generator=g)
    loss, grad = _chunked(logits, targets, 9 * 300)
    ref_loss, ref_grad = _plain(logits, targets)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    # Both round the same fp32 gradient to bf16 once: they differ at most by one bf16 rounding step.
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2**-7, atol=1e-9)


def test_scaled_backward_and_no_grad():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 11, 40, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (2, 11), generator=g)
    (cross_entropy(logits, targets) / 4).backward()  # the trainer divides by the micro-batch count
    x = logits.detach().clone().requires_grad_()
    (F.cross_entropy(x.flatten(0, 1), targets.flatten()) / 4).backward()
    torch.testing.assert_close(logits.grad, x.grad, rtol=1e-5, atol=1e-9)
    with torch.no_grad():
        torch.testing.assert_close(cross_entropy(logits, targets),
                                   F.cross_entropy(logits.flatten(0, 1), targets.flatten()), rtol=1e-6, atol=0)


def _compile_reason():
    from parallel.parallelize import compile_unavailable_reason

    return compile_unavailable_reason("cpu")


@pytest.mark.skipif(_compile_reason() is not None, reason=str(_compile_reason()))
def test_compiled_chunks_give_the_eager_loss_and_gradient():
    """`train.compile`'s loss (the full chunks through torch.compile, the shorter last one eager): the eager
    values to rounding, in bf16 with ignored tokens, scaled in backward, and without a gradient."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(90, 200, generator=g) * 3).bfloat16()
    targets = torch.randint(0, 200, (90,), generator=g)
    targets[[4, 70]] = -100  # ignored: one in a compiled chunk, one in the eager last chunk
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = {}
    for compiled in (False, True):
        x = logits.clone().requires_grad_()
        loss = chunked_cross_entropy(x, targets, chunk_elements=32 * 200, compiled=compiled)  # 32 + 32 + 26
        (loss / 3).backward()
        with torch.no_grad():
            no_grad = chunked_cross_entropy(logits, targets, chunk_elements=32 * 200, compiled=compiled)
        out[compiled] = loss.detach(), x.grad, no_grad
    (loss, grad, no_grad), (ref_loss, ref_grad, ref_no_grad) = out[True], out[False]
    # Really compiled: the chunk with and without a gradient, and the backward's scaling.
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(no_grad, ref_no_grad, rtol=1e-6, atol=0)
    assert grad.dtype == torch.bfloat16 and grad[[4, 70]].abs().max() == 0
    # Same fp32 arithmetic, fused: at most one bf16 rounding step apart, nearly everywhere equal.
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2**-7, atol=1e-9)
    assert (grad != ref_grad).float().mean() < 0.01


def test_rejects_wrong_shapes():
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        chunked_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("max_norm", [0.5, 100.0, 0.0])  # clipping, not clipping, disabled
def test_clip_through_fused_adamw_grad_scale_equals_clipping_the_gradients(max_norm):
    """With a fused AdamW, clip_grad_norm_ hands the factor to the kernel instead of scaling gradients
    itself; the step and the clipped gradients are what scaling them first gives."""
    from parallel.optim import build_adamw, clip_grad_norm_

    g = torch.Generator().manual_seed(3)
    init = [torch.randn(6, 4, generator=g), torch.randn(4, generator=g)]
    grads = [torch.randn(6, 4, generator=g), torch.randn(4, generator=g)]
    out = {}
    for fused in (False, True):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt = build_adamw(ps, fused=fused, lr=0.1, weight_decay=0.1)
        norm = clip_grad_norm_(ps, max_norm, optimizer=opt)
        assert (getattr(opt, "grad_scale", None) is not None) == (fused and max_norm > 0)
        opt.step()
        out[fused] = (norm, [p.detach() for p in ps], [p.grad for p in ps])
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=0)
    for a, b in zip(out[True][1] + out[True][2], out[False][1] + out[False][2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
