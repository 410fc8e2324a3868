"""The job config: one YAML file with sections model, data, train, parallel, checkpoint, resources.

This module is the one description of a job spec. Each section is a small frozen dataclass, made a pydantic
dataclass so that every field carries its type and its bounds beside it (every number has a maximum,
every string and list a maximum length): the YAML loader (`load_config`, `JobConfig.from_dict`), the REST
API (its request body and service.server.specs.validate_spec) and /openapi.json all read this one schema.
Parsing is strict (no coercion: "10" is not an integer, 1 is not true) and refuses unknown keys; an error is
a ConfigError in one line naming the field (``train.steps: expected an integer, got 'ten' (str)``). The
rules between fields (tp divides the heads, min_workers <= max_workers, ...) are validators of the same
sections. Building a section directly (`TrainConfig(steps=0)`, `dataclasses.replace`) checks the same.

A spec is parsed once, where it enters (the REST API, a YAML file), and the JobConfig itself is what
travels to the coordinator and the workers (pickled by Ray, as a dataclass; `to_dict` and `digest` are
the dataclass fields as JSON). Constructing one touches no disk: whether data.path is there is
`check_data_path`, called where the path is read (and early at the edges).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Field, PlainValidator, TypeAdapter, ValidationError, model_validator
from pydantic import dataclasses as pydantic_dataclasses
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from models.config import PRESETS, ModelConfig, model_config
from parallel.layout import Layout
from parallel.planner import Constraints, Plan, PlanError, plan
from workers.strict import ConfigError, config_error

__all__ = ["CheckpointConfig", "ConfigError", "DataConfig", "JobConfig", "LOCATION", "LoggingConfig",
           "MAX_GLOBAL_BATCH", "MAX_LIST", "MAX_NAME", "MAX_PATH", "MAX_STEPS", "MAX_WORKERS", "ModelOverrides",
           "ModelSection", "ParallelConfig", "ResourcesConfig", "SchedulingConfig", "TrainConfig", "WandbConfig",
           "job_constraints", "job_device_type", "job_plan", "load_config", "spec_maxima", "spec_schema", "with_steps"]


DEFAULT_SEQ_LEN = 128
"""data.seq_len when the config names none and the model's context is longer: small enough that a default
run on a laptop stays cheap whatever context the model was made for."""

# -- the bounds shared by several fields -----------------------------------------------------------------------
# Generous for real jobs (an 8B Llama is far inside every one) and small enough that validation, the
# planner (whose work grows with the worker count, the divisors of the global batch and the pipeline depth)
# and a worker's allocations stay bounded.

MAX_WORKERS = 100_000
"""Largest worker count (or parallel degree) a spec may name."""
MAX_GLOBAL_BATCH = 1 << 24
"""Largest global (or micro) batch: the planner walks the batch's divisors."""
MAX_STEPS = 10**12
"""Largest step count (or step interval)."""
MAX_LIST = 64
"""Longest list a spec field may hold (data.suffixes)."""
MAX_PATH = 4096
"""Longest path or URL (Linux's PATH_MAX): refused before anything resolves or compares it."""
MAX_NAME = 128
"""Longest name or label (the job's name, a W&B project)."""
MAX_SAMPLES = 1 << 26
"""Most synthetic samples: a worker holds a permutation of them (8 bytes each, 512 MiB at the bound)."""
LOCATION = {"x-elastron-location": True}
"""JSON-schema mark of a field that names a place (a path or a URL): each is judged by the server's one
location table, service.server.admission.LOCATION_FIELDS (tests/api/test_spec_schema.py checks both ways)."""

_PARSING = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
"""How every section parses: unknown keys and non-finite numbers refused, each field's docstring its
description in the schema. Strictness is per field (`Field(strict=True)`): a strict dataclass would also
refuse a section given as a mapping."""


def _section(*where: str):
    """A frozen, slotted, keyword-only pydantic dataclass whose construction raises ConfigError (naming
    the field by its path in the spec, `where` + the field) instead of pydantic's ValidationError, so that
    building a section in Python and parsing one from a spec fail alike."""
    def make(cls: type) -> type:
        cls = pydantic_dataclasses.dataclass(kw_only=True, slots=True, frozen=True, config=_PARSING)(cls)
        validate = cls.__init__

        @functools.wraps(validate)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                validate(self, *args, **kwargs)
            except ValidationError as e:
                raise config_error(e, root=cls, prefix=where) from None

        cls.__init__ = __init__
        return cls
    return make


