"""Choose a DP x TP x PP layout for the workers on offer. Pure: no torch import, runs in microseconds.

Candidates are all (dp, tp, pp) with dp * tp * pp = w; dp goes to dp_shard (FSDP) or dp_replicate per
`Constraints.dp_mode`. Valid: tp divides n_heads, n_kv_heads, vocab_size (vocab-parallel embedding and
loss) and ffn_hidden, tp <= max_tp, tp divides gpus_per_node (TP stays inside a node); pp <= n_layers,
pp <= max_pp; forced tp/pp match; dp divides global_batch_size; and some micro batch mb (a divisor of
global_batch_size / dp, <= micro_batch_size) gives grad_accum_steps >= pp when pp > 1 (1F1B needs a
microbatch per stage) and an estimated peak within memory_budget_bytes.

Preference order (the first difference decides):
  1. As many workers as possible: the largest w from min(world_size, max_workers) down to min_workers
     that has any valid layout.
  2. Smallest tp, then smallest pp: as much data parallelism as possible, because DP communicates once
     per step while TP communicates inside every layer and PP adds a pipeline bubble. Memory is what
     pushes tp and pp up.
  3. The largest micro batch.

Memory estimate in bytes per device (`estimate_memory`), an upper bound for the busiest stage:
  layers = ceil(n_layers / pp)
  P      = (layers * layer_params + E) / tp, where E = embedding + output + final norm when pp == 1 and
           one vocab table + final norm when pp > 1 (the first stage holds the embedding, the last the output)
  state  = P * (param_bytes + 4 grad + 8 AdamW + 4 fp32 master if param_bytes < 4) / dp_shard
  act    = layers * mb * seq_len * dim * 17 * param_bytes / tp
           (34 bytes per hidden element at 16 bits, Korthikanti et al. 2022, with flash attention)
  logits = mb * seq_len * vocab_size * 4 / tp   (fp32 logits for the loss)
  total  = state + act + logits
Each term is non-increasing in tp, pp and dp_shard. Left out: the extra microbatches 1F1B keeps in
flight on early stages, FSDP all-gather buffers and allocator fragmentation; keep headroom in the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from models.config import ModelConfig
from parallel.layout import Layout

_GIB = float(2**30)
_HINTS = {  # failure kind -> what the user can change
    "forced": "change the forced tp/pp", "tp": "allow other tp degrees (max_tp, gpus_per_node)",
    "pp": "allow other pp degrees (max_pp)", "batch": "use a global_batch_size with more divisors",
    "accum": "raise global_batch_size or allow a smaller pp",
    "memory": "raise memory_budget_bytes, offer more workers or lower param_bytes",
}


class PlanError(ValueError):
    """No valid layout exists for the offered workers; the message says why, with numbers."""


def _check_int(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Constraints:
    """What the planner must respect besides the model shape."""

    global_batch_size: int
    """Samples per optimizer step, fixed under every layout."""
    micro_batch_size: int
    """Preferred (largest) samples per forward/backward per DP rank."""
    seq_len: int
    """Tokens per sample."""
    dp_mode: str = "shard"
    """"shard": dp goes to dp_shard (FSDP); "replicate": dp goes to dp_replicate."""
    tp: int | None = None
    """Force this TP degree."""
    pp: int | None = None
    """Force this PP degree."""
    max_tp: int | None = None
    """Upper bound on the TP degree."""
    max_pp: int | None = None
    """Upper bound on the PP degree."""
    gpus_per_node: int | None = None
    """Devices per node: a TP group must fit inside one, so tp must divide it."""
    memory_budget_bytes: float | None = None
    """Per-device memory budget; None means unlimited."""
    param_bytes: int = 4
    """Bytes per parameter of the weights (4 for fp32, 2 for bf16)."""
    min_workers: int = 1
    """Fewest workers a plan may use."""
    max_workers: int | None = None
    """Most workers a plan may use."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "seq_len", "param_bytes", "min_workers"):
            _check_int(name, getattr(self, name))
        for name in ("tp", "pp", "max_tp", "max_pp", "gpus_per_node", "max_workers"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        if self.dp_mode not in ("shard", "replicate"):
            raise ValueError(f"dp_mode must be 'shard' or 'replicate', got {self.dp_mode!r}")
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes > 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes!r}")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"min_workers={self.min_workers} is greater than max_workers={self.max_workers}")
        for forced, cap in (("tp", "max_tp"), ("pp", "max_pp")):
            f, m = getattr(self, forced), getattr(self, cap)
            if f is not None and m is not None and f > m:
                raise ValueError(f"forced {forced}={f} exceeds {cap}={m}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The chosen layout for one world size, and why."""

    layout: Layout
    world_size: int
    """Workers used (= layout.world_size)."""
    available: int
    """Workers offered."""
    micro_batch_size: int
    grad_accum_steps: int
    """Microbatches per DP rank per optimizer step = global_batch_size / (micro_batch_size * dp)."""
    memory_bytes: float
    """Estimated peak per device (see the module docstring)."""
    reasons: tuple[str, ...]
    """Why this layout, and why any offered workers are left unused."""

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "world_size": self.world_size, "available": self.available,
                "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
                "memory_bytes": self.memory_bytes, "reasons": list(self.reasons)}


