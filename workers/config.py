"""The job config: one YAML file with sections model, data, train, parallel, checkpoint, resources.

Each section is a small frozen dataclass; `JobConfig.from_dict` (the strict converter in workers.strict)
rejects unknown keys and wrong types with a message naming the field (e.g. ``train.steps: expected an
integer, got 'ten'``), and each section's `__post_init__` the values that cannot work. A spec is parsed once,
where it enters (the REST API: service.server.specs.validate_spec; a YAML file: load_config), and the JobConfig
itself is what travels to the coordinator and the workers. Constructing one touches no disk: whether
data.path is there is `check_data_path`, called where the path is read (and early at the edges).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from models.config import PRESETS, ModelConfig, model_config
from parallel.layout import Layout
from parallel.planner import Constraints, Plan, PlanError, plan
from workers.strict import ConfigError, build


DEFAULT_SEQ_LEN = 128
"""data.seq_len when the config names none and the model's context is longer: small enough that a default
run on a laptop stays cheap whatever context the model was made for."""


def _positive(section: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is None:
            continue
        if v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{section}.{n} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}", loc=(section, n))


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSection:
    preset: str = "tiny"
    """Name of a preset in models.config.PRESETS (tiny, small, 125m, 1b, 8b)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields to change from the preset, e.g. {n_layers: 3}."""
    init_from: str | None = None
    """A local Hugging Face Llama directory to start from: its config.json fixes the shape (preset is
    ignored, overrides may set only max_seq_len); a fresh run loads its weights, a resumed one its own
    checkpoint. Read where the job enters (`resolve_init_from`), never by this constructor."""
    resolved: ModelConfig | None = None
    """The shape `resolve_init_from` read from init_from's config.json (it replaces whatever was given)."""

    def __post_init__(self) -> None:
        if self.init_from is not None:
            if not self.init_from.strip() or "\x00" in self.init_from:
                raise ConfigError(f"model.init_from {self.init_from!r} must be a non-blank path without NUL bytes",
                                  loc=('model', 'init_from'))
            if bad := sorted(set(self.overrides) - {"max_seq_len"}):
                raise ConfigError(f"model.overrides {bad} cannot change a model started from model.init_from "
                                  "(its config.json fixes the shape); only max_seq_len may be overridden",
                                  loc=('model', 'overrides'))
        elif self.resolved is not None:
            raise ConfigError("model.resolved is read from model.init_from's config.json; set init_from instead",
                              loc=('model', 'resolved'))
        try:
            self.build() if self.is_resolved else None
        except ValueError as e:  # an unknown preset, or overrides the model cannot take
            where = ("model", "preset") if self.init_from is None and self.preset not in PRESETS else ("model", "overrides")
            raise ConfigError(f"model: {e}", loc=where) from None

    @property
    def is_resolved(self) -> bool:
        """Whether the model's shape is known (always, unless init_from has not been read yet)."""
        return self.init_from is None or self.resolved is not None

    def build(self) -> ModelConfig:
        if self.init_from is None:
            return model_config(self.preset, **self.overrides)
        if self.resolved is None:
            raise ConfigError(f"model.init_from {self.init_from!r} has not been read: the job's edge calls "
                              "workers.disk_checks.resolve_init_from before the model is built",
                              loc=('model', 'init_from'))
        return dataclasses.replace(self.resolved, **self.overrides)


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig:
    source: Literal["corpus", "synthetic", "tokens"] = "corpus"
    """corpus: byte-level text from a directory; synthetic: seeded random tokens; tokens: a uint16/uint32
    token file (nanoGPT-style memmap)."""
    path: str | None = None
    """Directory of text files (corpus; default: the Python standard library source) or token file."""
    seq_len: int | None = None
    """Tokens per sample (the model sees seq_len inputs and predicts seq_len targets); at most the model's
    max_seq_len. None: the model's context capped at DEFAULT_SEQ_LEN (and at its sliding_window), filled
    in by JobConfig once the model's shape is known, so a resolved JobConfig always holds a number."""
    max_bytes: int = 4_000_000
    """Corpus: read at most this many bytes of text (files in sorted order)."""
    suffixes: list[str] = field(default_factory=lambda: [".py"])
    """Corpus: file name endings to include."""
    token_dtype: Literal["uint16", "uint32"] | None = None
    """Tokens: element type of the token file; None: what `elastron data prepare`'s meta.json beside it
    says, else uint16."""
    num_samples: int = 100_000
    """Synthetic: number of distinct samples before the order repeats."""
    val_path: str | None = None
    """Held-out split for train.eval_interval: a token file (tokens) or a directory of text (corpus).
    Default for tokens: the val.bin `elastron data prepare` wrote beside data.path; synthetic: samples of
    another seed."""
    allow_tokenizer_mismatch: bool = False
    """Tokens: train although meta.json's tokenizer is not model.init_from's own tokenizer.json."""

    def __post_init__(self) -> None:
        _positive("data", self, "seq_len", "max_bytes", "num_samples")
        if self.source == "tokens" and not self.path:
            raise ConfigError("data.path is required when data.source is 'tokens'", loc=('data', 'path'))
        if self.val_path is not None and self.source == "synthetic":
            raise ConfigError("data.val_path means nothing for source 'synthetic' (its held-out samples are seeded)",
                              loc=('data', 'val_path'))


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps of the whole run (also the LR schedule's horizon unless decay_steps is set). A
    `--steps` given on the command line replaces it (`with_steps`): it is the schedule's length too."""
    global_batch_size: int = 16
    """Samples per optimizer step, fixed under every layout."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one DP rank; gradient accumulation covers the rest."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak (cosine/linear schedules)."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over this many steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    decay_steps: int | None = None
    """Step at which decay ends; default `steps` (so `--steps` moves it too). Set it to keep the schedule
    fixed while a resumed run is given more or fewer steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused_optimizer: bool | None = None
    """AdamW's fused kernel (`fused=True`) instead of the foreach one. None: fused, on CUDA and CPU: one
    kernel per parameter group instead of several passes over parameters and state, and with DTensor
    parameters one sharding propagation instead of one per foreach op, which a fresh trainer pays in
    full on its first step (1.2 s of the first step after every re-form of a 1 GB job on CPU). Both work
    with DTensor parameters; they differ in the last bits of the update."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    seed: int = 0
    """Seeds initial weights, data order and dropout-free RNG state."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype. bfloat16: bf16 weights (cast at use, or by FSDP2 as it gathers them) and activations
    in forward and backward; fp32 master weights, optimizer state, gradient reduction and loss, with the
    same arithmetic under every layout. See parallel/precision.py."""
    compile: bool = False
    """Compile each transformer block with torch.compile (inductor). Needs a C++ compiler on CPU and
    Triton on CUDA; the first step is slow while kernels compile (they are cached on disk)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward, per transformer block, to save memory: none; full (keep only
    each block's input); selective (keep matmul, attention and TP-collective outputs, recompute norms,
    RoPE and pointwise ops). Results are unchanged; parameter names (and checkpoints) too."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """float8 matmuls in the transformer blocks' linear layers (torchao, `parallel.float8`): none;
    tensorwise (one scale per tensor, float8 all-gather under FSDP2); rowwise (one scale per row, more
    accurate, slower). The output head stays in high precision; weights, optimizer state and checkpoints
    stay fp32, so a run resumes or reshards with it switched on or off. Needs torchao and, on CUDA,
    train.dtype bfloat16 on an H100-class GPU (compute capability 8.9+); emulated on CPU."""
    eval_interval: int = 0
    """Every this many steps, the loss on the held-out split (data.val_path) goes into the metrics as
    val_loss; 0: never."""
    eval_batches: int = 4
    """Global batches of the held-out split per evaluation (the same samples every time)."""

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "global_batch_size", "micro_batch_size", "lr", "decay_steps",
                  "eval_batches")
        _positive("train", self, "eval_interval", allow_zero=True)
        _positive("train", self, "warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio", "eps",
                  allow_zero=True)
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} must be a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}", loc=("train", "global_batch_size"))
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ConfigError(f"train.beta1/beta2 must be in [0, 1), got {self.beta1}, {self.beta2}",
                              loc=('train', 'beta1'))
        if self.min_lr_ratio > 1:
            raise ConfigError(f"train.min_lr_ratio must be <= 1, got {self.min_lr_ratio}",
                              loc=('train', 'min_lr_ratio'))
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise ConfigError("train.activation_checkpointing must be one of none, full, selective, "
                              f"got {self.activation_checkpointing!r}", loc=('train', 'activation_checkpointing'))
        if self.float8 not in ("none", "tensorwise", "rowwise"):
            raise ConfigError(f"train.float8 must be one of none, tensorwise, rowwise, got {self.float8!r}",
                              loc=('train', 'float8'))


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelConfig:
    min_workers: int = 1
    """Fewest workers the job may run on; below this it waits for capacity."""
    max_workers: int = 4
    """Most workers the job will use."""
    layout: str | None = None
    """Force a layout, e.g. "dp=2,tp=2,pp=1"; otherwise the planner chooses per world size."""
    dp_mode: Literal["auto", "shard", "replicate"] = "auto"
    """How planned layouts spend data parallelism: FSDP2 sharding (shard), replication (replicate), or
    auto: replicate where the replicas fit (a memory_budget_gb that holds them; without one, on CPU
    only), shard otherwise (`parallel.planner.replicate_fits`). In a written layout dp=N means
    dp_shard=N unless this is replicate."""
    tp: int | None = None
    """Force this TP degree in planned layouts."""
    pp: int | None = None
    """Force this PP degree in planned layouts."""
    max_tp: int | None = None
    """Upper bound on TP degree (default: GPUs per node)."""
    max_pp: int | None = None
    """Upper bound on PP degree (default: number of layers)."""
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule when pp > 1."""
    sequence_parallel: bool = False
    """Shard norms/activations along the sequence between TP regions."""
    gpus_per_node: int | None = None
    """Workers per node; TP groups never span nodes. Default: no limit (CPU)."""
    memory_budget_gb: float | None = None
    """Per-device memory budget for the planner; default: unlimited on CPU, the GPU's memory on CUDA."""
    reshard: Literal["live", "storage"] = "live"
    """How state moves on a planned resize, a growth or a preemption notice: live (from the workers of the
    old layout to those of the new one over the network, then a durable checkpoint in the background) or
    storage (a blocking checkpoint, then every new rank loads it)."""

    def __post_init__(self) -> None:
        _positive("parallel", self, "min_workers", "max_workers", "tp", "pp", "max_tp", "max_pp",
                  "gpus_per_node", "memory_budget_gb")
        if self.dp_mode not in ("auto", "shard", "replicate"):
            raise ConfigError(f"parallel.dp_mode must be one of auto, shard, replicate, got {self.dp_mode!r}",
                              loc=('parallel', 'dp_mode'))
        if self.reshard not in ("live", "storage"):
            raise ConfigError(f"parallel.reshard must be live or storage, got {self.reshard!r}",
                              loc=('parallel', 'reshard'))
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"parallel.min_workers={self.min_workers} is greater than parallel.max_workers={self.max_workers}",
                loc=("parallel", "min_workers"))
        if self.layout is not None:
            try:
                Layout.parse(self.layout, dp_mode=self.dp_mode)
            except ValueError as e:
                raise ConfigError(f"parallel.layout: {e}", loc=('parallel', 'layout')) from None


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig:
    interval_steps: int = 50
    """Save every this many steps (plus a final save)."""
    keep_last: int = 3
    """Committed checkpoints to keep; the newest is never deleted."""
    dir: str | None = None
    """Where checkpoints go (path or fsspec URL); default RUN_DIR/checkpoints."""
    async_save: bool = True
    """Write in the background; the loop blocks only while state is staged."""
    peer_interval: int = 1
    """Every this many steps each rank keeps a snapshot of its shards in its host memory and in a buddy
    rank's on another node (workers.snapshots), so that a rank lost without notice is served from memory
    and only the steps since that snapshot are redone; 0: off. Never written to disk: the durable
    checkpoints above stay, for the loss of the whole cluster."""
    peer_budget: float = 0.1
    """The share of training time peer snapshots may cost: where one costs more than this (its copy,
    and the steps its background send slows), they are taken less often than every `peer_interval`
    steps, as measured while training (workers.pace), and a kill redoes up to that many steps less one.
    0: exactly every `peer_interval` steps."""
    checksum: Literal["xxh3-128", "blake3", "sha256", "none"] = "xxh3-128"
    """Checksum of every written block, verified as it is read back: xxh3-128 (fast), blake3
    (cryptographic), sha256, or none (scratch runs only: corruption then goes unnoticed)."""
    io_threads: int = 2
    """Files each rank writes, and reads, in parallel."""
    resume_from: str | None = None
    """Start from the checkpoints under this directory even though another job or another model config
    wrote them (without it such a checkpoint is refused). Read only, and only while this job has no
    checkpoint of its own; naming this job's own checkpoint directory only waives the check."""

    def __post_init__(self) -> None:
        _positive("checkpoint", self, "interval_steps", "keep_last", "io_threads")
        _positive("checkpoint", self, "peer_interval", "peer_budget", allow_zero=True)
        if self.peer_budget > 1:
            raise ConfigError(f"checkpoint.peer_budget must be <= 1 (a share of training time), got {self.peer_budget}",
                              loc=('checkpoint', 'peer_budget'))
        if self.resume_from is not None and (not isinstance(self.resume_from, str) or not self.resume_from.strip()):
            raise ConfigError(f"checkpoint.resume_from must be a directory path, got {self.resume_from!r}",
                              loc=('checkpoint', 'resume_from'))