def _positive_int(hi: int) -> Any:
    return Annotated[int, Field(strict=True, gt=0, le=hi)]


def _count(hi: int) -> Any:
    """An integer from 0 to `hi`."""
    return Annotated[int, Field(strict=True, ge=0, le=hi)]


Bool = Annotated[bool, Field(strict=True)]
Location = Annotated[str, Field(strict=True, max_length=MAX_PATH, json_schema_extra=LOCATION)]
"""A path or URL: bounded here, judged (where it may lie) by service.server.admission."""


def _rope_value(v: Any) -> int | float | str:
    """A value of model.overrides.rope_scaling: a number within +-1e12 (an int stays an int), or a name."""
    if isinstance(v, str):
        if len(v) > 64:
            raise ValueError(f"a name here has at most 64 characters, got {len(v)}")
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= 1e12:  # NaN fails the comparison
        return v
    raise ValueError(f"expected a finite number within +-1e12 or a name, got {type(v).__name__}")


RopeValue = Annotated[Any, PlainValidator(_rope_value, json_schema_input_type=Annotated[float, Field(ge=-1e12, le=1e12)]
                                          | Annotated[str, Field(max_length=64)])]


class ModelOverrides(TypedDict, total=False):
    """ModelConfig fields to change from the preset (models.config.ModelConfig documents each), with the
    bounds a spec may give them."""

    __pydantic_config__ = _PARSING  # type: ignore[misc]

    dim: _positive_int(1 << 16)
    """Hidden size."""
    n_layers: _positive_int(1024)
    """Number of transformer blocks."""
    n_heads: _positive_int(1024)
    """Attention (query) heads."""
    n_kv_heads: _positive_int(1024)
    """Key/value heads; must divide n_heads."""
    vocab_size: _positive_int(1 << 22)
    """Embedding and output rows."""
    ffn_hidden: _positive_int(1 << 18)
    """Hidden size of the SwiGLU MLP."""
    max_seq_len: _positive_int(1 << 20)
    """Longest sequence the RoPE table covers."""
    norm_eps: Annotated[float, Field(strict=True, ge=1e-12, le=1.0)]
    """RMSNorm epsilon."""
    rope_theta: Annotated[float, Field(strict=True, ge=1.0, le=1e12)]
    """RoPE base frequency."""
    init_std: Annotated[float, Field(strict=True, ge=1e-8, le=10.0)]
    """Standard deviation of the initial weights."""
    head_size: Annotated[int | None, Field(strict=True, ge=2, le=1 << 14)]
    """Size of one attention head; null: dim // n_heads."""
    rope_scaling: Annotated[dict[Annotated[str, Field(strict=True, max_length=64)], RopeValue] | None,
                            Field(max_length=16)]
    """RoPE frequency scaling as transformers names it ({"rope_type": "llama3", "factor": 8.0, ...}); null:
    plain RoPE."""
    tie_embeddings: Bool
    """The output projection is the embedding table."""
    qkv_bias: Bool
    """Biases on the q, k and v projections."""
    out_bias: Bool
    """A bias on the attention output projection."""
    qk_norm: Bool
    """RMSNorm over each head of q and k before RoPE."""
    sliding_window: Annotated[int | None, Field(strict=True, gt=0, le=1 << 20)]
    """Sliding-window attention span; null: none."""
    family: Literal["llama", "mistral", "qwen2", "qwen3"]
    """The Hugging Face model_type the model is exported as."""
    emulate_s_per_sample: Annotated[float, Field(strict=True, ge=0.0, le=3600.0)]
    """Emulated accelerator time per sample (models.emulation): each micro-batch waits this times its samples,
    a third in forward and two thirds in backward; 0: none. For benchmarks on CPUs."""


class ModelShape(ModelOverrides):
    """A whole model shape as JSON (model.resolved in `JobConfig.to_dict`): the ModelConfig fields, each
    within its override's bounds; dim, n_layers, n_heads, n_kv_heads, vocab_size and ffn_hidden required."""


_SHAPE = TypeAdapter(ModelShape)


def _shape(v: Any) -> ModelConfig | None:
    """model.resolved: a ModelConfig, or its fields as a mapping (validated with the overrides' bounds)."""
    if v is None or isinstance(v, ModelConfig):
        return v
    given = _SHAPE.validate_python(v)
    if missing := [f.name for f in dataclasses.fields(ModelConfig)
                   if f.name not in given and f.default is dataclasses.MISSING]:
        raise ValueError(f"a model shape needs {', '.join(missing)}")
    return ModelConfig(**given)


