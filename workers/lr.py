"""The learning rate as a pure function of the global step.

Nothing here is per param group: a rank holding 3 pipeline layers and one holding 5 compute the same LR,
and a checkpoint needs only the step (plus this config) to restore it.
"""

from __future__ import annotations

import math

from workers.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step `step` (0-based: the first update uses lr_at(0))."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    peak = cfg.lr
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    decay = cfg.decay_steps if cfg.decay_steps is not None else cfg.steps
    span = max(1, decay - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = peak * cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