def estimate_memory(model: ModelConfig, layout: Layout, *, micro_batch_size: int, seq_len: int,
                    param_bytes: int = 4) -> float:
    """Estimated peak bytes per device for training `model` under `layout` (formula in the module doc)."""
    for name, v in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len), ("param_bytes", param_bytes)):
        _check_int(name, v)
    if layout.pp > model.n_layers:
        raise ValueError(f"pp={layout.pp} exceeds n_layers={model.n_layers}")
    table = model.vocab_size * model.dim
    layer_params = (model.num_params(embedding=False) - table - model.dim) / model.n_layers
    layers = -(-model.n_layers // layout.pp)
    ends = (2 if layout.pp == 1 else 1) * table + model.dim
    params = (layers * layer_params + ends) / layout.tp
    per_param = param_bytes + 4 + 8 + (4 if param_bytes < 4 else 0)
    tokens = micro_batch_size * seq_len
    act = layers * tokens * model.dim * 17 * param_bytes / layout.tp
    logits = tokens * model.vocab_size * 4 / layout.tp
    return params * per_param / layout.dp_shard + act + logits


def _divisors(n: int) -> list[int]:
    """Divisors of n in ascending order, in O(sqrt n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def micro_batch_sizes(per_rank: int, preferred: int, *, min_microbatches: int = 1) -> list[int]:
    """Usable micro batch sizes for `per_rank` samples per DP rank, largest first: divisors of per_rank
    that are <= preferred and leave at least `min_microbatches` microbatches (pp for a 1F1B pipeline)."""
    return [d for d in reversed(_divisors(per_rank)) if d <= preferred and per_rank // d >= min_microbatches]


def micro_batch_for(global_batch_size: int, dp: int, preferred: int, *, min_microbatches: int = 1) -> int:
    """The micro batch a layout with `dp` data-parallel ranks uses (the planner's choice, without a budget)."""
    if global_batch_size % dp:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp={dp}")
    sizes = micro_batch_sizes(global_batch_size // dp, preferred, min_microbatches=min_microbatches)
    if not sizes:
        raise ValueError(
            f"{global_batch_size // dp} samples per DP rank cannot form {min_microbatches} microbatches "
            f"(pp={min_microbatches} needs at least that many); raise global_batch_size or lower dp"
        )
    return sizes[0]


def _tp_problem(tp: int, model: ModelConfig, c: Constraints) -> str | None:
    for name in ("n_heads", "n_kv_heads", "vocab_size", "ffn_hidden"):
        if getattr(model, name) % tp:
            return f"tp={tp} does not divide {name}={getattr(model, name)}"
    if c.max_tp is not None and tp > c.max_tp:
        return f"tp={tp} exceeds max_tp={c.max_tp}"
    if c.gpus_per_node is not None and c.gpus_per_node % tp:
        return f"tp={tp} does not divide gpus_per_node={c.gpus_per_node} (a TP group stays in one node)"
    return None


def _pp_problem(pp: int, model: ModelConfig, c: Constraints) -> str | None:
    if pp > model.n_layers:
        return f"pp={pp} exceeds n_layers={model.n_layers}"
    if c.max_pp is not None and pp > c.max_pp:
        return f"pp={pp} exceeds max_pp={c.max_pp}"
    return None


class _Fail(NamedTuple):
    kind: str  # a key of _HINTS
    msg: str
    memory: float = 0.0  # estimated bytes, for kind "memory"


class _Choice(NamedTuple):
    layout: Layout
    mb: int
    memory: float
    mb_notes: tuple[str, ...]  # why mb is below the asked micro_batch_size


def _evaluate(w: int, tp: int, pp: int, model: ModelConfig, c: Constraints) -> _Choice | _Fail:
    """The best micro batch for one candidate, or (failure kind, message)."""
    dp = w // (tp * pp)
    if c.global_batch_size % dp:
        return _Fail("batch", f"global_batch_size={c.global_batch_size} is not divisible by dp={dp}")
    per_rank = c.global_batch_size // dp
    dp_axis = "dp_shard" if c.dp_mode == "shard" else "dp_replicate"
    layout = Layout(tp=tp, pp=pp, **{dp_axis: dp})
    sizes = micro_batch_sizes(per_rank, c.micro_batch_size)
    notes = [f"the largest divisor of {per_rank} samples per DP rank"] if sizes[0] < c.micro_batch_size else []
    legal = micro_batch_sizes(per_rank, c.micro_batch_size, min_microbatches=pp)
    if not legal:
        return _Fail("accum", f"pp={pp} needs >= {pp} microbatches but dp={dp} leaves {per_rank} samples per rank")
    if legal[0] < sizes[0]:
        notes.append(f"pp={pp} needs >= {pp} microbatches per step")
    for mb in legal:
        mem = estimate_memory(model, layout, micro_batch_size=mb, seq_len=c.seq_len, param_bytes=c.param_bytes)
        if c.memory_budget_bytes is None or mem <= c.memory_budget_bytes:
            if mb < legal[0]:
                notes.append("smaller to fit the memory budget")
            return _Choice(layout, mb, mem, tuple(notes))
    return _Fail("memory", f"{layout.short()} needs {mem / _GIB:.2f} GiB at micro_batch_size={legal[-1]} "
                           f"> budget {c.memory_budget_bytes / _GIB:.2f} GiB", mem)


def _try_size(w: int, model: ModelConfig, c: Constraints) -> tuple[_Choice | None, list[_Fail]]:
    """The preferred valid layout on exactly w workers, with the failures of all more preferred ones."""
    need = (c.tp or 1) * (c.pp or 1)
    if w % need:
        forced = " and ".join(f"{n}={v}" for n, v in (("tp", c.tp), ("pp", c.pp)) if v)
        return None, [_Fail("forced", f"{forced} (forced) needs a multiple of {need}")]
    fails: list[_Fail] = []
    for tp in _divisors(w) if c.tp is None else [c.tp]:
        if why := _tp_problem(tp, model, c):
            fails.append(_Fail("tp", why))
            continue
        for pp in _divisors(w // tp):
            if c.pp is not None and pp != c.pp:
                continue
            if why := _pp_problem(pp, model, c):
                fails.append(_Fail("pp", why))
                continue
            got = _evaluate(w, tp, pp, model, c)
            if isinstance(got, _Choice):
                return got, fails
            fails.append(got)
    return None, fails


def _summary(fails: list[_Fail], limit: int = 2) -> str:
    uniq = list(dict.fromkeys(f.msg for f in fails))
    more = f" (+{len(uniq) - limit} more)" if len(uniq) > limit else ""
    return "; ".join(uniq[:limit]) + more


def plan(world_size: int, model: ModelConfig, constraints: Constraints) -> Plan:
    """The preferred valid layout on at most `world_size` workers (see the module docstring)."""
    _check_int("world_size", world_size)
    if not isinstance(model, ModelConfig) or not isinstance(constraints, Constraints):
        raise ValueError("plan() needs a ModelConfig and a Constraints")
    c = constraints
    if c.seq_len > model.max_seq_len:
        raise ValueError(f"seq_len={c.seq_len} exceeds model max_seq_len={model.max_seq_len}")
    if world_size < c.min_workers:
        raise PlanError(f"{world_size} workers offered but min_workers={c.min_workers}: "
                        "wait for more workers or lower min_workers")
    top = world_size if c.max_workers is None else min(world_size, c.max_workers)
    skipped: list[tuple[int, list[_Fail]]] = []
    for w in range(top, c.min_workers - 1, -1):
        choice, fails = _try_size(w, model, c)
        if choice is not None:
            break
        skipped.append((w, fails))
    else:
        detail = "; ".join(f"{w}: {_summary(f, 1)}" for w, f in skipped[:3])
        every = [f for _, fs in skipped for f in fs]
        if mem := [f for f in every if f.kind == "memory"]:
            detail += f"; least memory: {min(mem, key=lambda f: f.memory).msg}"
        hints = ", or ".join(_HINTS[k] for k in dict.fromkeys(f.kind for f in every))
        raise PlanError(f"no valid layout on {top} down to {c.min_workers} workers (offered {world_size}, "
                        f"min_workers={c.min_workers}): {detail}; to fix: {hints}")

    reasons: list[str] = []
    if top < world_size:
        reasons.append(f"{world_size} workers offered; max_workers={c.max_workers} caps the plan at {top}")
    reasons += [f"{w} workers: {_summary(f)}" for w, f in skipped[:3]]
    if len(skipped) > 3:
        reasons.append(f"{len(skipped) - 3} more sizes down to {skipped[-1][0]} have no valid layout either")
    if w < world_size:
        reasons.append(f"using {w} of {world_size} workers offered")
    lay = choice.layout
    head = f"tp={lay.tp}{' (forced)' if c.tp else ''}, pp={lay.pp}{' (forced)' if c.pp else ''}"
    if fails:
        body = f"preferred layouts (smaller tp, then smaller pp) fail: {_summary(fails)}"
    elif lay.tp == lay.pp == 1:
        body = "model fits per device with pure data parallelism"
    else:
        body = "as much data parallelism as the forced degrees allow"
    budget = "" if c.memory_budget_bytes is None else f" of a {c.memory_budget_bytes / _GIB:.2f} GiB budget"
    reasons.append(f"{head}: {body}; est. {choice.memory / _GIB:.2f} GiB per device{budget}")
    if choice.mb_notes:
        reasons.append(f"micro_batch_size={choice.mb} (asked {c.micro_batch_size}): {', '.join(choice.mb_notes)}")
    return Plan(layout=lay, world_size=w, available=world_size, micro_batch_size=choice.mb,
                grad_accum_steps=c.global_batch_size // (choice.mb * lay.dp), memory_bytes=choice.memory,
                reasons=tuple(reasons))
