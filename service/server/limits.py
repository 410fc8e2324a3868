"""What this server accepts: an upper bound on every size a job request may name, so that no request
can make validation, planning or a worker's allocations unbounded. JobConfig judges whether a spec is
*valid*; these bounds judge whether this server takes it on, and are checked once, on the raw request,
before anything else looks at it (`check_limits`). The API documents the same table in its schema
(`maximum`), so a client can read the limits from /openapi.json.

The bounds are generous for real jobs (an 8B Llama is far inside every one) and small enough that the
planner's work stays in milliseconds: it grows with the worker count, the divisors of the global batch
and the pipeline depth (at most the layer count), never with a model dimension's magnitude.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["LIMITS", "MAX_GLOBAL_BATCH", "MAX_LIST", "MAX_STEPS", "MAX_WORKERS", "MODEL_OVERRIDES", "Override",
           "check_limits", "check_override", "over_limit"]

MAX_WORKERS = 100_000
"""Largest worker count (or parallel degree) a request may name."""
MAX_GLOBAL_BATCH = 1 << 24
"""Largest global (or micro) batch a request may name: the planner walks the batch's divisors."""
MAX_STEPS = 10**12
"""Largest step count a request may name."""
MAX_LIST = 64
"""Longest list a spec field may hold (data.suffixes)."""

LIMITS: dict[tuple[str, str], int] = {
    # model (overrides of a preset's ModelConfig fields)
    ("model", "dim"): 1 << 16, ("model", "n_layers"): 1024, ("model", "n_heads"): 1024,
    ("model", "n_kv_heads"): 1024, ("model", "vocab_size"): 1 << 22, ("model", "ffn_hidden"): 1 << 18,
    ("model", "max_seq_len"): 1 << 20,
    # data
    ("data", "seq_len"): 1 << 20, ("data", "max_bytes"): 1 << 40, ("data", "num_samples"): 1 << 40,
    # train
    ("train", "steps"): MAX_STEPS, ("train", "global_batch_size"): MAX_GLOBAL_BATCH,
    ("train", "micro_batch_size"): MAX_GLOBAL_BATCH, ("train", "warmup_steps"): MAX_STEPS,
    ("train", "decay_steps"): MAX_STEPS, ("train", "seed"): 2**63 - 1,
    # parallel
    ("parallel", "min_workers"): MAX_WORKERS, ("parallel", "max_workers"): MAX_WORKERS,
    ("parallel", "tp"): MAX_WORKERS, ("parallel", "pp"): MAX_WORKERS, ("parallel", "max_tp"): MAX_WORKERS,
    ("parallel", "max_pp"): MAX_WORKERS, ("parallel", "gpus_per_node"): MAX_WORKERS,
    ("parallel", "memory_budget_gb"): 1 << 20,
    # checkpoint
    ("checkpoint", "interval_steps"): MAX_STEPS, ("checkpoint", "peer_interval"): MAX_STEPS, ("checkpoint", "keep_last"): 10_000,
    ("checkpoint", "io_threads"): 64,
    # resources
    ("resources", "cpus_per_worker"): 1024, ("resources", "gpus_per_worker"): 64,
}
"""(section, field) -> the largest value this server accepts. Model fields are ModelConfig's, given
under model.overrides."""


@dataclass(frozen=True, slots=True)
class Override:
    """What a model.overrides field may hold: its JSON type, its bounds (numbers), whether null is allowed,
    and for strings the choices."""

    kind: str
    """"integer", "number" (an integer or a finite float), "boolean", "string" or "object"."""
    lo: float | None = None
    hi: float | None = None
    nullable: bool = False
    choices: tuple[str, ...] = ()


