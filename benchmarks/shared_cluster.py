"""A simulated day on a shared cluster: Elastron's scheduler (shrink first, pause last) against whole-job
preemption (Kueue-style), gang-scheduled and with partial admission, all on the same seeded stream of
jobs (issue 16, deliverable 7; the partial-admission baseline: issue 29, item 10).

    .venv/bin/python benchmarks/shared_cluster.py [--seed 0] [--hours 24] [--resize-s 30] \
        [--checkpoint-interval-s 1800] [--restart-s 120] [--jobs-per-hour 7] [--no-baseline-preemption] \
        [--out out.json]

No Ray and no sleeping: a discrete-event clock jumps from event to event (arrivals, completions, the end
of a resize, restart or release). Cluster: `--nodes` x `--workers-per-node` (16 x 8 = 128 one-CPU workers).

The model (workload, the policies and what they assume): benchmarks/shared_cluster_sim.py.

Metrics: arrival -> workers held for the urgent jobs (median, p95, max); utilisation = useful work
done within the day (work later lost to an eviction does not count) / (workers x day); workers held
but not progressing (resizes, restarts); work lost; mean job completion time (arrival -> done). The run
goes on after the day, without arrivals, until every job is done. Targets (issue 16): an urgent job is
admitted within one `--resize-s` of its arrival when shrinking could free its minimum then; utilisation
>= both baselines'; work lost <= 10% of either baseline's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.shared_cluster_sim import (  # noqa: E402
    URGENT, JobSpec, SimConfig, SimResult, run_baseline, run_elastron, workload)

WORK_LOST_FRACTION = 0.10


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (nan for no data)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def summarize(res: SimResult, cfg: SimConfig) -> dict:
    waits = [r.granted_at - r.spec.arrival for r in res.runs if r.spec.priority == URGENT]
    shrinkable = [r.granted_at - r.spec.arrival for r in res.runs
                  if r.spec.priority == URGENT and r.shrink_could_admit]
    jct = [r.finished_at - r.spec.arrival for r in res.runs]
    urgent_jct = [r.finished_at - r.spec.arrival for r in res.runs if r.spec.priority == URGENT]
    denom = cfg.capacity * cfg.day_s
    out = {
        "urgent_jobs": len(waits),
        "urgent_wait_s": {"median": _pct(waits, 0.5), "p95": _pct(waits, 0.95), "max": _pct(waits, 1.0)},
        "utilisation": res.useful_day / denom,
        "held": res.held_day / denom,
        "idle_held_worker_s": res.idle_held,
        "work_lost_worker_s": res.lost,
        "mean_jct_h": statistics.fmean(jct) / 3600 if jct else float("nan"),
        "mean_urgent_jct_h": statistics.fmean(urgent_jct) / 3600 if urgent_jct else float("nan"),
        "last_done_h": res.end / 3600,
        "counts": dict(res.counts),
    }
    if res.system == "elastron":
        out["urgent_shrinkable"] = len(shrinkable)
        out["urgent_shrinkable_within_resize"] = sum(w <= cfg.resize_s + 1e-6 for w in shrinkable)
        out["schedule_calls"] = len(res.sched_s)
        out["schedule_ms"] = {"mean": 1e3 * statistics.fmean(res.sched_s) if res.sched_s else 0.0,
                              "max": 1e3 * max(res.sched_s, default=0.0)}
    return out


BASELINES = {"gang": "Kueue-style, gang (whole job at max_workers)",
             "partial": "Kueue-style, partial admission (size fixed at admission)"}


def targets(el: dict, bases: dict[str, dict]) -> dict[str, bool]:
    """Elastron's targets, each against the stronger baseline for it (the higher utilisation, the less
    work lost)."""
    return {
        "urgent_admitted_within_resize": el["urgent_shrinkable_within_resize"] == el["urgent_shrinkable"],
        "utilisation_ge_baseline": el["utilisation"] >= max(b["utilisation"] for b in bases.values()),
        "work_lost_le_10pct_of_baseline": el["work_lost_worker_s"] <= WORK_LOST_FRACTION * min(
            b["work_lost_worker_s"] for b in bases.values()),
    }


def render(el: dict, bases: dict[str, dict], cfg: SimConfig, specs: list[JobSpec], *, preempt: bool = True) -> str:
    ok = targets(el, bases)
    offered = sum(s.work for s in specs) / (cfg.capacity * cfg.day_s)
    kinds = {k: sum(s.kind == k for s in specs) for k in ("batch", "team", "urgent")}
    cols = [el, *bases.values()]

    def waits(d: dict) -> str:
        return " / ".join(f"{d['urgent_wait_s'][k]:.0f}" for k in ("median", "p95", "max"))

    def mark(key: str) -> str:
        return "met" if ok[key] else "**missed**"

    def decisions(d: dict) -> str:
        c = d["counts"]
        if "eviction" in c:
            return f"{c['eviction']} evictions, {c['partial admission']} admissions below max_workers"
        return ", ".join(f"{v} {k}s" for k, v in c.items())

    rows = [
        ("urgent jobs: arrival → workers, median / p95 / max (s)", *map(waits, cols), ""),
        (f"urgent jobs shrinking could admit: held workers within {cfg.resize_s:g} s",
         f"{el['urgent_shrinkable_within_resize']} of {el['urgent_shrinkable']}", *([""] * len(bases)),
         f"all ({mark('urgent_admitted_within_resize')})"),
        ("utilisation (useful work / capacity, day)", *(f"{d['utilisation']:.1%}" for d in cols),
         f">= both baselines ({mark('utilisation_ge_baseline')})"),
        ("workers held (day)", *(f"{d['held']:.1%}" for d in cols), ""),
        ("held, no progress: resizes, restarts (worker-h)", *(f"{d['idle_held_worker_s'] / 3600:.1f}" for d in cols),
         ""),
        ("work lost (worker-h)", *(f"{d['work_lost_worker_s'] / 3600:.1f}" for d in cols),
         f"<= 10% of either baseline ({mark('work_lost_le_10pct_of_baseline')})"),
        ("mean job completion time, all / urgent (h)",
         *(f"{d['mean_jct_h']:.2f} / {d['mean_urgent_jct_h']:.2f}" for d in cols), ""),
        ("last job done (h)", *(f"{d['last_done_h']:.1f}" for d in cols), ""),
        ("decisions", *map(decisions, cols), ""),
    ]
    head = (f"{len(specs)} jobs ({kinds['batch']} batch p0, {kinds['team']} team p5, {kinds['urgent']} urgent "
            f"p{URGENT}) over {cfg.hours:g} h on {cfg.nodes} x {cfg.workers_per_node} workers, offered load "
            f"{offered:.0%}; resize {cfg.resize_s:g} s, restart {cfg.restart_s:g} s, baseline checkpoint every "
            f"{cfg.checkpoint_interval_s:g} s{'' if preempt else ', baselines without preemption'}; schedule(): "
            f"{el['schedule_calls']} calls, mean {el['schedule_ms']['mean']:.1f} ms, max "
            f"{el['schedule_ms']['max']:.1f} ms\n\n")
    names = [BASELINES[k] for k in bases]
    lines = [f"| metric | Elastron (shrink first) | {' | '.join(names)} | target |",
             "|---|---|" + "---|" * len(bases) + "---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = SimConfig()
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--hours", type=float, default=d.hours)
    ap.add_argument("--resize-s", type=float, default=d.resize_s)
    ap.add_argument("--checkpoint-interval-s", type=float, default=d.checkpoint_interval_s)
    ap.add_argument("--restart-s", type=float, default=d.restart_s)
    ap.add_argument("--jobs-per-hour", type=float, default=d.jobs_per_hour)
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument("--workers-per-node", type=int, default=d.workers_per_node)
    ap.add_argument("--no-baseline-preemption", action="store_true",
                    help="baselines never evict (Kueue's withinClusterQueue: Never): urgent jobs wait instead")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    cfg = SimConfig(seed=a.seed, hours=a.hours, resize_s=a.resize_s, checkpoint_interval_s=a.checkpoint_interval_s,
                    restart_s=a.restart_s, jobs_per_hour=a.jobs_per_hour, nodes=a.nodes,
                    workers_per_node=a.workers_per_node)
    specs = workload(cfg)
    t0 = time.perf_counter()
    preempt = not a.no_baseline_preemption
    el = summarize(run_elastron(cfg, specs), cfg)
    bases = {"gang": summarize(run_baseline(cfg, specs, preempt=preempt), cfg),
             "partial": summarize(run_baseline(cfg, specs, partial=True, preempt=preempt), cfg)}
    print(render(el, bases, cfg, specs, preempt=preempt))
    print(f"\n(simulated in {time.perf_counter() - t0:.1f} s)")
    if a.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        doc = {"config": asdict(cfg), "commit": commit, "argv": sys.argv[1:] if argv is None else argv,
               "baseline_preemption": preempt, "jobs": [asdict(s) for s in specs], "elastron": el,
               "baseline": bases["gang"], "baseline_partial": bases["partial"], "targets": targets(el, bases)}
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
