"""An emulated accelerator: the time a micro-batch's forward and backward would take on a device, spent
by the host waiting (`time.sleep`, which releases the GIL as a wait on a CUDA stream does), on top of
the model's real computation. A benchmark on CPUs sets `ModelConfig.emulate_s_per_sample` so that N
workers train N times as fast, as N GPUs would, while the real computation stays a small share of the
step; every training loop that builds the model from `models.llama.build_model` runs the same waits.

The model spreads a micro-batch's time over its layers (`Transformer.forward`): each layer waits its
share before it runs, in the forward and, after the layer's own backward, in the backward. So the
gradient reduction DDP starts when a bucket's gradients are ready runs beside the waits of the layers
still to run, as it runs beside their compute on a GPU, instead of after the whole backward.

The split, a third in the forward and two thirds in the backward, is the usual ratio of a transformer's
backward FLOPs to its forward's. The values the model computes are untouched: the wait is an identity
in both directions.
"""

from __future__ import annotations

import time

import torch

FORWARD_SHARE = 1.0 / 3.0
"""The share of a micro-batch's emulated time spent in its forward; the backward takes the rest."""


class _DeviceWait(torch.autograd.Function):
    """Identity on `x` that waits `forward_s` in the forward and `backward_s` in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


def device_time(x: torch.Tensor, *, samples: int, s_per_sample: float) -> torch.Tensor:
    """`x`, after waiting a micro-batch of `samples` samples' forward share of the emulated time; its
    gradient, when it is asked for, waits the backward share. Without autograd (evaluation, or no
    tensor that needs a gradient) only the forward share is waited."""
    total = samples * s_per_sample
    if total <= 0:
        return x
    if not (torch.is_grad_enabled() and x.requires_grad):
        time.sleep(total * FORWARD_SHARE)
        return x
    return _DeviceWait.apply(x, total * FORWARD_SHARE, total * (1.0 - FORWARD_SHARE))
