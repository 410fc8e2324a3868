"""What one rank runs: build model, optimizer and data for a Layout, and train step by step.

Launcher-agnostic: it needs only an initialised default process group whose size equals the layout's
world size (torchrun, a Ray actor, or a test helper provide it).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from models.llama import build_model
from parallel.layout import Layout, MeshAxis
from parallel.parallelize import (
    clip_grad_norm_,
    cross_entropy,
    materialize,
    param_groups,
    parallelize,
    set_grad_sync,
)
from parallel.pipeline import build_schedule
from parallel.planner import micro_batch_for
from workers.config import JobConfig
from workers.data import Batch, DataLoader, build_source
from workers.lr import lr_at


@dataclass(kw_only=True, slots=True)
class StepMetrics:
    step: int
    """Optimizer steps completed, counting this one (1-based)."""
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    """Tokens consumed by the whole job so far (all DP ranks)."""
    layout: dict
    world_size: int
    time: float
    step_time: float
    tokens_per_s: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Trainer:
    """Trains one rank's share of the job under `layout`. Call `build()` once, then `train_step()`."""

    def __init__(self, cfg: JobConfig, *, layout: Layout, device: torch.device, run_dir: str | Path | None = None):
        layout.check_world_size(dist.get_world_size())
        self.cfg = cfg
        self.layout = layout
        self.device = device
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = dist.get_rank()
        self.step = 0
        self.on_batch: Callable[[Batch], None] | None = None  # seam for tests that audit sample ids

    # -- construction ------------------------------------------------------------------------------
    def build(self) -> "Trainer":
        cfg, layout = self.cfg, self.layout
        self.model_cfg = cfg.model.build()
        self.mesh = layout.build_mesh(self.device.type)
        coords = layout.coords(self.rank)
        self.pp_rank = coords[MeshAxis.PP]
        self.dp_rank = layout.dp_rank(self.rank)
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == layout.pp - 1

        dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else None
        model = build_model(self.model_cfg)
        parallelize(
            model,
            layout=layout,
            mesh=self.mesh,
            sequence_parallel=cfg.parallel.sequence_parallel,
            loss_parallel=True,
            param_dtype=dtype,
        )
        materialize(model, seed=cfg.train.seed, device=self.device)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            param_groups(self.params), lr=lr_at(0, t), betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
            foreach=True,
        )

        per_rank = t.global_batch_size // layout.dp
        self.micro_batch_size = micro_batch_for(
            t.global_batch_size, layout.dp, t.micro_batch_size, min_microbatches=layout.pp
        )
        self.n_microbatches = per_rank // self.micro_batch_size
        source = build_source(cfg.data, seed=t.seed, vocab_size=self.model_cfg.vocab_size)
        self.loader = DataLoader(
            source, seed=t.seed, global_batch_size=t.global_batch_size,
            micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank, dp_size=layout.dp,
        )
        self.schedule = None
        if layout.pp_enabled:
            self.schedule = build_schedule(
                model, stage=self.pp_rank, pp=layout.pp, group=self.mesh[MeshAxis.PP.value].get_group(),
                device=self.device, n_microbatches=self.n_microbatches, loss_fn=cross_entropy,
                schedule=cfg.parallel.pp_schedule,
            )
        return self

    # -- one optimizer step ------------------------------------------------------------------------
    def _loss_ctx(self):
        return loss_parallel() if self.layout.tp_enabled else contextlib.nullcontext()

    def _forward_backward(self, batch: Batch) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's samples; return the summed
        per-microbatch mean losses on ranks that compute the loss (zero elsewhere)."""
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:
            x, y = batch.stacked()
            x, y = x.to(self.device), y.to(self.device)
            losses: list[torch.Tensor] = []
            with self._loss_ctx():
                if self.is_first_stage:
                    self.schedule.step(x, target=y if self.is_last_stage else None, losses=losses)
                elif self.is_last_stage:
                    self.schedule.step(target=y, losses=losses)
                else:
                    self.schedule.step()
            for loss in losses:
                total += _scalar(loss).detach().float()
            return total
        n = len(batch.inputs)
        for i, (x, y) in enumerate(zip(batch.inputs, batch.targets)):
            set_grad_sync(self.model, i == n - 1)
            with self._loss_ctx():
                loss = cross_entropy(self.model(x.to(self.device)), y.to(self.device))
                (loss / n).backward()
            total += _scalar(loss).detach().float()
        return total

    def train_step(self) -> StepMetrics:
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.loader.next_batch()
        if self.on_batch is not None:
            self.on_batch(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = self._forward_backward(batch)
        pp_group = self.mesh[MeshAxis.PP.value].get_group() if self.layout.pp_enabled else None
        grad_norm = clip_grad_norm_(self.params, self.cfg.train.grad_clip, pp_group=pp_group)
        self.optimizer.step()
        self.step += 1

        # Mean loss over the global batch: every loss-computing rank holds the mean over its samples;
        # there are dp x tp of them (TP ranks hold the same value), the other stages contribute zero.
        loss = loss_sum / self.n_microbatches
        dist.all_reduce(loss)
        loss = loss.item() / (self.layout.dp * self.layout.tp)
        dt = time.perf_counter() - t0
        tokens_step = self.cfg.train.global_batch_size * self.cfg.data.seq_len
        m = StepMetrics(
            step=self.step, loss=loss, lr=lr, grad_norm=float(grad_norm), tokens=self.loader.position.consumed_samples * self.cfg.data.seq_len,
            layout=self.layout.to_dict(), world_size=self.layout.world_size, time=time.time(), step_time=dt,
            tokens_per_s=tokens_step / dt if dt > 0 else 0.0,
        )
        if self.rank == 0 and self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(m.to_json() + "\n")
        return m

    def fit(self, total_steps: int, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Train until `total_steps` optimizer steps have been taken in the whole run."""
        out = []
        while self.step < total_steps:
            m = self.train_step()
            out.append(m)
            if on_step is not None:
                on_step(m)
        return out
