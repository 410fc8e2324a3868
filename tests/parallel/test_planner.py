"""Pure tests of the layout planner: exhaustive sweeps against a brute-force oracle, plus named cases."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

from models.config import PRESETS, ModelConfig
from parallel.layout import Layout
from parallel.memory import estimate_memory
from parallel.planner import Constraints, Plan, PlanError, plan

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]


def _seq(model: ModelConfig) -> int:
    return min(256, model.max_seq_len)


def _constraint_sets(name: str) -> dict[str, Constraints]:
    """A few constraint families per preset; the tight budget forces splitting the model."""
    model = PRESETS[name]
    seq = _seq(model)
    pure_dp = estimate_memory(model, Layout(), micro_batch_size=1, seq_len=seq)
    return {
        "plain": Constraints(global_batch_size=64, micro_batch_size=4, seq_len=seq),
        "odd_batch": Constraints(global_batch_size=48, micro_batch_size=8, seq_len=seq, dp_mode="replicate"),
        "tight": Constraints(global_batch_size=32, micro_batch_size=2, seq_len=seq,
                             memory_budget_bytes=0.3 * pure_dp, gpus_per_node=4),
        "capped": Constraints(global_batch_size=24, micro_batch_size=4, seq_len=seq, max_tp=2, max_pp=2,
                              min_workers=2, max_workers=40, memory_budget_bytes=0.5 * pure_dp),
        "forced": Constraints(global_batch_size=64, micro_batch_size=4, seq_len=seq, tp=2, pp=2),
        "forced_pp": Constraints(global_batch_size=32, micro_batch_size=4, seq_len=seq, pp=2, max_tp=4),
    }


def _divs(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@cache
def _options(name: str, key: str, w: int) -> tuple[tuple[int, int, int, int], ...]:
    """Brute force: every valid (tp, pp, dp, mb) on exactly w workers, written independently of the planner."""
    m, c = PRESETS[name], _constraint_sets(name)[key]
    out = []
    for tp in _divs(w):
        for pp in _divs(w // tp):
            dp = w // (tp * pp)
            if any(v % tp for v in (m.n_heads, m.n_kv_heads, m.vocab_size, m.ffn_hidden)):
                continue
            if (c.tp and tp != c.tp) or (c.pp and pp != c.pp) or (c.max_tp and tp > c.max_tp):
                continue
            if (c.gpus_per_node and c.gpus_per_node % tp) or pp > m.n_layers or (c.max_pp and pp > c.max_pp):
                continue
            if c.global_batch_size % dp:
                continue
            per_rank = c.global_batch_size // dp
            dp_kw = {"dp_shard": dp} if c.dp_mode == "shard" else {"dp_replicate": dp}
            for mb in _divs(per_rank):
                if mb > c.micro_batch_size or (pp > 1 and per_rank // mb < pp):
                    continue
                mem = estimate_memory(m, Layout(tp=tp, pp=pp, **dp_kw), micro_batch_size=mb, seq_len=c.seq_len)
                if c.memory_budget_bytes is None or mem <= c.memory_budget_bytes:
                    out.append((tp, pp, dp, mb))
    return tuple(out)


def _check_invariants(p: Plan, m: ModelConfig, c: Constraints, offered: int) -> None:
    lay = p.layout
    assert lay.world_size == p.world_size <= offered == p.available
    assert c.min_workers <= p.world_size and (c.max_workers is None or p.world_size <= c.max_workers)
    for v in (m.n_heads, m.n_kv_heads, m.vocab_size, m.ffn_hidden):
        assert v % lay.tp == 0
    assert lay.pp <= m.n_layers
    assert p.grad_accum_steps * p.micro_batch_size * lay.dp == c.global_batch_size
    assert p.micro_batch_size <= c.micro_batch_size
    if lay.pp > 1:
        assert p.grad_accum_steps >= lay.pp
    if c.memory_budget_bytes is not None:
        assert p.memory_bytes <= c.memory_budget_bytes
    if c.gpus_per_node is not None:
        assert c.gpus_per_node % lay.tp == 0
    if c.dp_mode == "shard":
        assert lay.dp_replicate == 1
    else:
        assert lay.dp_shard == 1
    if p.world_size < offered:
        assert f"using {p.world_size} of {offered} workers offered" in p.reasons
    assert any(r.startswith(f"tp={lay.tp}") for r in p.reasons)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_sweep_matches_brute_force(name: str) -> None:
    m = PRESETS[name]
    for key, c in _constraint_sets(name).items():
        for offered in range(1, 65):
            top = min(offered, c.max_workers or offered)
            usable = [w for w in range(top, c.min_workers - 1, -1) if _options(name, key, w)]
            if not usable:
                with pytest.raises(PlanError):
                    plan(offered, m, c)
                continue
            p = plan(offered, m, c)
            _check_invariants(p, m, c, offered)
            # per count, the preferred option (smallest tp, then pp, largest mb); across counts the largest
            # unless a smaller one's pipeline-efficiency rate beats it by more than 1%
            preferred = {w: min(_options(name, key, w), key=lambda o: (o[0], o[1], -o[3])) for w in usable}

            def speed(w: int) -> float:
                tp, pp, dp, mb = preferred[w]
                k = c.global_batch_size // (mb * dp)
                return w * k / (k + pp - 1)

            want = usable[0]
            for w in usable[1:]:
                if speed(w) > speed(want) * 1.01:
                    want = w
            assert p.world_size == want, (name, key, offered)
            got = (p.layout.tp, p.layout.pp, p.layout.dp, p.micro_batch_size)
            assert got == preferred[want], (name, key, offered)


def test_tiny_memory_known_value() -> None:
    m = PRESETS["tiny"]
    assert m.num_params() == 853_120
    # state 853_120 * (4 + 4 + 8) + act 4 layers * 4 * 128 * 128 * 68 + logits 4 * 128 * 256 * 4
    expected = 853_120 * 16 + 4 * 4 * 128 * 128 * 68 + 4 * 128 * 256 * 4
    assert expected == 32_000_000
    assert estimate_memory(m, Layout(), micro_batch_size=4, seq_len=128) == expected
    # bf16 weights add an fp32 master copy (2 + 4 + 8 + 4 = 18 bytes per parameter) and halve activations.
    bf16 = 853_120 * 18 + 4 * 4 * 128 * 128 * 34 + 4 * 128 * 256 * 4
    assert estimate_memory(m, Layout(), micro_batch_size=4, seq_len=128, param_bytes=2) == bf16


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_memory_monotone(name: str) -> None:
    m = PRESETS[name]
    degrees = (1, 2, 4)

    def mem(tp: int, pp: int, shard: int, rep: int = 1, mb: int = 2) -> float:
        lay = Layout(tp=tp, pp=pp, dp_shard=shard, dp_replicate=rep)
        return estimate_memory(m, lay, micro_batch_size=mb, seq_len=_seq(m))

    for tp in degrees:
        for pp in degrees:
            for sh in degrees:
                base = mem(tp, pp, sh)
                assert mem(2 * tp, pp, sh) < base
                if 2 * pp <= m.n_layers:
                    assert mem(tp, 2 * pp, sh) < base
                assert mem(tp, pp, 2 * sh) < base
                assert mem(tp, pp, sh, rep=2) == base  # replicas hold full copies
                assert mem(tp, pp, sh, mb=4) > base


def test_forced_tp_on_seven_workers_uses_six() -> None:
    c = Constraints(global_batch_size=16, micro_batch_size=4, seq_len=128, tp=2)
    p = plan(7, PRESETS["tiny"], c)
    assert p.world_size == 6 and p.available == 7 and p.layout.tp == 2
    assert "7 workers: tp=2 (forced) needs a multiple of 2" in p.reasons
    assert any("7" in r and "6" in r for r in p.reasons)


def test_budget_forces_split_for_8b() -> None:
    m = PRESETS["8b"]
    roomy = plan(8, m, Constraints(global_batch_size=64, micro_batch_size=2, seq_len=2048,
                                   memory_budget_bytes=80 * GIB))
    assert (roomy.layout.tp, roomy.layout.pp, roomy.layout.dp_shard) == (1, 1, 8)
    assert "pure data parallelism" in roomy.reasons[-1]
    c = Constraints(global_batch_size=64, micro_batch_size=2, seq_len=2048, memory_budget_bytes=30 * GIB)
    tight = plan(8, m, c)
    assert tight.world_size == 8 and (tight.layout.tp > 1 or tight.layout.pp > 1)
    assert tight.memory_bytes <= 30 * GIB
    assert any("> budget 30.00 GiB" in r for r in tight.reasons)
    pure = estimate_memory(m, Layout(dp_shard=8), micro_batch_size=1, seq_len=2048)
    assert pure > 30 * GIB  # the split was necessary, not a preference


def test_gpus_per_node_limits_tp() -> None:
    m = PRESETS["8b"]
    unlimited = dict(global_batch_size=64, micro_batch_size=1, seq_len=2048)
    base = dict(unlimited, memory_budget_bytes=22 * GIB)
    free = plan(8, m, Constraints(**base, max_pp=1))
    assert free.layout.tp == 4
    with pytest.raises(PlanError, match="gpus_per_node"):
        plan(8, m, Constraints(**base, max_pp=1, gpus_per_node=2))
    node2 = plan(8, m, Constraints(**base, gpus_per_node=2))
    assert node2.layout.tp <= 2 and node2.layout.pp > 1 and node2.world_size == 8
    # a node of 3 devices cannot hold any tp > 1 group of a 32-head model
    assert plan(6, m, Constraints(**unlimited, gpus_per_node=3)).layout.tp == 1
    assert plan(8, m, Constraints(**unlimited, tp=8)).layout.tp == 8
    with pytest.raises(PlanError):
        plan(8, m, Constraints(**unlimited, tp=8, gpus_per_node=4))


def test_dp_mode_replicate() -> None:
    m = PRESETS["small"]
    shard = plan(4, m, Constraints(global_batch_size=16, micro_batch_size=4, seq_len=128))
    rep = plan(4, m, Constraints(global_batch_size=16, micro_batch_size=4, seq_len=128, dp_mode="replicate"))
    assert shard.layout == Layout(dp_shard=4)
    assert rep.layout == Layout(dp_replicate=4)
    assert rep.memory_bytes > shard.memory_bytes


def test_plan_error_when_min_workers_cannot_be_met() -> None:
    m = PRESETS["tiny"]
    with pytest.raises(PlanError, match="min_workers=3"):
        plan(2, m, Constraints(global_batch_size=16, micro_batch_size=4, seq_len=128, min_workers=3))
    c = Constraints(global_batch_size=16, micro_batch_size=4, seq_len=128, min_workers=5, max_tp=1, max_pp=1)
    with pytest.raises(PlanError) as err:
        plan(7, m, c)
    msg = str(err.value)
    assert "\n" not in msg and "7 down to 5" in msg and "global_batch_size=16" in msg and "to fix" in msg
    assert plan(7, m, Constraints(global_batch_size=16, micro_batch_size=4, seq_len=128, min_workers=4,
                                  max_tp=1, max_pp=1)).world_size == 4


def test_max_workers_cap() -> None:
    c = Constraints(global_batch_size=64, micro_batch_size=4, seq_len=128, max_workers=8)
    p = plan(64, PRESETS["tiny"], c)
    assert p.world_size == 8 and p.available == 64 and p.layout == Layout(dp_shard=8)
    assert "64 workers offered; max_workers=8 caps the plan at 8" in p.reasons


def test_micro_batch_shrinks_for_pipeline() -> None:
    c = Constraints(global_batch_size=8, micro_batch_size=8, seq_len=128, pp=4)
    p = plan(4, PRESETS["tiny"], c)
    assert (p.layout.pp, p.micro_batch_size, p.grad_accum_steps) == (4, 2, 4)
    assert any("pp=4 needs >= 4 microbatches" in r for r in p.reasons)
    with pytest.raises(PlanError, match="pp=4 needs >= 4 microbatches"):
        plan(4, PRESETS["tiny"], Constraints(global_batch_size=2, micro_batch_size=2, seq_len=128, pp=4))


def test_to_dict_is_json() -> None:
    p = plan(6, PRESETS["tiny"], Constraints(global_batch_size=12, micro_batch_size=2, seq_len=64))
    d = json.loads(json.dumps(p.to_dict()))
    assert Layout.from_dict(d["layout"]) == p.layout
    assert d["world_size"] == 6 and d["grad_accum_steps"] == p.grad_accum_steps and d["reasons"] == list(p.reasons)
    assert Plan.from_dict(d) == p  # what crosses to the workers is the whole plan


@pytest.mark.parametrize("kwargs", [
    dict(global_batch_size=0, micro_batch_size=1, seq_len=8),
    dict(global_batch_size=8, micro_batch_size=1, seq_len=8, dp_mode="mirror"),
    dict(global_batch_size=8, micro_batch_size=1, seq_len=8, min_workers=4, max_workers=2),
    dict(global_batch_size=8, micro_batch_size=1, seq_len=8, tp=4, max_tp=2),
    dict(global_batch_size=8, micro_batch_size=1, seq_len=8, memory_budget_bytes=0),
    dict(global_batch_size=8, micro_batch_size=True, seq_len=8),
])
def test_constraints_reject_bad_input(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Constraints(**kwargs)


def test_plan_rejects_bad_input() -> None:
    m, c = PRESETS["tiny"], Constraints(global_batch_size=8, micro_batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="world_size"):
        plan(0, m, c)
    with pytest.raises(ValueError, match="max_seq_len"):
        plan(2, m, Constraints(global_batch_size=8, micro_batch_size=1, seq_len=4096))
    with pytest.raises(ValueError, match="n_layers"):
        estimate_memory(m, Layout(pp=8), micro_batch_size=1, seq_len=8)


def test_import_is_pure() -> None:
    code = "import sys, parallel.planner; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# -- forced layouts: the same rules, judged by plan() ----------------------------------------------------------

FORCED = [Layout(dp_shard=d, tp=t, pp=p) for d in (1, 2, 3, 4) for t in (1, 2, 3, 4) for p in (1, 2, 4, 8)] + [
    Layout(dp_replicate=2, dp_shard=2), Layout(dp_replicate=2, tp=2, pp=2)]


def _forced_oracle(m: ModelConfig, c: Constraints) -> int | None:
    """Brute force: the micro batch a forced layout must get, or None when a rule refuses it."""
    lay = c.layout
    if any(v % lay.tp for v in (m.n_heads, m.n_kv_heads, m.vocab_size, m.ffn_hidden)) or lay.pp > m.n_layers:
        return None
    if c.global_batch_size % lay.dp:
        return None
    per_rank = c.global_batch_size // lay.dp
    legal = [mb for mb in _divs(per_rank)[::-1] if mb <= c.micro_batch_size and per_rank // mb >= lay.pp]
    if not legal:
        return None
    fits = [mb for mb in legal if c.memory_budget_bytes is None or c.memory_budget_bytes >= estimate_memory(
        m, lay, micro_batch_size=mb, seq_len=c.seq_len)]
    return fits[0] if fits else legal[-1]  # a forced layout is never refused for memory


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_forced_layouts_match_brute_force(name: str) -> None:
    m = PRESETS[name]
    budget = estimate_memory(m, Layout(dp_shard=2, tp=2), micro_batch_size=2, seq_len=_seq(m))
    for lay in FORCED:
        for gbs, mb, mem in ((16, 4, None), (24, 8, budget), (8, 8, None), (6, 2, budget)):
            c = Constraints(global_batch_size=gbs, micro_batch_size=mb, seq_len=_seq(m), layout=lay,
                            memory_budget_bytes=mem)
            want = _forced_oracle(m, c)
            if want is None:
                with pytest.raises(PlanError):
                    plan(lay.world_size + 1, m, c)
                continue
            p = plan(lay.world_size + 1, m, c)
            assert (p.layout, p.world_size, p.available, p.micro_batch_size) == (lay, lay.world_size,
                                                                                 lay.world_size + 1, want)
            assert p.grad_accum_steps * p.micro_batch_size * lay.dp == gbs
            assert f"using {lay.world_size} of {lay.world_size + 1} workers offered" in p.reasons
            assert any(r.startswith(f"layout {lay} forced by the job") for r in p.reasons)


@pytest.mark.parametrize("layout,kw,needle", [
    ("tp=3", {}, "tp=3 does not divide the model's n_heads=4; use a tp that does"),
    ("dp=3", {"global_batch_size": 4}, "dp=3 does not divide train.global_batch_size=4; use a dp that does, or "
                                       "another batch"),
    ("dp=2,pp=4", {"global_batch_size": 4}, "pp=4 needs >= 4 microbatches per step but dp=2 leaves 2 samples per "
                                            "DP rank; raise train.global_batch_size or lower dp or pp"),
    ("pp=8", {}, "pp=8 exceeds the model's n_layers=4"),
    ("tp=2", {"max_tp": 1}, "tp=2 exceeds max_tp=1"),
    ("tp=2", {"gpus_per_node": 1}, "tp=2 does not divide gpus_per_node=1 (a TP group stays in one node)"),
])
def test_a_forced_layout_that_breaks_a_rule_is_one_line_naming_it(layout: str, kw: dict, needle: str) -> None:
    c = Constraints(**{"global_batch_size": 16, "micro_batch_size": 4, "seq_len": 64, **kw},
                    layout=Layout.parse(layout))
    with pytest.raises(PlanError) as err:
        plan(16, PRESETS["tiny"], c)
    assert str(err.value) == needle


def test_a_forced_layout_needs_its_workers_and_ignores_the_worker_range() -> None:
    c = Constraints(global_batch_size=16, micro_batch_size=4, seq_len=64, layout=Layout(dp_shard=2, tp=2),
                    min_workers=1, max_workers=2)
    with pytest.raises(PlanError, match=r"forced layout dp=2,tp=2,pp=1 needs 4 workers, 3 offered"):
        plan(3, PRESETS["tiny"], c)
    assert plan(4, PRESETS["tiny"], c).world_size == 4  # max_workers=2 does not apply


def test_a_forced_layout_shrinks_its_micro_batch_to_the_budget_but_is_never_refused_for_memory() -> None:
    m, lay = PRESETS["tiny"], Layout()
    mem = {mb: estimate_memory(m, lay, micro_batch_size=mb, seq_len=16) for mb in (1, 2, 4)}
    base = dict(global_batch_size=8, micro_batch_size=4, seq_len=16, layout=lay)
    fits = plan(1, m, Constraints(**base, memory_budget_bytes=(mem[1] + mem[2]) / 2))
    assert (fits.micro_batch_size, fits.grad_accum_steps) == (1, 8)
    assert "micro_batch_size=1 (asked 4): smaller to fit the memory budget" in fits.reasons
    over = plan(1, m, Constraints(**base, memory_budget_bytes=mem[1] / 2))
    assert over.micro_batch_size == 1 and over.memory_bytes == mem[1] > over.memory_bytes / 2
    assert any("still over the memory budget" in r for r in over.reasons)


def test_constraints_take_a_forced_layout_or_forced_degrees_not_both() -> None:
    with pytest.raises(ValueError, match="fixes tp and pp"):
        Constraints(global_batch_size=8, micro_batch_size=1, seq_len=8, layout=Layout(tp=2), tp=2)
    with pytest.raises(ValueError, match="must be a Layout"):
        Constraints(global_batch_size=8, micro_batch_size=1, seq_len=8, layout="tp=2")


# -- bounded work --------------------------------------------------------------------------------------------

def test_huge_model_sizes_and_worker_counts_plan_in_bounded_time() -> None:
    """No loop runs to the square root of a model size: a gcd of 2**60 heads/vocab/ffn would take a
    billion steps to factor. Worker counts that cannot split are skipped without a look."""
    huge = ModelConfig(dim=2**61, n_layers=10**12, n_heads=2**60, n_kv_heads=2**60, vocab_size=2**60,
                       ffn_hidden=2**60, max_seq_len=64)
    t0 = time.perf_counter()
    p = plan(100_000, huge, Constraints(global_batch_size=2**24, micro_batch_size=2**10, seq_len=64))
    assert p.world_size == 100_000 and p.layout.dp * p.layout.tp * p.layout.pp == 100_000
    # a budget nothing fits: the planner judges a bounded number of counts, and says so
    with pytest.raises(PlanError, match=r"judged the 64 largest counts"):
        plan(100_000, huge, Constraints(global_batch_size=2**24, micro_batch_size=2**10, seq_len=64,
                                        memory_budget_bytes=1))
    # a batch with few divisors: most counts cannot split and are never tried one by one
    assert plan(100_000, PRESETS["tiny"], Constraints(global_batch_size=16777213, micro_batch_size=1,
                                                      seq_len=64, max_tp=1, max_pp=1)).world_size == 1
    assert time.perf_counter() - t0 < 5.0  # in practice ~0.1 s; minutes before the search was bounded


def test_dp_mode_auto_replicates_on_cpu_and_where_a_budget_holds_the_replicas() -> None:
    m = PRESETS["small"]
    base = dict(global_batch_size=16, micro_batch_size=4, seq_len=128, dp_mode="auto")
    cpu = plan(4, m, Constraints(**base, device_type="cpu"))
    assert cpu.layout == Layout(dp_replicate=4)
    assert any("dp_mode auto: replicate" in r and "CPU" in r for r in cpu.reasons)
    # No budget on a GPU (or an unknown device) keeps today's choice: shard.
    for device in ("cuda", None):
        p = plan(4, m, Constraints(**base, device_type=device))
        assert p.layout == Layout(dp_shard=4), device
        assert any("dp_mode auto: shard" in r for r in p.reasons)
    shard = plan(4, m, Constraints(**{**base, "dp_mode": "shard"}))
    rep = plan(4, m, Constraints(**{**base, "dp_mode": "replicate"}))
    # A budget decides on any device: replicas when they fit at the micro batch sharding gets ...
    roomy = plan(4, m, Constraints(**base, device_type="cuda", memory_budget_bytes=rep.memory_bytes))
    assert roomy.layout == Layout(dp_replicate=4) and roomy.micro_batch_size == shard.micro_batch_size
    # ... FSDP when they do not, on CPU too (sharding is what makes it fit).
    tight = Constraints(**base, device_type="cpu", memory_budget_bytes=(rep.memory_bytes + shard.memory_bytes) / 2)
    p = plan(4, m, tight)
    assert p.layout == Layout(dp_shard=4) and p.micro_batch_size == shard.micro_batch_size
    assert any("replicas would need" in r for r in p.reasons)


def test_dp_mode_auto_keeps_tp_and_pp_and_leaves_dp1_alone() -> None:
    m = PRESETS["small"]
    base = dict(global_batch_size=16, micro_batch_size=4, seq_len=128, dp_mode="auto", device_type="cpu")
    assert plan(4, m, Constraints(**base, tp=2)).layout == Layout(dp_replicate=2, tp=2)
    assert plan(2, m, Constraints(**base, tp=2)).layout == Layout(tp=2)
    assert plan(1, m, Constraints(**base)).layout == Layout()
    # A forced layout is what it says: "dp=2" under auto is dp_shard=2, as before.
    forced = Layout.parse("dp=2", dp_mode="auto")
    assert forced == Layout(dp_shard=2)
    assert plan(2, m, Constraints(**base, layout=forced)).layout == forced


def test_device_type_is_checked() -> None:
    with pytest.raises(ValueError, match="device_type"):
        Constraints(global_batch_size=8, micro_batch_size=1, seq_len=8, device_type="tpu")


@pytest.mark.parametrize("n", [1, 2, 12, 97, 1 << 24, 14414400, 2**32 + 15, 2**40])
def test_the_remembered_divisors_are_every_divisor_up_to_the_limit(n):
    from parallel.planner import _divisors_upto
    for limit in (0, 1, 5, 64, 4096, 1 << 20):
        want = [d for d in range(1, min(limit, n) + 1) if n % d == 0] if limit <= 4096 or n < 2**32 else None
        got = _divisors_upto(n, limit)
        assert got == sorted(got) and all(n % d == 0 and d <= limit for d in got)
        if want is not None:
            assert got == want