@_section("model")
class ModelSection:
    preset: Annotated[str, Field(strict=True, max_length=64)] = "tiny"
    """Name of a preset in models.config.PRESETS (tiny, small, 125m, 1b, 8b)."""
    overrides: ModelOverrides = field(default_factory=dict)
    """ModelConfig fields to change from the preset, e.g. {n_layers: 3}."""
    init_from: Location | None = None
    """A local Hugging Face Llama directory to start from: its config.json fixes the shape (preset is
    ignored, overrides may set only max_seq_len); a fresh run loads its weights, a resumed one its own
    checkpoint. Read where the job enters (`resolve_init_from`), never by this constructor."""
    resolved: Annotated[ModelConfig | None, PlainValidator(_shape, json_schema_input_type=ModelShape | None)] = None
    """The shape `resolve_init_from` read from init_from's config.json; it replaces whatever a spec gives
    (only `to_dict`'s output of a resolved config names it), so a spec has no reason to."""

    @model_validator(mode="after")
    def _rules(self) -> ModelSection:
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
        return self

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


@_section("data")
class DataConfig:
    source: Literal["corpus", "synthetic", "tokens"] = "corpus"
    """corpus: byte-level text from a directory; synthetic: seeded random tokens; tokens: a uint16/uint32
    token file (nanoGPT-style memmap)."""
    path: Location | None = None
    """Directory of text files (corpus; default: the Python standard library source) or token file."""
    seq_len: Annotated[int | None, Field(strict=True, gt=0, le=1 << 20)] = None
    """Tokens per sample (the model sees seq_len inputs and predicts seq_len targets); at most the model's
    max_seq_len. None: the model's context capped at DEFAULT_SEQ_LEN (and at its sliding_window), filled
    in by JobConfig once the model's shape is known, so a resolved JobConfig always holds a number."""
    max_bytes: _positive_int(1 << 40) = 4_000_000
    """Corpus: read at most this many bytes of text (files in sorted order)."""
    suffixes: Annotated[list[Annotated[str, Field(strict=True, max_length=64)]],
                        Field(max_length=MAX_LIST)] = field(default_factory=lambda: [".py"])
    """Corpus: file name endings to include."""
    token_dtype: Literal["uint16", "uint32"] | None = None
    """Tokens: element type of the token file; None: what `elastron data prepare`'s meta.json beside it
    says, else uint16."""
    num_samples: _positive_int(MAX_SAMPLES) = 100_000
    """Synthetic: number of distinct samples before the order repeats."""
    val_path: Location | None = None
    """Held-out split for train.eval_interval: a token file (tokens) or a directory of text (corpus).
    Default for tokens: the val.bin `elastron data prepare` wrote beside data.path; synthetic: samples of
    another seed."""
    allow_tokenizer_mismatch: Bool = False
    """Tokens: train although meta.json's tokenizer is not model.init_from's own tokenizer.json."""

    @model_validator(mode="after")
    def _rules(self) -> DataConfig:
        if self.source == "tokens" and not self.path:
            raise ConfigError("data.path is required when data.source is 'tokens'", loc=('data', 'path'))
        if self.val_path is not None and self.source == "synthetic":
            raise ConfigError("data.val_path means nothing for source 'synthetic' (its held-out samples are seeded)",
                              loc=('data', 'val_path'))
        return self


