"""What one rank runs: build model, optimizer and data for a Layout, and train step by step.

Launcher-agnostic: it needs only an initialised default process group whose size equals the layout's
world size (torchrun, a Ray actor, or a test helper provide it).

Checkpoints (parallel.checkpoint) go to `checkpoint.dir`, else RUN_DIR/checkpoints; `build()` resumes
from the newest loadable one whatever layout it was saved under, so a run continues across resizes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from models.llama import build_model
from parallel.checkpoint.manager import CheckpointManager
from parallel.checkpoint.placement import Placement
from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.prefetch import Prefetch, start_prefetch
from parallel.checkpoint.state import capture_rng, restore_rng
from parallel.float8 import float8_unavailable_reason, precompute_scales_after_step
from parallel.layout import Layout, MeshAxis
from parallel.loss import loss_function
from parallel.optim import build_adamw, clip_grad_norm_
from parallel.parallelize import (
    compile_unavailable_reason,
    init_shards,
    materialize,
    parallelize,
    reshard_after_eval,
    set_grad_sync,
)
from parallel.pipeline import build_schedule, sync_tied_grads, tied_group
from parallel.planner import Plan
from parallel.precision import select_precision
from workers.compile_cache import apply_compile_cache, job_cache_key
from workers.config import ConfigError, JobConfig, job_plan
from workers.data import Batch, DataLoader, build_source, build_val_source
from workers.lr import lr_at
from workers.mfu import mfu, peak_flops
from workers.report import Reporter, StepMetrics
from workers.resume import refuse_foreign

log = logging.getLogger(__name__)

_LR_FIELDS = ("lr", "min_lr_ratio", "warmup_steps", "schedule", "decay_steps", "steps")
PHASES = ("data", "forward+backward", "grad clip", "optimizer", "loss all_reduce")
"""The parts of `Trainer.train_step` that `Trainer.phase_times` times, in order; what follows them (metrics,
eval, periodic checkpoint) is not timed."""
BUILD_PHASES = ("model", "allocate", "optimizer", "data", "checkpointer", "resume", "init_from", "init",
                "staging")
"""The parts of `Trainer.build` that `Trainer.build_times` times, in order: meta model, mesh and
parallelize; allocating the shards; the optimizer; data and pipeline schedule; the checkpoint manager; a
resume (its load); a Hugging Face import; drawing initial values; starting the staging pool's
allocation."""


class _Laps:
    """Adds the seconds since the previous lap to `into[name]`."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = self.into.get(name, 0.0) + now - self.t
        self.t = now


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Trainer:
    """Trains one rank's share of the job as `plan` says (layout and micro batch). Call `build()` once,
    then `train_step()`. Given only a `layout`, the planner plans it (as it would a forced layout)."""

    def __init__(self, cfg: JobConfig, *, plan: Plan | None = None, layout: Layout | None = None,
                 device: torch.device, run_dir: str | Path | None = None):
        if (plan is None) == (layout is None):
            raise ValueError("Trainer needs exactly one of plan= and layout=")
        plan = plan or job_plan(cfg, layout.world_size, layout=layout)
        plan.layout.check_world_size(dist.get_world_size())
        if plan.micro_batch_size * plan.grad_accum_steps * plan.layout.dp != cfg.train.global_batch_size:
            raise ValueError(f"plan micro_batch_size={plan.micro_batch_size} x grad_accum_steps="
                             f"{plan.grad_accum_steps} x dp={plan.layout.dp} is not train.global_batch_size="
                             f"{cfg.train.global_batch_size}")
        self.cfg = cfg
        self.plan = plan
        self.layout = plan.layout
        self.device = device
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = dist.get_rank()
        self.step = 0
        self.on_batch: Callable[[Batch], None] | None = None  # seam for tests that audit sample ids
        self.phase_times: dict[str, float] | None = None
        """While a dict: seconds in each of `PHASES`, summed over steps (a seam for benchmarks). On CUDA
        each timed phase ends with a device sync. None: not timed."""
        self._phase_t = 0.0
        self.checkpointer: CheckpointManager | None = None
        self.resumed_from: Manifest | None = None
        """Manifest of the checkpoint `build()` resumed from, if any."""
        self.init_elements = 0
        """Random initial values `build()` drew on this rank (0 when the state was loaded or adopted)."""
        self.prefetched_bytes = 0
        """Bytes of the checkpoint read into the page cache beside the build, before the resume's load."""
        self._checkpoints_due = False
        """`build(checkpoints_later=True)` left the checkpoint manager to `start_checkpoints()`."""
        self.build_times: dict[str, float] = {}
        """Seconds `build()` spent in each of `BUILD_PHASES` it went through (a seam for benchmarks)."""
        self._before_update: dict | None = None
        self._mid_step = False
        self.last_metrics: StepMetrics | None = None
        self.reporter = Reporter(cfg, self.run_dir, rank=self.rank)
        self.val_loader: DataLoader | None = None

    # -- construction ------------------------------------------------------------------------------
    def build(self, *, resume: bool = True, init_weights: bool = True, checkpoints_later: bool = False) -> "Trainer":
        """Build model, optimizer, data and schedule for this rank; `resume`: load the newest committed
        checkpoint (off when the state arrives another way, e.g. `adopt()` after a live reshard, which
        also needs no initial values: `init_weights=False` leaves the shards allocated but unset).
        `checkpoints_later` (only without `resume`): leave the checkpoint manager and its staging pool
        to `start_checkpoints()` (collective), which the first save calls if nothing did before: a
        re-formed group's first step then waits for neither.

        The shards are allocated unset and given initial values only when nothing else fills them: a
        resume (or `model.init_from`) writes every element, so a restart never computes random values
        that the load overwrites. `init_elements` says how many this rank drew."""
        cfg, layout = self.cfg, self.layout
        # Checks every rank makes alike, before any collective: a bad option fails fast, never hangs.
        if resume and checkpoints_later:
            raise ValueError("Trainer.build(checkpoints_later=True) needs resume=False: a resume reads "
                             "through the checkpoint manager")
        t = cfg.train
        cuda = self.device.type == "cuda"
        try:
            precision = select_precision(
                t.dtype, self.device.type, bf16_supported=not cuda or torch.cuda.is_bf16_supported()
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if t.compile and (why := compile_unavailable_reason(self.device.type)):
            raise ConfigError(f"train.compile: {why}")
        if why := float8_unavailable_reason(t.float8, self.device.type, dtype=t.dtype):
            raise ConfigError(f"train.float8: {why}")
        if t.compile:
            apply_compile_cache(job_cache_key(cfg.name, self.run_dir))  # an earlier rank's graphs are reused
        clock = _Laps(self.build_times)
        self.model_cfg = cfg.model.build()
        # The disk would idle while the model is built (in a fresh process: mostly imports): read the
        # files the resume will need into the page cache meanwhile.
        prefetch = self._prefetch() if resume else None
        self.mesh = layout.build_mesh(self.device.type)
        coords = layout.coords(self.rank)
        self.pp_rank = coords[MeshAxis.PP]
        self.dp_rank = layout.dp_rank(self.rank)
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == layout.pp - 1

        model = build_model(self.model_cfg)
        parallelize(
            model,
            layout=layout,
            mesh=self.mesh,
            sequence_parallel=cfg.parallel.sequence_parallel,
            loss_parallel=True,
            precision=precision,
            activation_checkpointing=t.activation_checkpointing,
            compile=t.compile,
            float8=t.float8,
        )
        clock.lap("model")
        materialize(model, seed=cfg.train.seed, device=self.device, init=False)
        clock.lap("allocate")
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flops_per_token = self.model_cfg.flops_per_token(cfg.data.seq_len)
        self.peak_flops = peak_flops(torch.cuda.get_device_name(self.device) if cuda else None, t.dtype)
        fused = t.fused_optimizer if t.fused_optimizer is not None else True
        self.optimizer = build_adamw(self.params, fused=fused, lr=lr_at(0, t), betas=(t.beta1, t.beta2),
                                     eps=t.eps, weight_decay=t.weight_decay)
        precompute_scales_after_step(self.model, self.optimizer)
        clock.lap("optimizer")
        self.micro_batch_size = self.plan.micro_batch_size  # the planner's: it may be smaller to fit memory
        self.n_microbatches = self.plan.grad_accum_steps
        self.loss_fn = loss_function(compiled=t.compile)
        loader = dict(seed=t.seed, global_batch_size=t.global_batch_size, micro_batch_size=self.micro_batch_size,
                      dp_rank=self.dp_rank, dp_size=layout.dp)
        try:
            self.loader = DataLoader(build_source(cfg.data, seed=t.seed, vocab_size=self.model_cfg.vocab_size), **loader)
            if t.eval_interval:
                val = build_val_source(cfg.data, seed=t.seed, vocab_size=self.model_cfg.vocab_size)
                self.val_loader = DataLoader(val, **loader)
        except ValueError as e:  # e.g. a corpus with too little text: the same verdict on every rank
            raise ConfigError(f"data: {e}") from None
        self.schedule = None
        self.tied_group = tied_group(self.mesh, layout) if self.model_cfg.tie_embeddings else None
        # The last stage's copy of a tied table: its gradient equals the first stage's after the sync,
        # so the global norm counts it once.
        self.tied_copy = ([model.output.weight] if self.tied_group is not None and self.is_last_stage
                          and not self.is_first_stage else [])
        if layout.pp_enabled:
            self.schedule = build_schedule(
                model, stage=self.pp_rank, pp=layout.pp, group=self.mesh[MeshAxis.PP.value].get_group(),
                device=self.device, n_microbatches=self.n_microbatches, loss_fn=self.loss_fn,
                schedule=cfg.parallel.pp_schedule,
            )
        clock.lap("data")
        if prefetch is not None:  # the load reads from here on; two readers would share the disk
            self.prefetched_bytes = prefetch.stop()
        self._checkpoints_due = checkpoints_later and self.checkpoint_dir() is not None
        if not self._checkpoints_due and self._make_checkpointer(clock):
            if resume:
                self.resume(fresh=True)  # the shards were allocated unset just above
                clock.lap("resume")
        if resume and self.resumed_from is None and cfg.model.init_from is not None:
            self.load_init_from()  # a fresh start; the run's own checkpoint, when there is one, wins
            clock.lap("init_from")
        elif init_weights and self.resumed_from is None:
            self.init_elements = init_shards(model, seed=t.seed)
            clock.lap("init")
        if self.checkpointer is not None:
            self.checkpointer.prepare(model, self.optimizer)  # the first save finds its staging pool ready
            clock.lap("staging")
        return self

    def _make_checkpointer(self, clock: _Laps) -> bool:
        """The checkpoint manager (collective: it makes a process group of its own), if checkpoints are
        on; whether they are."""
        ckpt_dir = self.checkpoint_dir()
        if ckpt_dir is None:
            return False
        c = self.cfg.checkpoint
        self.checkpointer = CheckpointManager(ckpt_dir, keep_last=c.keep_last, async_save=c.async_save,
                                              checksum=c.checksum, io_threads=c.io_threads, placement=self.placement())
        clock.lap("checkpointer")
        return True

    def start_checkpoints(self) -> dict[str, float]:
        """Build the checkpoint manager and its staging pool that `build(checkpoints_later=True)` left
        (collective: every rank calls it at the same step); nothing if there is none due. Returns the
        seconds each part took (`checkpointer`, `staging`)."""
        if not self._checkpoints_due:
            return {}
        self._checkpoints_due = False
        took: dict[str, float] = {}
        clock = _Laps(took)
        self._make_checkpointer(clock)
        self.checkpointer.prepare(self.model, self.optimizer)
        clock.lap("staging")
        return took

    def _prefetch(self) -> Prefetch | None:
        """Start reading this rank's files of the newest checkpoint of the run (else of
        checkpoint.resume_from) into the page cache, in a thread."""
        mc, ckpt = self.model_cfg, self.cfg.checkpoint
        for root in (self.checkpoint_dir(), ckpt.resume_from):
            if root and (p := start_prefetch(root, self.layout, self.rank, mc.n_layers, tied=mc.tie_embeddings)):
                return p
        return None

    def load_init_from(self) -> int:
        """Copy model.init_from's Hugging Face weights into this rank's shards (any layout; each rank
        reads only its slices); returns the bytes read."""
        from parallel.hf_import import HFImportError, check_hf_dir, load_hf_weights

        try:  # checked again here, where the files are read: the edge may share no filesystem with us
            weights = check_hf_dir(Path(self.cfg.model.init_from).expanduser(), self.model_cfg)
        except HFImportError as e:
            raise ConfigError(str(e)) from None
        return load_hf_weights(self.model, weights, self.model_cfg, threads=self.cfg.checkpoint.io_threads)

    # -- checkpoints -------------------------------------------------------------------------------
    def checkpoint_dir(self) -> str | None:
        """checkpoint.dir, else RUN_DIR/checkpoints; None (no checkpoints) without either."""
        if self.cfg.checkpoint.dir:
            return self.cfg.checkpoint.dir
        return str(self.run_dir / "checkpoints") if self.run_dir is not None else None

    def placement(self) -> Placement:
        """The layout saves run under, for the checkpoint's writer rule and its loaders' index reads."""
        mc = self.model_cfg
        return Placement(layout=self.layout, n_layers=mc.n_layers, tied=mc.tie_embeddings,
                         params=self.expected_tensors())

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Global shape and dtype of every parameter of the whole (unsplit) model, from a meta-device
        copy: lets the loader reject another model's checkpoint before reading it."""
        meta = build_model(self.model_cfg)
        return {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in meta.named_parameters()}

    def checkpoint_state(self) -> dict:
        """Everything besides tensors that resuming needs, as JSON. The LR schedule is the global step
        plus its config (never per-param-group lambdas): `lr_at(step, cfg)` recomputes it under any layout."""
        t = self.cfg.train
        n_samples = len(self.loader.source)
        return {
            "layout": self.layout.to_dict(),
            "world_size": self.layout.world_size,
            "model_config": self.model_cfg.to_dict(),
            "job_name": self.cfg.name,
            "job_config_digest": self.cfg.digest(),
            "lr_schedule": {"step": self.step, **{k: getattr(t, k) for k in _LR_FIELDS}},
            "data": {**self.loader.state_dict(), "epoch": self.loader.position.epoch(n_samples)},
            "rng": capture_rng(),  # rank 0's states are the ones the manifest keeps
            "sources": self._sources(),
        }

    def _sources(self) -> dict:
        """What `elastron export` copies beside the weights: model.init_from's directory (tokenizer, token
        ids, generation config, dtype) and the tokenizer `data prepare` recorded with its EOS id."""
        from workers.prepare import read_meta

        meta = read_meta(self.cfg.data.path) if self.cfg.data.source == "tokens" and self.cfg.data.path else None
        return {"init_from": self.cfg.model.init_from, "tokenizer": (meta or {}).get("tokenizer"),
                "eos_id": (meta or {}).get("eos_id")}

    def resume(self, *, fresh: bool = False) -> Manifest | None:
        """Load the newest loadable checkpoint (any layout) and restore step, data position and RNG.
        `fresh`: the shards hold no values yet (during `build()`), so the load may read into them
        directly; a load that fails then leaves them unusable, as unset shards are anyway."""
        src, named = self.checkpointer, self.cfg.checkpoint.resume_from
        m = src.load_latest(self.model, self.optimizer, expected=self.expected_tensors(), fresh=fresh)
        if m is None and named and named.rstrip("/") != str(src.root).rstrip("/"):
            c = self.cfg.checkpoint  # another job's checkpoints, named on purpose: read, never written
            src = CheckpointManager(named, keep_last=c.keep_last, io_threads=c.io_threads, read_only=True)
            m = src.load_latest(self.model, self.optimizer, expected=self.expected_tensors(), fresh=fresh)
        if m is None:
            return None
        where = f"checkpoint {src.root} step {m.step}"
        if not named:
            refuse_foreign(m.state, job_name=self.cfg.name, model_config=self.model_cfg.to_dict(), where=where)
        self.restore_state(m.step, m.state, where=where)
        if src is self.checkpointer:
            self.checkpointer.last_saved_step = self.checkpointer.last_committed_step = m.step  # no re-save
        self.resumed_from = m
        return m

    def adopt(self, pieces: dict, optimizer_steps: dict[str, int], state: dict) -> "Filled":
        """Take over the state another layout's workers sent over the network (`parallel.live`): the
        pieces become this rank's shards (whole plain-tensor shards as they are, others copied in:
        `parallel.live.fill`), then step, data position and RNG are restored from `state` (what
        `checkpoint_state()` gave on the old rank 0). Returns the bytes moved and copied."""
        from parallel.live import fill

        filled = fill(self.model, self.optimizer, pieces, optimizer_steps)
        self.restore_state(int(state["lr_schedule"]["step"]), state, where="live reshard")
        return filled

    def restore_state(self, step: int, state: dict, *, where: str) -> None:
        """Step, data position and RNG from a checkpoint's (or a live reshard's) JSON state."""
        try:
            self.loader.load_state_dict(state["data"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: cannot restore the data position: {e}") from None
        self.step = step
        if self.rank == 0:
            if state.get("job_config_digest") != self.cfg.digest():
                log.warning("%s was saved by a job config with digest %s, this job's is %s; "
                            "resuming anyway", where, state.get("job_config_digest"), self.cfg.digest())
            saved_lr = {k: v for k, v in (state.get("lr_schedule") or {}).items() if k != "step"}
            now_lr = {k: getattr(self.cfg.train, k) for k in _LR_FIELDS}
            if saved_lr != now_lr:
                log.warning("%s has LR schedule %s, this job uses %s", where, saved_lr, now_lr)
        try:
            restore_rng(state.get("rng"))
        except ValueError as e:
            log.warning("%s: RNG state not restored (%s); training continues with fresh RNG", where, e)

    def save_checkpoint(self, *, blocking: bool = True) -> None:
        """Checkpoint the current step (collective). Non-blocking returns after staging; a second save of
        the same step only waits for the first."""
        self.start_checkpoints()
        if self.checkpointer is None:
            raise CheckpointError("checkpoints are disabled: set checkpoint.dir or give the trainer a run_dir")
        if self.checkpointer.last_saved_step == self.step:
            if blocking:
                self.checkpointer.flush()
            return
        # The loop changes weights and AdamW state only in optimizer.step(): the staging copy of an async
        # save can overlap the next forward/backward, and that step waits for it.
        self.checkpointer.save(self.step, self.model, self.optimizer, state=self.checkpoint_state(),
                               blocking=blocking, overlap_staging=True)

    def flush_checkpoint(self) -> None:
        """Wait until the checkpoint in flight is committed (e.g. before a planned resize)."""
        if self.checkpointer is not None:
            self.checkpointer.flush()

    def close(self, *, timeout_s: float = 60.0) -> bool:
        """Before the process group goes away: let a save in flight commit (bounded wait, since its
        peers may be dead after a failure; a failed or abandoned save is logged, never raised). Returns
        False if a save was abandoned still running."""
        self.reporter.close()
        return self.checkpointer.close(timeout_s=timeout_s) if self.checkpointer is not None else True

    # -- one optimizer step ------------------------------------------------------------------------
    def _loss_ctx(self):
        return loss_parallel() if self.layout.tp_enabled else contextlib.nullcontext()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host batch to the device; on CUDA through pinned memory, so the copy is asynchronous."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _forward_backward(self, batch: Batch, *, backward: bool = True) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's samples (`backward`); return the summed
        per-microbatch mean losses on ranks that compute the loss (zero elsewhere)."""
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:
            x, y = batch.stacked()
            x, y = self._to_device(x), self._to_device(y)
            losses: list[torch.Tensor] = []
            run = self.schedule.step if backward else self.schedule.eval
            with self._loss_ctx():
                if self.is_first_stage:
                    run(x, target=y if self.is_last_stage else None, losses=losses)
                elif self.is_last_stage:
                    run(target=y, losses=losses)
                else:
                    run()
            if backward:
                sync_tied_grads(self.model, self.tied_group)
            for loss in losses:
                total += _scalar(loss).detach().float()
            return total
        n = len(batch.inputs)
        for i, (x, y) in enumerate(zip(batch.inputs, batch.targets)):
            if backward:
                set_grad_sync(self.model, i == n - 1)
            with self._loss_ctx():
                loss = self.loss_fn(self.model(self._to_device(x)), self._to_device(y))
                if backward:
                    (loss / n).backward()
            total += _scalar(loss).detach().float()
        return total

    def _global_mean(self, loss_sum: torch.Tensor) -> float:
        """Mean loss over the global batch: every loss-computing rank holds the mean over its samples;
        there are dp x tp of them (TP ranks hold the same value), the other stages contribute zero."""
        loss = loss_sum / self.n_microbatches
        dist.all_reduce(loss)
        return loss.item() / (self.layout.dp * self.layout.tp)

    def evaluate(self) -> float:
        """Mean loss over train.eval_batches global batches of the held-out split (collective): the same
        samples in the same order every time and under every layout, since the loader restarts at 0."""
        n = self.cfg.train.eval_batches
        self.val_loader.load_state_dict({"consumed_samples": 0, "seed": self.cfg.train.seed})
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for _ in range(n):
                total += self._forward_backward(self.val_loader.next_batch(), backward=False)
        reshard_after_eval(self.model)
        return self._global_mean(total / n)

    def train_step(self) -> StepMetrics:
        t0, t = time.perf_counter(), self.cfg.train
        self._phase_t = t0
        lr = lr_at(self.step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._before_update = self.loader.state_dict()  # where the data was, while weights are unchanged
        batch = self.loader.next_batch()
        if self.on_batch is not None:
            self.on_batch(batch)
        self._phase_done("data")
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = self._forward_backward(batch)
        self._phase_done("forward+backward")
        pp_group = self.mesh[MeshAxis.PP.value].get_group() if self.layout.pp_enabled else None
        grad_norm = clip_grad_norm_(self.params, self.cfg.train.grad_clip, pp_group=pp_group,
                                    optimizer=self.optimizer, uncounted=self.tied_copy)
        self._phase_done("grad clip")
        self._before_update = None
        self._mid_step = True  # weights updated; this step's loss and metrics are not out yet
        self.optimizer.step()
        self.step += 1
        self._phase_done("optimizer")

        loss = self._global_mean(loss_sum)
        self._phase_done("loss all_reduce")
        dt = time.perf_counter() - t0
        val_loss = self.evaluate() if self.val_loader is not None and self.step % t.eval_interval == 0 else None
        tokens_step = t.global_batch_size * self.cfg.data.seq_len
        tokens_per_s = tokens_step / dt if dt > 0 else 0.0
        m = StepMetrics(
            step=self.step, loss=loss, lr=lr, grad_norm=float(grad_norm), tokens=self.loader.position.consumed_samples * self.cfg.data.seq_len,
            layout=self.layout, world_size=self.layout.world_size, time=time.time(), step_time=dt,
            tokens_per_s=tokens_per_s,
            mfu=mfu(tokens_per_s, self.flops_per_token, self.layout.world_size, self.peak_flops), val_loss=val_loss,
        )
        self.reporter.write(m)
        # Periodic saves live here rather than in fit() so that callers driving train_step() themselves
        # (the Ray worker actor) get them too.
        self._mid_step = False
        self.last_metrics = m  # out even if the periodic save below fails (a salvage reports it)
        ckpt = self.cfg.checkpoint
        if (self.checkpointer is not None or self._checkpoints_due) and self.step % ckpt.interval_steps == 0:
            self.save_checkpoint(blocking=not ckpt.async_save)
        return m

    def _phase_done(self, name: str) -> None:
        """Add the time since the last phase ended to `phase_times[name]`, when timing."""
        if self.phase_times is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phase_times[name] = self.phase_times.get(name, 0.0) + now - self._phase_t
        self._phase_t = now

    def salvage_state(self) -> dict | None:
        """After a failure interrupted training (a peer died): the JSON state that goes with this rank's
        weights, for healing from peers; None if they cannot be trusted. A step that failed before the
        optimizer update leaves the weights at `self.step`, only the data position moved: it is put
        back. One that failed after the update, before its loss was out, is not salvaged (the
        coordinator never saw that step)."""
        if self._mid_step:
            return None
        if self._before_update is not None:
            self.loader.load_state_dict(self._before_update)
            self._before_update = None
        return self.checkpoint_state()

    def fit(self, total_steps: int, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Train until `total_steps` optimizer steps have been taken in the whole run; `train_step` saves
        every checkpoint.interval_steps (async if configured) and fit saves once more, committed, at the end."""
        out = []
        while self.step < total_steps:
            m = self.train_step()
            out.append(m)
            if on_step is not None:
                on_step(m)
        if self.checkpointer is not None or self._checkpoints_due:
            self.save_checkpoint(blocking=True)
        return out