@dataclass(kw_only=True, slots=True, frozen=True)
class ResourcesConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device per worker; auto picks cuda when available."""
    cpus_per_worker: int = 1
    """CPUs reserved per worker actor."""
    gpus_per_worker: int | None = None
    """GPUs per worker actor; None: 1 with device: cuda, else 0. So `device` is the one switch between a
    CPU machine (auto or cpu) and a GPU cluster (cuda)."""
    standby_per_node: int = 1
    """Idle worker processes kept started on each node hosting the job's workers, reserving nothing
    (~300 MB of memory each): a worker that crashes is replaced by one without a process start (~2.5 s
    on CPU). Besides these, one node the job may use and does not keeps as many as the busiest node has
    members, so that a node lost without notice is replaced the same way
    (`service.pool.reserve.standby_targets`). CPU workers only (a GPU is given to a process when it
    starts); 0: none, anywhere."""

    def __post_init__(self) -> None:
        if self.gpus_per_worker is None:
            object.__setattr__(self, "gpus_per_worker", 1 if self.device == "cuda" else 0)
        _positive("resources", self, "cpus_per_worker")
        _positive("resources", self, "gpus_per_worker", allow_zero=True)
        _positive("resources", self, "standby_per_node", allow_zero=True)


@dataclass(kw_only=True, slots=True, frozen=True)
class SchedulingConfig:
    priority: int = 0
    """On a shared cluster (the REST service): higher-priority jobs are admitted first, and shrink or pause
    lower-priority ones to get their workers."""
    weight: float = 1.0
    """Share of the spare workers among jobs of equal priority."""

    def __post_init__(self) -> None:
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or not 0 < self.weight < 1e6:
            raise ConfigError(f"scheduling.weight must be a number > 0 and < 1e6, got {self.weight!r}",
                              loc=('scheduling', 'weight'))
        if not -1_000_000 <= self.priority <= 1_000_000:
            raise ConfigError(f"scheduling.priority must be between -1000000 and 1000000, got {self.priority}",
                              loc=('scheduling', 'priority'))


@dataclass(kw_only=True, slots=True, frozen=True)
class WandbConfig:
    project: str = "elastron"
    """W&B project of the run."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online: sync as it runs; offline: write under RUN_DIR/wandb only (`wandb sync` later)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    """TensorBoard event files in RUN_DIR/tensorboard: loss, val_loss, LR, grad norm, tokens/s, MFU and
    every reconfiguration (workers.sinks)."""
    wandb: WandbConfig | None = None
    """The same to Weights & Biases (needs the wandb package); none: off."""


@dataclass(kw_only=True, slots=True, frozen=True)
class JobConfig:
    name: str = "job"
    """A label for the job."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)

    def __post_init__(self) -> None:
        if self.train.eval_interval and self.data.source == "corpus" and self.data.val_path is None:
            raise ConfigError("train.eval_interval needs a held-out split: set data.val_path to a directory of text",
                              loc=('train', 'eval_interval'))
        if not self.model.is_resolved:
            return  # judged by resolve_init_from, which builds this config again with the model's shape
        mc = self.model.build()
        if self.data.seq_len is None:  # the model's context, capped: every reader downstream sees a number
            fits = min(DEFAULT_SEQ_LEN, mc.max_seq_len, mc.sliding_window or mc.max_seq_len)
            object.__setattr__(self, "data", dataclasses.replace(self.data, seq_len=fits))
        if self.data.seq_len > mc.max_seq_len:
            raise ConfigError(f"data.seq_len={self.data.seq_len} exceeds model max_seq_len={mc.max_seq_len}: "
                              f"set data.seq_len <= {mc.max_seq_len}, or leave it out to take "
                              f"min({DEFAULT_SEQ_LEN}, max_seq_len)", loc=('data', 'seq_len'))
        if mc.sliding_window is not None and self.data.seq_len > mc.sliding_window:
            raise ConfigError(f"data.seq_len={self.data.seq_len} is longer than the model's sliding_window="
                              f"{mc.sliding_window}; sliding-window attention is not implemented (within the "
                              f"window it equals causal attention): set data.seq_len <= {mc.sliding_window}",
                              loc=('data', 'seq_len'))
        if self.data.source == "corpus" and mc.vocab_size < 256:
            raise ConfigError(f"byte-level corpus needs model vocab_size >= 256, got {mc.vocab_size}",
                              loc=("model", "overrides", "vocab_size"))
        if self.parallel.layout is not None:
            c = job_constraints(self)
            try:
                plan(c.layout.world_size, mc, c)
            except PlanError as e:
                raise ConfigError(f"parallel.layout {self.parallel.layout!r}: {e}",
                                  loc=('parallel', 'layout')) from None

    @classmethod
    def from_dict(cls, d: Any) -> "JobConfig":
        return build(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Stable hash of the config (stored in checkpoints)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def job_device_type(cfg: JobConfig) -> str:
    """Where the job's workers compute, as far as the config says: cuda when it asks for cuda or gives
    workers GPUs; cpu otherwise (device auto on workers without GPUs picks the CPU)."""
    r = cfg.resources
    return "cuda" if r.device == "cuda" or (r.device == "auto" and r.gpus_per_worker > 0) else "cpu"


def job_constraints(cfg: JobConfig, *, layout: str | Layout | None = None, device_type: str | None = None,
                    **overrides: Any) -> Constraints:
    """What the planner must respect for `cfg`: the one place a job config becomes planner input.
    `layout` (text or a Layout) replaces parallel.layout; a forced layout fixes tp and pp, so the
    config's tp/pp do not go with it. `device_type` is the device the ranks run on where the caller
    knows it (torchrun), else `job_device_type(cfg)`. `overrides` replace Constraints fields."""
    if cfg.data.seq_len is None:  # a default seq_len waits for the model's shape
        raise ConfigError(f"model.init_from {cfg.model.init_from!r} has not been read, so data.seq_len's default "
                          "is unknown: the job's edge calls workers.disk_checks.resolve_init_from first",
                          loc=('data', 'seq_len'))
    pc = cfg.parallel
    text = layout or pc.layout
    forced = Layout.parse(text, dp_mode=pc.dp_mode) if isinstance(text, str) else text
    kw: dict[str, Any] = dict(
        global_batch_size=cfg.train.global_batch_size, micro_batch_size=cfg.train.micro_batch_size,
        seq_len=cfg.data.seq_len, dp_mode=pc.dp_mode, device_type=device_type or job_device_type(cfg),
        layout=forced, tp=None if forced else pc.tp,
        pp=None if forced else pc.pp, max_tp=pc.max_tp, max_pp=pc.max_pp, gpus_per_node=pc.gpus_per_node,
        memory_budget_bytes=pc.memory_budget_gb * 2**30 if pc.memory_budget_gb else None,
        min_workers=pc.min_workers, max_workers=pc.max_workers)
    return Constraints(**{**kw, **overrides})


def job_plan(cfg: JobConfig, world_size: int, *, layout: str | Layout | None = None,
             device_type: str | None = None) -> Plan:
    """The plan for exactly `world_size` ranks (torchrun, a test, a benchmark): `layout`, else the
    config's parallel.layout, else the planner's choice. ValueError, in one line, when none uses them all."""
    c = job_constraints(cfg, layout=layout, device_type=device_type)
    if c.layout is not None:
        c.layout.check_world_size(world_size)
    else:
        c = dataclasses.replace(c, max_workers=world_size)
    try:
        p = plan(world_size, cfg.model.build(), c)
    except PlanError as e:
        if c.layout is None:
            raise
        raise PlanError(f"layout {c.layout}: {e}") from None
    if p.world_size != world_size:
        raise ValueError(f"cannot use all {world_size} ranks: {'; '.join(p.reasons)}; pass --layout")
    return p


def load_config(path: str | Path) -> JobConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {str(p)!r}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config {str(p)!r} is not valid YAML: {e}") from None
    return JobConfig.from_dict(data or {})


def with_steps(cfg: JobConfig, steps: int | None) -> JobConfig:
    """`cfg` run for `steps` optimizer steps (None: train.steps as configured). `--steps` means the run's
    length and the LR schedule's: train.steps is replaced, so the decay ends at the last step unless
    train.decay_steps says otherwise. ConfigError for a count below 1."""
    if steps is None:
        return cfg
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