@_section("train")
class TrainConfig:
    steps: _positive_int(MAX_STEPS) = 100
    """Optimizer steps of the whole run (also the LR schedule's horizon unless decay_steps is set). A
    `--steps` given on the command line replaces it (`with_steps`): it is the schedule's length too."""
    global_batch_size: _positive_int(MAX_GLOBAL_BATCH) = 16
    """Samples per optimizer step, fixed under every layout."""
    micro_batch_size: _positive_int(MAX_GLOBAL_BATCH) = 4
    """Samples per forward/backward on one DP rank; gradient accumulation covers the rest."""
    lr: Annotated[float, Field(strict=True, gt=0, le=100.0)] = 3e-3
    """Peak learning rate."""
    min_lr_ratio: Annotated[float, Field(strict=True, ge=0, le=1)] = 0.1
    """Final LR as a fraction of the peak (cosine/linear schedules)."""
    warmup_steps: _count(MAX_STEPS) = 10
    """Linear warmup from 0 to lr over this many steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    decay_steps: Annotated[int | None, Field(strict=True, gt=0, le=MAX_STEPS)] = None
    """Step at which decay ends; default `steps` (so `--steps` moves it too). Set it to keep the schedule
    fixed while a resumed run is given more or fewer steps."""
    weight_decay: Annotated[float, Field(strict=True, ge=0, le=100.0)] = 0.1
    """AdamW decoupled weight decay."""
    beta1: Annotated[float, Field(strict=True, ge=0, lt=1)] = 0.9
    """AdamW beta1."""
    beta2: Annotated[float, Field(strict=True, ge=0, lt=1)] = 0.95
    """AdamW beta2."""
    eps: Annotated[float, Field(strict=True, ge=0, le=1.0)] = 1e-8
    """AdamW epsilon."""
    fused_optimizer: Bool | None = None
    """AdamW's fused kernel (`fused=True`) instead of the foreach one. None: fused, on CUDA and CPU: one
    kernel per parameter group instead of several passes over parameters and state, and with DTensor
    parameters one sharding propagation instead of one per foreach op, which a fresh trainer pays in
    full on its first step (1.2 s of the first step after every re-form of a 1 GB job on CPU). Both work
    with DTensor parameters; they differ in the last bits of the update."""
    grad_clip: Annotated[float, Field(strict=True, ge=0, le=1e6)] = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    seed: Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)] = 0
    """Seeds initial weights, data order and dropout-free RNG state."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype. bfloat16: bf16 weights (cast at use, or by FSDP2 as it gathers them) and activations
    in forward and backward; fp32 master weights, optimizer state, gradient reduction and loss, with the
    same arithmetic under every layout. See parallel/precision.py."""
    compile: Bool = False
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
    eval_interval: _count(MAX_STEPS) = 0
    """Every this many steps, the loss on the held-out split (data.val_path) goes into the metrics as
    val_loss; 0: never."""
    eval_batches: _positive_int(10_000) = 4
    """Global batches of the held-out split per evaluation (the same samples every time)."""

    @model_validator(mode="after")
    def _rules(self) -> TrainConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} must be a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}", loc=("train", "global_batch_size"))
        return self


@_section("parallel")
class ParallelConfig:
    min_workers: _positive_int(MAX_WORKERS) = 1
    """Fewest workers the job may run on; below this it waits for capacity."""
    max_workers: _positive_int(MAX_WORKERS) = 4
    """Most workers the job will use."""
    layout: Annotated[str | None, Field(strict=True, max_length=256)] = None
    """Force a layout, e.g. "dp=2,tp=2,pp=1"; otherwise the planner chooses per world size. Its world size
    is at most MAX_WORKERS."""
    dp_mode: Literal["auto", "shard", "replicate"] = "auto"
    """How planned layouts spend data parallelism: FSDP2 sharding (shard), replication (replicate), or
    auto: replicate where the replicas fit (a memory_budget_gb that holds them; without one, on CPU
    only), shard otherwise (`parallel.planner.replicate_fits`). In a written layout dp=N means
    dp_shard=N unless this is replicate."""
    tp: Annotated[int | None, Field(strict=True, gt=0, le=MAX_WORKERS)] = None
    """Force this TP degree in planned layouts."""
    pp: Annotated[int | None, Field(strict=True, gt=0, le=MAX_WORKERS)] = None
    """Force this PP degree in planned layouts."""
    max_tp: Annotated[int | None, Field(strict=True, gt=0, le=MAX_WORKERS)] = None
    """Upper bound on TP degree (default: GPUs per node)."""
    max_pp: Annotated[int | None, Field(strict=True, gt=0, le=MAX_WORKERS)] = None
    """Upper bound on PP degree (default: number of layers)."""
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule when pp > 1."""
    sequence_parallel: Bool = False
    """Shard norms/activations along the sequence between TP regions."""
    gpus_per_node: Annotated[int | None, Field(strict=True, gt=0, le=MAX_WORKERS)] = None
    """Workers per node; TP groups never span nodes. Default: no limit (CPU)."""
    memory_budget_gb: Annotated[float | None, Field(strict=True, gt=0, le=1 << 20)] = None
    """Per-device memory budget for the planner; default: unlimited on CPU, the GPU's memory on CUDA."""
    reshard: Literal["live", "storage"] = "live"
    """How state moves on a planned resize, a growth or a preemption notice: live (from the workers of the
    old layout to those of the new one over the network, then a durable checkpoint in the background) or
    storage (a blocking checkpoint, then every new rank loads it)."""
    drain_margin: Annotated[float, Field(strict=True, ge=0, le=100)] = 1.5
    """A drain notice with a deadline: the group trains on with the noticed node until the deadline less a
    lead, then moves off it as `reshard` says. The lead is this many times (the longest training call
    between two decisions + the last measured move off a node: its hand-over and transfer), at least
    `drain_floor_s` (service.control.drain). 0: move off at once, whatever the deadline."""
    drain_floor_s: Annotated[float, Field(strict=True, ge=0, le=3600)] = 5.0
    """The shortest lead: it also covers the cluster poll's delay and a step slower than the last."""
    drain_move_s: Annotated[float, Field(strict=True, ge=0, le=3600)] = 40.0
    """The move off a node assumed until one has been measured (with `reshard: storage`, always: its
    blocking save is not measured): conservative, so a job's first drains move early rather than late."""

    @model_validator(mode="after")
    def _rules(self) -> ParallelConfig:
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"parallel.min_workers={self.min_workers} is greater than parallel.max_workers={self.max_workers}",
                loc=("parallel", "min_workers"))
        if self.layout is not None:
            try:
                n = Layout.parse(self.layout, dp_mode=self.dp_mode).world_size
            except ValueError as e:
                raise ConfigError(f"parallel.layout: {e}", loc=('parallel', 'layout')) from None
            if n > MAX_WORKERS:
                raise ConfigError(f"parallel.layout {self.layout!r} needs {n} workers; Elastron accepts at most "
                                  f"{MAX_WORKERS}", loc=('parallel', 'layout'))
        return self


