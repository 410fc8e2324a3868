"""Choose a DP x TP x PP layout for the workers on offer: the one judge of layouts, planned or forced.
Pure: no torch import, runs in microseconds.

Candidates are all (dp, tp, pp) with dp * tp * pp = w; dp goes to dp_shard (FSDP) or dp_replicate per
`Constraints.dp_mode`; "auto" replicates where replicas fit (see `replicate_fits`) and shards otherwise. Valid: tp divides n_heads, n_kv_heads, vocab_size (vocab-parallel embedding and
loss) and ffn_hidden, tp <= max_tp, tp divides gpus_per_node (TP stays inside a node); pp <= n_layers,
pp <= max_pp; forced tp/pp match; dp divides global_batch_size; and some micro batch mb (a divisor of
global_batch_size / dp, <= micro_batch_size) gives grad_accum_steps >= pp when pp > 1 (1F1B needs a
microbatch per stage) and an estimated peak within memory_budget_bytes.

A forced layout (`Constraints.layout`: the job's parallel.layout or a --layout flag) is judged by the
same rules, in words that name the fix. It fixes the worker count; the memory budget only picks its
micro batch (the user's layout overrides the estimate, which is an upper bound).

Preference order (the first difference decides):
  1. The most modelled throughput: on each worker count, from min(world_size, max_workers) down to
     min_workers, its preferred layout (2, 3) trains at w x the 1F1B pipeline efficiency m / (m + pp - 1)
     (m: microbatches per step; 1 without a pipeline). The largest w with a valid layout wins unless a
     smaller count's rate beats it by more than _FEWER_GAIN: where the batch does not divide w's data
     parallelism, the only layouts left are long pipelines (184 GPUs: dp=8 x pp=23 at 0.73), and 160 of
     them at pp=2 train faster than all 184 (the rest stay idle; see `rate`).
  2. Smallest tp, then smallest pp: as much data parallelism as possible, because DP communicates once
     per step while TP communicates inside every layer and PP adds a pipeline bubble. Memory is what
     pushes tp and pp up.
  3. The largest micro batch.
The work is bounded by the worker count and the batch size, never by the model's sizes: counts on which
no (dp, tp, pp) passes the rules other than memory are skipped without a look, at most _MAX_SIZES of
the others are judged, largest first, and none at or below the best rate found (a count's rate is at
most the count).

Memory is judged with `parallel.memory.estimate_memory` (formula there).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from dataclasses import replace
from typing import Iterator, NamedTuple

from models.config import ModelConfig
from parallel.layout import Layout
from parallel.memory import estimate_memory
from parallel.plan_types import DP_MODES, Constraints, Plan, PlanError, check_int

__all__ = ["DP_MODES", "Constraints", "Plan", "PlanError", "plan", "rate", "replicate_fits"]

_GIB = float(2**30)
_MAX_SIZES = 64  # worker counts judged per plan; more than the planner tests sweep
_FEWER_GAIN = 0.01  # how much faster (modelled) fewer workers must be to leave some of the offer idle
_HINTS = {  # failure kind -> what the user can change
    "forced": "change the forced tp/pp", "tp": "allow other tp degrees (max_tp, gpus_per_node)",
    "pp": "allow other pp degrees (max_pp)", "batch": "use a global_batch_size with more divisors",
    "accum": "raise global_batch_size or allow a smaller pp",
    "memory": "raise memory_budget_bytes, offer more workers or lower param_bytes",
}


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """Divisors of n in ascending order, in O(sqrt n) the first time. Remembered: one plan asks for the
    same few numbers (the batch's divisors, the counts on offer) thousands of times."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return (*small, *(n // d for d in reversed(small) if d * d != n))


def _divisors_upto(n: int, limit: int) -> list[int]:
    """Divisors of n that are <= limit, ascending: a slice of the remembered `_divisors(n)` where finding
    them all is needed anyway (limit >= sqrt n) or cheap (n < 2**32); else by trial up to limit, so a
    huge n costs nothing more."""
    if limit < math.isqrt(n) and n >= 1 << 32:
        return [d for d in range(1, limit + 1) if n % d == 0]
    divs = _divisors(n)
    return list(divs[:bisect.bisect_right(divs, limit)])


def _micro_batch_sizes(per_rank: int, preferred: int, *, min_microbatches: int = 1) -> list[int]:
    """Usable micro batch sizes for `per_rank` samples per DP rank, largest first: divisors of per_rank
    that are <= preferred and leave at least `min_microbatches` microbatches (pp for a 1F1B pipeline)."""
    return _divisors_upto(per_rank, min(preferred, per_rank // min_microbatches))[::-1]


def _tp_problem(tp: int, model: ModelConfig, c: Constraints, forced: bool = False) -> str | None:
    whose, fix = ("the model's ", "; use a tp that does") if forced else ("", "")
    for name in ("n_heads", "n_kv_heads", "vocab_size", "ffn_hidden"):
        if getattr(model, name) % tp:
            return f"tp={tp} does not divide {whose}{name}={getattr(model, name)}{fix}"
    if c.max_tp is not None and tp > c.max_tp:
        return f"tp={tp} exceeds max_tp={c.max_tp}"
    if c.gpus_per_node is not None and c.gpus_per_node % tp:
        return f"tp={tp} does not divide gpus_per_node={c.gpus_per_node} (a TP group stays in one node)"
    return None


def _pp_problem(pp: int, model: ModelConfig, c: Constraints, forced: bool = False) -> str | None:
    whose = "the model's " if forced else ""
    if pp > model.n_layers:
        return f"pp={pp} exceeds {whose}n_layers={model.n_layers}"
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
    dp_note: str = ""  # what dp_mode "auto" chose, and why


def rate(layout: Layout, micro_batch_size: int, global_batch_size: int) -> float:
    """A layout's modelled throughput in workers' worth: its worker count times the 1F1B pipeline
    efficiency m / (m + pp - 1), m the microbatches per step (each stage idles pp - 1 microbatches'
    time per step). TP's and DP's communication are not modelled: between counts the planner
    compares, the preferred layouts differ in their pipelines."""
    if layout.pp == 1:
        return float(layout.world_size)
    m = global_batch_size // (micro_batch_size * layout.dp)
    return layout.world_size * m / (m + layout.pp - 1)


def replicate_fits(memory_bytes: float, c: Constraints) -> bool:
    """dp_mode "auto": whether full replicas (estimated `memory_bytes` per device at the micro batch
    sharding would get) are the better data parallelism.

    With a memory budget: when the estimate fits it, on any device. Without one: on CPU only. There
    FSDP's extra collectives (gloo blocks, so a gather per unit per step overlaps nothing) cost time
    while the memory they save, on a host with the whole model in RAM anyway, buys nothing measurable;
    on GPUs, where memory is the scarce thing and NCCL overlaps the gathers, an unknown budget keeps
    today's choice (shard), as does an unknown device."""
    if c.memory_budget_bytes is not None:
        return memory_bytes <= c.memory_budget_bytes
    return c.device_type == "cpu"


def _auto_dp(got: _Choice, model: ModelConfig, c: Constraints) -> _Choice:
    """dp_mode "auto": turn a sharded choice into replicas at the same micro batch where they fit."""
    lay = got.layout
    if lay.dp_shard == 1:
        return got
    rep = Layout(dp_replicate=lay.dp_shard, tp=lay.tp, pp=lay.pp)
    m = estimate_memory(model, rep, micro_batch_size=got.mb, seq_len=c.seq_len, param_bytes=c.param_bytes)
    if replicate_fits(m, c):
        why = (f"replicas fit the budget (est. {m / _GIB:.2f} GiB)" if c.memory_budget_bytes is not None
               else "no memory budget on CPU, where sharding buys nothing")
        return got._replace(layout=rep, memory=m, dp_note=f"dp_mode auto: replicate, {why}")
    why = (f"replicas would need {m / _GIB:.2f} GiB{_budget(c)}" if c.memory_budget_bytes is not None
           else f"no memory budget on device {c.device_type or 'unknown'}")
    return got._replace(dp_note=f"dp_mode auto: shard, {why}")


def _batch_problem(dp: int, c: Constraints, forced: bool = False) -> _Fail | None:
    """Why dp cannot split the global batch, or None."""
    gbs = c.global_batch_size
    if not gbs % dp:
        return None
    if forced:
        return _Fail("batch", f"dp={dp} does not divide train.global_batch_size={gbs}; "
                              "use a dp that does, or another batch")
    return _Fail("batch", f"global_batch_size={gbs} is not divisible by dp={dp}")


def _evaluate(layout: Layout, model: ModelConfig, c: Constraints, forced: bool = False) -> _Choice | _Fail:
    """The best micro batch for one candidate whose tp and pp passed, or why there is none. A forced
    layout's messages name the fix, in the job config's words; it is never refused for memory: it gets
    the smallest micro batch, as the closest to fitting."""
    dp, pp, gbs = layout.dp, layout.pp, c.global_batch_size
    if why := _batch_problem(dp, c, forced):
        return why
    per_rank = gbs // dp
    sizes = _micro_batch_sizes(per_rank, c.micro_batch_size)
    notes = [f"the largest divisor of {per_rank} samples per DP rank"] if sizes[0] < c.micro_batch_size else []
    legal = _micro_batch_sizes(per_rank, c.micro_batch_size, min_microbatches=pp)
    if not legal:
        if forced:
            return _Fail("accum", f"pp={pp} needs >= {pp} microbatches per step but dp={dp} leaves {per_rank} "
                                  "samples per DP rank; raise train.global_batch_size or lower dp or pp")
        return _Fail("accum", f"pp={pp} needs >= {pp} microbatches but dp={dp} leaves {per_rank} samples per rank")
    if legal[0] < sizes[0]:
        notes.append(f"pp={pp} needs >= {pp} microbatches per step")

    def mem(mb: int) -> float:
        return estimate_memory(model, layout, micro_batch_size=mb, seq_len=c.seq_len, param_bytes=c.param_bytes)

    budget, least = c.memory_budget_bytes, mem(legal[-1])
    if budget is not None and least > budget:  # memory grows with mb: the smallest decides
        if not forced:
            return _Fail("memory", f"{layout.short()} needs {least / _GIB:.2f} GiB at micro_batch_size={legal[-1]} "
                                   f"> budget {budget / _GIB:.2f} GiB", least)
        return _Choice(layout, legal[-1], least, (*notes, "the smallest, still over the memory budget"))
    for mb in legal:
        m = least if mb == legal[-1] else mem(mb)
        if budget is None or m <= budget:
            if mb < legal[0]:
                notes.append("smaller to fit the memory budget")
            return _Choice(layout, mb, m, tuple(notes))
    raise AssertionError("unreachable: the smallest micro batch fits")


def _try_size(w: int, model: ModelConfig, c: Constraints) -> tuple[_Choice | None, list[_Fail]]:
    """The preferred valid layout on exactly w workers, with the failures of all more preferred ones."""
    need = (c.tp or 1) * (c.pp or 1)
    if w % need:
        forced = " and ".join(f"{n}={v}" for n, v in (("tp", c.tp), ("pp", c.pp)) if v)
        return None, [_Fail("forced", f"{forced} (forced) needs a multiple of {need}")]
    fails: list[_Fail] = []
    dp_axis = "dp_replicate" if c.dp_mode == "replicate" else "dp_shard"
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
            if bad := _batch_problem(w // (tp * pp), c):  # before a Layout is built: most candidates end here
                fails.append(bad)
                continue
            got = _evaluate(Layout(tp=tp, pp=pp, **{dp_axis: w // (tp * pp)}), model, c)
            if isinstance(got, _Choice):
                return (_auto_dp(got, model, c) if c.dp_mode == "auto" else got), fails
            fails.append(got)
    return None, fails


def _tp_options(model: ModelConfig, c: Constraints, hi: int) -> list[int]:
    """TP degrees <= hi that pass _tp_problem: divisors of the model sizes' gcd (and of gpus_per_node)."""
    if c.tp is not None:
        return [] if _tp_problem(c.tp, model, c) else [c.tp]
    g = math.gcd(model.n_heads, model.n_kv_heads, model.vocab_size, model.ffn_hidden, c.gpus_per_node or 0)
    return _divisors_upto(g, min(hi, c.max_tp or hi))


def _sizes(model: ModelConfig, c: Constraints, lo: int, hi: int) -> Iterator[int]:
    """Worker counts in [lo, hi], largest first, with some (dp, tp, pp) that passes every rule but memory:
    dp divides the batch, tp is an option, pp passes _pp_problem and leaves >= pp samples per DP rank.
    Each (dp, tp) gives the multiples dp * tp * pp; their descending runs are merged lazily."""
    runs = []
    for dp in _divisors_upto(c.global_batch_size, hi):
        for tp in _tp_options(model, c, hi // dp):
            m = dp * tp
            k_hi = min(model.n_layers, c.max_pp or hi, c.global_batch_size // dp, hi // m, c.pp or hi)
            k_lo = max(-(-lo // m), c.pp or 1)
            if k_lo <= k_hi:
                runs.append(range(k_hi * m, k_lo * m - 1, -m))
    last = None
    for w in heapq.merge(*runs, reverse=True):
        if w != last:
            yield w
            last = w


def _summary(fails: list[_Fail], limit: int = 2) -> str:
    uniq = list(dict.fromkeys(f.msg for f in fails))
    more = f" (+{len(uniq) - limit} more)" if len(uniq) > limit else ""
    return "; ".join(uniq[:limit]) + more


def _budget(c: Constraints) -> str:
    return "" if c.memory_budget_bytes is None else f" of a {c.memory_budget_bytes / _GIB:.2f} GiB budget"


def _plan_forced(world_size: int, model: ModelConfig, c: Constraints) -> Plan:
    lay = c.layout
    if world_size < lay.world_size:
        raise PlanError(f"forced layout {lay} needs {lay.world_size} workers, {world_size} offered")
    why = _tp_problem(lay.tp, model, c, forced=True) or _pp_problem(lay.pp, model, c, forced=True)
    got = _Fail("forced", why) if why else _evaluate(lay, model, c, forced=True)
    if isinstance(got, _Fail):
        raise PlanError(got.msg)
    reasons = [f"using {lay.world_size} of {world_size} workers offered"] if world_size > lay.world_size else []
    reasons.append(f"layout {lay} forced by the job; est. {got.memory / _GIB:.2f} GiB per device{_budget(c)}")
    if got.mb_notes:
        reasons.append(f"micro_batch_size={got.mb} (asked {c.micro_batch_size}): {', '.join(got.mb_notes)}")
    return Plan(layout=lay, world_size=lay.world_size, available=world_size, micro_batch_size=got.mb,
                grad_accum_steps=c.global_batch_size // (got.mb * lay.dp), memory_bytes=got.memory,
                reasons=tuple(reasons))


def _no_plan(world_size: int, top: int, model: ModelConfig, c: Constraints, shown: list[tuple[int, list[_Fail]]],
             judged: dict, *, splits: int, truncated: bool) -> PlanError:
    """One line: the first counts tried and why each fails, what rules out all, and what to change."""
    detail = "; ".join(f"{s}: {_summary(f, 1)}" for s, f in shown)
    every = [f for _, fs in judged.values() for f in fs]
    if not splits and c.tp is not None and (why := _tp_problem(c.tp, model, c)):
        detail += f"; {why}"
        every.append(_Fail("tp", why))
    elif not splits:
        tps = _tp_options(model, c, top)
        detail += (f"; no count splits as dp x tp x pp with dp dividing global_batch_size={c.global_batch_size}"
                   f", tp in {tps[:8]}{'...' if len(tps) > 8 else ''} and pp <= n_layers={model.n_layers}")
    elif truncated:
        detail += f" (judged the {_MAX_SIZES} largest counts that split as dp x tp x pp)"
    if mem := [f for f in every if f.kind == "memory"]:
        detail += f"; least memory: {min(mem, key=lambda f: f.memory).msg}"
    hints = ", or ".join(_HINTS[k] for k in dict.fromkeys(f.kind for f in every))
    return PlanError(f"no valid layout on {top} down to {c.min_workers} workers (offered {world_size}, "
                     f"min_workers={c.min_workers}): {detail}; to fix: {hints}")


def plan(world_size: int, model: ModelConfig, constraints: Constraints) -> Plan:
    """The preferred valid layout on at most `world_size` workers, or the forced one (module docstring)."""
    check_int("world_size", world_size)
    if not isinstance(model, ModelConfig) or not isinstance(constraints, Constraints):
        raise ValueError("plan() needs a ModelConfig and a Constraints")
    c = constraints
    if c.seq_len > model.max_seq_len:
        raise ValueError(f"seq_len={c.seq_len} exceeds model max_seq_len={model.max_seq_len}")
    if c.layout is not None:
        return _plan_forced(world_size, model, c)
    if world_size < c.min_workers:
        raise PlanError(f"{world_size} workers offered but min_workers={c.min_workers}: "
                        "wait for more workers or lower min_workers")
    top = world_size if c.max_workers is None else min(world_size, c.max_workers)
    judged: dict[int, tuple[_Choice | None, list[_Fail]]] = {}

    def judge(w: int) -> tuple[_Choice | None, list[_Fail]]:
        if w not in judged:
            judged[w] = _try_size(w, model, c)
        return judged[w]

    def rate_of(got: _Choice) -> float:
        return rate(got.layout, got.mb, c.global_batch_size)

    choice, first, splits = None, None, 0
    sizes = _sizes(model, c, c.min_workers, top)
    for w in itertools.islice(sizes, _MAX_SIZES):
        if choice is not None and w <= rate_of(choice) * (1 + _FEWER_GAIN):
            break  # no count at or below the best rate can beat it by the margin
        splits += 1
        got, _ = judge(w)
        if got is None:
            continue
        if first is None:
            choice = first = got
        elif rate_of(got) > rate_of(choice) * (1 + _FEWER_GAIN):
            choice = got
    if choice is None:
        # Every count (all of them when none fits) has no valid layout: name a few.
        skipped = range(top, c.min_workers - 1, -1)
        shown = [(s, judge(s)[1]) for s in skipped[:3]]
        truncated = splits == _MAX_SIZES and next(sizes, None) is not None
        raise _no_plan(world_size, top, model, c, shown, judged, splits=splits, truncated=truncated)
    # Every count above the largest valid one has no valid layout: name a few.
    skipped = range(top, first.layout.world_size, -1)
    shown = [(s, judge(s)[1]) for s in skipped[:3]]
    fails = judge(choice.layout.world_size)[1]

    w = choice.layout.world_size
    reasons: list[str] = []
    if top < world_size:
        reasons.append(f"{world_size} workers offered; max_workers={c.max_workers} caps the plan at {top}")
    reasons += [f"{s} workers: {_summary(f)}" for s, f in shown]
    if len(skipped) > 3:
        reasons.append(f"{len(skipped) - 3} more sizes down to {skipped[-1]} have no valid layout either")
    if choice is not first:
        reasons.append(f"{first.layout.world_size} workers: only {first.layout.short()} fits the batch, "
                       f"{rate_of(first):.1f} workers' worth at its pipeline efficiency; {w} train faster "
                       f"({rate_of(choice):.1f})")
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
    reasons.append(f"{head}: {body}; est. {choice.memory / _GIB:.2f} GiB per device{_budget(c)}")
    if choice.dp_note:
        reasons.append(choice.dp_note)
    if choice.mb_notes:
        reasons.append(f"micro_batch_size={choice.mb} (asked {c.micro_batch_size}): {', '.join(choice.mb_notes)}")
    return Plan(layout=lay, world_size=w, available=world_size, micro_batch_size=choice.mb,
                grad_accum_steps=c.global_batch_size // (choice.mb * lay.dp), memory_bytes=choice.memory,
                reasons=tuple(reasons))


def size_for(offered: int, model: ModelConfig, constraints: Constraints) -> int | None:
    """The most workers of `offered` the job can use (its plan's world size), whatever its min_workers;
    None when no layout fits on any of them. What the coordinator asks before a resize and the
    shared-cluster scheduler before it grants (a worker granted beyond it would sit idle)."""
    try:
        return plan(offered, model, replace(constraints, min_workers=1, max_workers=offered)).world_size
    except ValueError:  # PlanError, or no worker offered at all
        return None
