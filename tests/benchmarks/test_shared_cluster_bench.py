"""benchmarks/shared_cluster.py: two simulated hours of a crowded cluster, checked from the occupancy trace."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

import benchmarks.shared_cluster_sim as sim
from benchmarks.shared_cluster import main, summarize
from benchmarks.shared_cluster_sim import URGENT, SimConfig, SimResult, run_baseline, run_elastron, workload
from service.sharing.scheduler import JobRequest, Phase, schedule

CFG = SimConfig(seed=3, hours=2.0, jobs_per_hour=30.0)


@pytest.fixture(scope="module")
def runs() -> dict[str, SimResult]:
    specs = workload(CFG)
    return {"elastron": run_elastron(CFG, specs), "baseline": run_baseline(CFG, specs)}


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


@pytest.mark.parametrize("system", ["elastron", "baseline"])
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


def test_the_day_is_crowded_enough_to_exercise_both_policies(runs):
    el, base = runs["elastron"].counts, runs["baseline"].counts
    assert el["shrink"] and el["pause"] and el["resume"] and base["eviction"], (el, base)
    assert runs["baseline"].lost > 0


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
    assert "| utilisation" in capsys.readouterr().out