@_section("checkpoint")
class CheckpointConfig:
    interval_steps: _positive_int(MAX_STEPS) = 50
    """Save every this many steps (plus a final save)."""
    keep_last: _positive_int(10_000) = 3
    """Committed checkpoints to keep; the newest is never deleted."""
    dir: Location | None = None
    """Where checkpoints go (path or fsspec URL); default RUN_DIR/checkpoints."""
    async_save: Bool = True
    """Write in the background; the loop blocks only while state is staged."""
    peer_interval: _count(MAX_STEPS) = 1
    """Every this many steps each rank keeps a snapshot of its shards in its host memory and in a buddy
    rank's on another node (workers.snapshots), so that a rank lost without notice is served from memory
    and only the steps since that snapshot are redone; 0: off. Never written to disk: the durable
    checkpoints above stay, for the loss of the whole cluster."""
    peer_budget: Annotated[float, Field(strict=True, ge=0, le=1)] = 0.1
    """The share of training time peer snapshots may cost: where one costs more than this (its copy,
    and the steps its background send slows), they are taken less often than every `peer_interval`
    steps, as measured while training (workers.pace), and a kill redoes up to that many steps less one.
    0: exactly every `peer_interval` steps."""
    checksum: Literal["xxh3-128", "blake3", "sha256", "none"] = "xxh3-128"
    """Checksum of every written block, verified as it is read back: xxh3-128 (fast), blake3
    (cryptographic), sha256, or none (scratch runs only: corruption then goes unnoticed)."""
    io_threads: _positive_int(64) = 2
    """Files each rank writes, and reads, in parallel."""
    resume_from: Location | None = None
    """Start from the checkpoints under this directory even though another job or another model config
    wrote them (without it such a checkpoint is refused). Read only, and only while this job has no
    checkpoint of its own; naming this job's own checkpoint directory only waives the check."""

    @model_validator(mode="after")
    def _rules(self) -> CheckpointConfig:
        if self.resume_from is not None and not self.resume_from.strip():
            raise ConfigError(f"checkpoint.resume_from must be a directory path, got {self.resume_from!r}",
                              loc=('checkpoint', 'resume_from'))
        return self