MODEL_OVERRIDES: dict[str, Override] = {
    "dim": Override("integer", 1, 1 << 16), "n_layers": Override("integer", 1, 1024),
    "n_heads": Override("integer", 1, 1024), "n_kv_heads": Override("integer", 1, 1024),
    "vocab_size": Override("integer", 1, 1 << 22), "ffn_hidden": Override("integer", 1, 1 << 18),
    "max_seq_len": Override("integer", 1, 1 << 20),
    "norm_eps": Override("number", 1e-12, 1.0), "rope_theta": Override("number", 1.0, 1e12),
    "init_std": Override("number", 1e-8, 10.0),
    "head_size": Override("integer", 2, 1 << 14, nullable=True),
    "rope_scaling": Override("object", nullable=True),
    "tie_embeddings": Override("boolean"), "qkv_bias": Override("boolean"), "out_bias": Override("boolean"),
    "qk_norm": Override("boolean"),
    "sliding_window": Override("integer", 1, 1 << 20, nullable=True),
    "family": Override("string", choices=("llama", "mistral", "qwen2", "qwen3")),
}
"""Every ModelConfig field a spec's model.overrides may set, with its type and bounds, judged at submit
(`check_override`) so that a wrong one is a 422 naming the field, never a worker's failure later."""


def check_override(name: Any, value: Any) -> str | None:
    """Why model.overrides.`name` = `value` is not accepted, or None."""
    f = f"model.overrides.{name}"
    kind = MODEL_OVERRIDES.get(name) if isinstance(name, str) else None
    if kind is None:
        return f"{f} is not a model field this server accepts; known: {', '.join(sorted(MODEL_OVERRIDES))}"
    if value is None:
        return None if kind.nullable else f"{f} must not be null"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {"integer": isinstance(value, int) and not isinstance(value, bool), "number": number,
          "boolean": isinstance(value, bool), "string": isinstance(value, str), "object": isinstance(value, dict)}
    if not ok[kind.kind]:
        return f"{f} must be {'an' if kind.kind[0] in 'aeiou' else 'a'} {kind.kind}, got {type(value).__name__}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{f} must be a finite number"
    if number and (kind.lo is not None and value < kind.lo or kind.hi is not None and value > kind.hi):
        shown = value if isinstance(value, float) or abs(value) < 10**30 else f"a {len(str(abs(value)))}-digit number"
        if value > kind.hi:
            return f"{f}={shown} is more than this server accepts (at most {kind.hi})"
        return f"{f}={shown} is less than this server accepts (at least {kind.lo})"
    if kind.choices and value not in kind.choices:
        return f"{f} must be one of {', '.join(kind.choices)}, got {value!r}"
    if kind.kind == "object" and not all(isinstance(k, str) and (isinstance(v, str) or (
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))) for k, v in value.items()):
        return f"{f} must map names to finite numbers or strings"
    return None


def over_limit(section: str, name: str, value: Any) -> str | None:
    """Why `value` of section.name is more than this server accepts, or None. Non-numbers pass: their
    type is JobConfig's to judge."""
    limit = LIMITS.get((section, name))
    if limit is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value > limit:
        return f"{section}.{name}={value} is more than this server accepts (at most {limit})"
    return None


def check_limits(spec: Any) -> tuple[tuple[str, ...], str] | None:
    """The first size in a raw job spec over this server's limits, as (field path, message), or None.
    Cheap and shape-tolerant: a wrongly shaped spec is JobConfig's to report."""
    if not isinstance(spec, dict):
        return None
    for section in ("data", "train", "parallel", "checkpoint", "resources"):
        sec = spec.get(section)
        if isinstance(sec, dict):
            for name, v in sec.items():
                if why := over_limit(section, name, v):
                    return (section, name), why
    data = spec.get("data")
    if isinstance(data, dict) and isinstance(data.get("suffixes"), list) and len(data["suffixes"]) > MAX_LIST:
        return ("data", "suffixes"), f"data.suffixes has {len(data['suffixes'])} entries; at most {MAX_LIST}"
    model = spec.get("model")
    overrides = model.get("overrides") if isinstance(model, dict) else None
    if isinstance(overrides, dict):
        for name, v in overrides.items():
            if why := check_override(name, v):
                return ("model", "overrides", str(name)), why
    return None
