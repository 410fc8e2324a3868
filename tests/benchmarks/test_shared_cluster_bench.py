"""benchmarks/shared_cluster.py: two simulated hours of a crowded cluster, checked from the occupancy trace."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

import benchmarks.shared_cluster_sim as sim
from benchmarks.shared_cluster import main, summarize, targets
from benchmarks.shared_cluster_sim import (
    URGENT, JobSpec, SimConfig, SimResult, admission_size, run_baseline, run_elastron, workload)
from service.sharing.scheduler import JobRequest, Phase, schedule

CFG = SimConfig(seed=3, hours=2.0, jobs_per_hour=30.0)


@pytest.fixture(scope="module")
def runs() -> dict[str, SimResult]:
    specs = workload(CFG)
    return {"elastron": run_elastron(CFG, specs), "baseline": run_baseline(CFG, specs),
            "partial": run_baseline(CFG, specs, partial=True)}


def replay(res: SimResult) -> float:
    """Walk the trace: capacity per node and max_workers hold after every change; returns the integral of
    workers held over time."""
    spec = {r.spec.job_id: r.spec for r in res.runs}
    now: dict[str, dict[str, int]] = {}
    last, held = 0.0, 0.0
    for t, job, nodes in res.trace:
        assert t >= last, f"trace goes back in time at {job}: {t} < {last}"
        held += sum(sum(n.values()) for n in now.values()) * (t - last)
        last = t
        now[job] = dict(nodes)
        assert sum(now[job].values()) <= spec[job].max_workers, (t, job, nodes)
        per_node: dict[str, int] = defaultdict(int)
        for n in now.values():
            for nid, k in n.items():
                per_node[nid] += k
        assert all(per_node[nid] <= cap for nid, cap in res.capacity.items()), (t, dict(per_node))
        assert set(per_node) <= set(res.capacity), per_node
    assert not any(now.values()), "someone still holds workers after the last job is done"
    return held


@pytest.mark.parametrize("system", ["elastron", "baseline", "partial"])
def test_capacity_and_max_never_exceeded_and_every_job_finishes(runs, system):
    res = runs[system]
    held = replay(res)
    assert all(r.finished_at is not None and r.done == r.spec.work for r in res.runs)
    # Every worker-second held is useful work, work later lost, or time spent resizing or restarting.
    total = sum(r.spec.work for r in res.runs)
    assert held == pytest.approx(total + res.lost + res.idle_held, rel=1e-6)


def test_baseline_is_gang_scheduled(runs):
    spec = {r.spec.job_id: r.spec for r in runs["baseline"].runs}
    assert all(sum(k for _, k in nodes) in (0, spec[job].max_workers) for _, job, nodes in runs["baseline"].trace)


def test_partial_baseline_never_resizes_a_running_job(runs):
    """Between its admission and its end or eviction a job holds one size, from min to max_workers."""
    spec = {r.spec.job_id: r.spec for r in runs["partial"].runs}
    held: dict[str, int] = {}
    for _, job, nodes in runs["partial"].trace:
        k = sum(n for _, n in nodes)
        assert k == 0 or held.get(job, 0) == 0, f"{job} went from {held[job]} to {k} workers while running"
        assert k == 0 or spec[job].min_workers <= k <= spec[job].max_workers, (job, k)
        held[job] = k


def test_the_day_is_crowded_enough_to_exercise_every_policy(runs):
    el, base, part = runs["elastron"].counts, runs["baseline"].counts, runs["partial"].counts
    assert el["shrink"] and el["pause"] and el["resume"] and base["eviction"], (el, base)
    assert part["partial admission"] and part["eviction"], part
    assert runs["baseline"].lost > 0 and runs["partial"].lost > 0


SMALL = SimConfig(nodes=8, workers_per_node=8)  # 64 workers: the smallest cluster the workload classes allow


def job(name: str, arrival: float, priority: int, lo: int, hi: int, hours: float) -> JobSpec:
    return JobSpec(job_id=name, kind="batch", arrival=arrival, priority=priority, min_workers=lo, max_workers=hi,
                   work=hi * hours * 3600)


def sizes(res: SimResult) -> dict[str, list[int]]:
    """Every size each job was given, in order (0: released)."""
    out: dict[str, list[int]] = defaultdict(list)
    for _, j, nodes in res.trace:
        out[j].append(sum(n for _, n in nodes))
    return dict(out)


def test_partial_admission_takes_what_fits_and_keeps_it():
    """b (min 2, max 4) finds 3 free: admitted at 3, still 3 once `big` ends and frees 61. c's minimum
    (4) does not fit anywhere and it may not preempt its equal, so it waits for `big`, then gets its max."""
    specs = [job("big", 0, 0, 61, 61, 1.0), job("b", 10, 0, 2, 4, 2.0), job("c", 20, 0, 4, 8, 0.5)]
    res = run_baseline(SMALL, specs, partial=True)
    end_big = next(r for r in res.runs if r.spec.job_id == "big").finished_at
    assert sizes(res) == {"big": [61, 0], "b": [3, 0], "c": [8, 0]}
    granted = {r.spec.job_id: r.granted_at for r in res.runs}
    assert granted["b"] == 10 and granted["c"] == end_big
    assert res.counts == {"eviction": 0, "partial admission": 1}
    gang = run_baseline(SMALL, specs)  # without partial admission b waits for big too
    assert sizes(gang)["b"] == [4, 0] and next(r for r in gang.runs if r.spec.job_id == "b").granted_at == end_big


def test_partial_admission_preempts_for_the_full_size_first_then_for_the_largest_that_fits():
    """Kueue's order: the full count, freely or by evicting lower priorities; only then a smaller count,
    which may also evict. u1 (max 16) evicts `low` for its full 16 rather than start at 4 in the free 4;
    u2 (max 64) cannot reach 64 even by evicting `low2`, so it takes the 44 that evicting it leaves."""
    res = run_baseline(SMALL, [job("low", 0, 0, 60, 60, 5.0), job("u1", 10, URGENT, 4, 16, 0.5)], partial=True)
    assert sizes(res)["u1"] == [16, 0] and sizes(res)["low"][:2] == [60, 0]
    res = run_baseline(SMALL, [job("low2", 0, 0, 40, 40, 5.0), job("mid", 1, URGENT, 20, 20, 5.0),
                               job("u2", 10, URGENT, 8, 64, 0.5)], partial=True)
    assert sizes(res)["u2"][0] == 44 and sizes(res)["low2"][:2] == [40, 0] and sizes(res)["mid"][0] == 20
    assert res.counts["eviction"] >= 1


def test_without_preemption_the_urgent_job_takes_the_free_workers_or_waits():
    specs = [job("low", 0, 0, 60, 60, 5.0), job("u1", 10, URGENT, 4, 16, 0.5), job("u2", 20, URGENT, 8, 16, 0.5)]
    res = run_baseline(SMALL, specs, partial=True, preempt=False)
    low_end = next(r for r in res.runs if r.spec.job_id == "low").finished_at
    assert sizes(res) == {"low": [60, 0], "u1": [4, 0], "u2": [16, 0]} and res.counts["eviction"] == 0
    assert next(r for r in res.runs if r.spec.job_id == "u2").granted_at == low_end


@pytest.mark.parametrize("lo,hi", [(1, 1), (2, 4), (8, 32), (16, 64), (3, 17)])
def test_admission_size_is_the_largest_count_that_fits(lo, hi):
    spec = job("x", 0, 0, lo, hi, 1.0)
    for room in range(hi + 3):
        fits = [k for k in range(lo, hi + 1) if k <= room]
        assert admission_size(spec, room, partial=True) == (max(fits) if fits else None), room
        assert admission_size(spec, room, partial=False) == (hi if room >= hi else None), room


def test_elastron_loses_no_work_and_admits_urgent_jobs_within_one_resize(runs):
    res = runs["elastron"]
    assert res.lost == 0
    urgent = [r for r in res.runs if r.spec.priority == URGENT and r.shrink_could_admit]
    assert urgent
    assert all(r.granted_at - r.spec.arrival <= CFG.resize_s + 1e-9 for r in urgent)
    assert len(res.sched_s) == 2 * len(res.runs)  # one schedule() per arrival and per completion


def test_no_resize_moves_workers_between_nodes(runs):
    """One-CPU workers never fragment a node, so the policy keeps every running job where it is."""
    assert runs["elastron"].counts["moving resize"] == runs["elastron"].counts["same-size move"] == 0


def test_same_seed_same_day():
    specs = workload(CFG)
    assert specs == workload(CFG)
    assert summarize(run_baseline(CFG, specs), CFG) == summarize(run_baseline(CFG, specs), CFG)
    a, b = run_elastron(CFG, specs), run_elastron(CFG, specs)
    assert a.trace == b.trace and a.counts == b.counts


def test_policy_is_idempotent_so_calling_it_only_on_arrivals_and_completions_misses_nothing(monkeypatch):
    calls = []

    def twice(ledger, jobs, quotas=None):
        s = schedule(ledger, jobs, quotas)
        again = [JobRequest(job_id=j.job_id, priority=j.priority, min_workers=j.min_workers,
                            max_workers=j.max_workers, submitted=j.submitted,
                            phase=Phase.RUNNING if s.ledger.held(j.job_id) else
                            Phase.QUEUED if j.phase is Phase.QUEUED else Phase.PAUSED) for j in jobs]
        s2 = schedule(s.ledger, again)
        calls.append(s2.grants + s2.resizes + s2.pauses + s2.returns)
        return s

    monkeypatch.setattr(sim, "schedule", twice)
    run_elastron(CFG, workload(CFG))
    assert calls and not any(calls)


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "day.json"
    assert main(["--hours", "1", "--seed", "1", "--resize-s", "20", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["resize_s"] == 20 and doc["config"]["hours"] == 1
    assert set(doc["targets"]) == {"urgent_admitted_within_resize", "utilisation_ge_baseline",
                                   "work_lost_le_10pct_of_baseline"}
    assert doc["elastron"]["work_lost_worker_s"] == 0
    assert doc["baseline"]["counts"]["partial admission"] == 0 and "baseline_partial" in doc
    out = capsys.readouterr().out
    assert "| utilisation" in out and "partial admission" in out


def test_targets_are_against_the_stronger_baseline():
    el = {"urgent_shrinkable_within_resize": 1, "urgent_shrinkable": 1, "utilisation": 0.80,
          "work_lost_worker_s": 5.0}
    weak = {"utilisation": 0.70, "work_lost_worker_s": 100.0}
    assert all(targets(el, {"gang": weak, "partial": weak}).values())
    ok = targets(el, {"gang": weak, "partial": {"utilisation": 0.81, "work_lost_worker_s": 40.0}})
    assert not ok["utilisation_ge_baseline"] and not ok["work_lost_le_10pct_of_baseline"]