@_section("resources")
class ResourcesConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device per worker; auto picks cuda when available."""
    cpus_per_worker: _positive_int(1024) = 1
    """CPUs reserved per worker actor."""
    gpus_per_worker: _count(64) | None = None
    """GPUs per worker actor; None: 1 with device: cuda, else 0. So `device` is the one switch between a
    CPU machine (auto or cpu) and a GPU cluster (cuda)."""
    standby_per_node: _count(4) = 1
    """Idle worker processes kept started on each node hosting the job's workers, reserving nothing
    (~300 MB of memory each): a worker that crashes is replaced by one without a process start (~2.5 s
    on CPU). Besides these, one node the job may use and does not keeps as many as the busiest node has
    members, so that a node lost without notice is replaced the same way
    (`service.pool.reserve.standby_targets`). CPU workers only (a GPU is given to a process when it
    starts); 0: none, anywhere. At most 4: more crashes at once than that on one node are a node's loss,
    which the spare node covers."""

    @model_validator(mode="after")
    def _rules(self) -> ResourcesConfig:
        if self.gpus_per_worker is None:
            object.__setattr__(self, "gpus_per_worker", 1 if self.device == "cuda" else 0)
        return self


@_section("scheduling")
class SchedulingConfig:
    priority: Annotated[int, Field(strict=True, ge=-1_000_000, le=1_000_000)] = 0
    """On a shared cluster (the REST service): higher-priority jobs are admitted first, and shrink or pause
    lower-priority ones to get their workers."""
    weight: Annotated[float, Field(strict=True, gt=0, lt=1e6)] = 1.0
    """Share of the spare workers among jobs of equal priority."""


@_section("logging", "wandb")
class WandbConfig:
    project: Annotated[str, Field(strict=True, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")] = "elastron"
    """W&B project of the run: a bare project name (letters, digits, `_.-`), never `entity/project`, since the
    workers write it with the operator's W&B credentials."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online: sync as it runs; offline: write under RUN_DIR/wandb only (`wandb sync` later)."""


@_section("logging")
class LoggingConfig:
    tensorboard: Bool = True
    """TensorBoard event files in RUN_DIR/tensorboard: loss, val_loss, LR, grad norm, tokens/s, MFU and
    every reconfiguration (workers.sinks)."""
    wandb: WandbConfig | None = None
    """The same to Weights & Biases (needs the wandb package); none: off."""


@_section()
class JobConfig:
    """A job spec: the job YAML, section by section."""

    name: Annotated[str, Field(strict=True, max_length=MAX_NAME)] = "job"
    """A label for the job."""
    model: ModelSection = field(default_factory=ModelSection)
    """The model: a preset and overrides, or a Hugging Face directory to start from."""
    data: DataConfig = field(default_factory=DataConfig)
    """What the model trains on."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimizer, its schedule and the numerics."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How many workers, and how the model is split over them."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Durable checkpoints and in-memory snapshots."""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """What each worker reserves."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks besides the run directory's own files."""
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    """The job's place among others on a shared cluster."""

    @model_validator(mode="after")
    def _rules(self) -> JobConfig:
        if self.train.eval_interval and self.data.source == "corpus" and self.data.val_path is None:
            raise ConfigError("train.eval_interval needs a held-out split: set data.val_path to a directory of text",
                              loc=('train', 'eval_interval'))
        if not self.model.is_resolved:
            return self  # judged by resolve_init_from, which builds this config again with the model's shape
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
        return self

    @classmethod
    def from_dict(cls, d: Any) -> JobConfig:
        """The JobConfig of a parsed spec (a YAML file's mapping, a request's JSON), or ConfigError naming
        the first field it refuses."""
        try:
            return _SPEC.validate_python(d)
        except ValidationError as e:
            raise config_error(e, root=cls) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Stable hash of the config (stored in checkpoints)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_SPEC = TypeAdapter(JobConfig)


def spec_schema() -> dict[str, Any]:
    """The JSON schema of a job spec (what /openapi.json shows under JobConfig)."""
    return _SPEC.json_schema()


def spec_maxima() -> dict[tuple[str, ...], int | float]:
    """Every number field of a spec with the largest value it accepts, read from the schema
    ({("data", "seq_len"): 1048576, ("model", "overrides", "dim"): 65536, ...}); an exclusive maximum
    is not listed (no largest value)."""
    schema = spec_schema()
    defs = schema.get("$defs", {})
    out: dict[tuple[str, ...], int | float] = {}

    def walk(s: dict, path: tuple[str, ...]) -> None:
        s = defs[s["$ref"].split("/")[-1]] if "$ref" in s else s
        for alt in s.get("anyOf", [s]):
            alt = defs[alt["$ref"].split("/")[-1]] if "$ref" in alt else alt
            if alt.get("type") in ("integer", "number") and "maximum" in alt:
                out[path] = alt["maximum"]
            for name, sub in alt.get("properties", {}).items():
                walk(sub, (*path, name))

    walk(schema, ())
    return out


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
