"""A higher-priority job arriving on a full shared cluster, on a real Ray cluster (issue 16 target 1).

Four 1-CPU simulated nodes (`ray.cluster_utils.Cluster`), the job service (JobManager + RayLauncher, the
scheduler on). Jobs a and b (priority 0, 1..2 workers) fill the cluster; an urgent job (priority 10,
2 workers) arrives. The scheduler shrinks a and b to 1 worker each through the planned-resize path and
admits the urgent job once their workers are free. Measured from the jobs' events and metrics:

  - shrink: from the shrink being applied (its "schedule" event, after the step in flight) to the job's
    first step on 1 worker; and from the urgent job's arrival to both jobs' first step on 1 worker: the
    planned resizes its arrival caused, end to end;
  - admission: from the urgent job's submit to its grant ("admitted" event), and to its first step;
  - steps lost by a and b (0 expected: planned resizes redo nothing).

Target: admission within one planned-resize time of arrival: arrival → admitted <= arrival → both shrunk
(the grant waits for the shrunk jobs to release their workers, not for their first step).

    .venv/bin/python benchmarks/shared_cluster_ray.py --preset tiny --reps 3 --out benchmarks/results/shared-cluster-ray.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROUND_S = 0.2


def spec(preset: str, name: str, *, lo: int, hi: int, priority: int = 0, steps: int = 10_000) -> dict:
    return {"name": name, "model": {"preset": preset}, "data": {"source": "corpus", "seq_len": 32, "max_bytes": 300_000},
            "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "seed": 7},
            "parallel": {"min_workers": lo, "max_workers": hi}, "checkpoint": {"interval_steps": 1000},
            "resources": {"device": "cpu", "cpus_per_worker": 1}, "scheduling": {"priority": priority}}


def wait(fn, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not (out := fn()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return out


def one(preset: str, root: Path) -> dict:
    from api.store import JobStore
    from service.control.commands import Stop
    from service.server.job_actor import RayLauncher
    from service.server.job_manager import JobManager

    launcher = RayLauncher(timeout_s=60, options={"settle_seconds": 1000.0, "chunk_seconds": 0.2, "poll_interval_s": 0.2})
    m = JobManager(JobStore(root / "jobs.db"), launcher, runs_root=root / "runs", sync_interval_s=ROUND_S, shared=True)
    m.start()
    try:
        a, b = (m.submit(spec(preset, n, lo=1, hi=2)) for n in ("a", "b"))
        for j in (a, b):
            wait(lambda j=j: (x := m.get(j).status).world_size == 2 and x.step >= 3, f"job {j} on 2 workers")
        arrival = time.time()
        urgent = m.submit(spec(preset, "urgent", lo=2, hi=2, priority=10, steps=5))
        wait(lambda: m.get(urgent).state == "SUCCEEDED", "the urgent job")
        out = {"arrival": arrival}
        for j in (a, b):
            told = next(e["time"] for e in m.events(j) if e["kind"] == "schedule" and e["reason"].startswith("shrunk"))
            first = wait(lambda j=j: next((r["time"] for r in m.metrics(j) if r["time"] > told
                                           and r.get("world_size") == 1), None), f"job {j} on 1 worker")
            out[f"shrink_{j}"] = first - told
            out[f"told_{j}"], out[f"shrunk_{j}"] = told - arrival, first - arrival
        admitted = next(e["time"] for e in m.events(urgent) if e["kind"] == "schedule"  # not "...; waiting for"
                        and e["reason"].startswith("admitted") and e["details"].get("grant"))
        out["admitted_s"] = admitted - arrival
        out["first_step_s"] = m.metrics(urgent)[0]["time"] - arrival
        for j in (a, b):
            m.command(j, Stop())
            wait(lambda j=j: m.get(j).state == "STOPPED", f"job {j} stopped")
        out["steps_lost"] = sum(m.get(j).status.steps_lost for j in (a, b))
        out["shrink_s"] = max(out.pop(f"shrink_{a}"), out.pop(f"shrink_{b}"))
        out["told_s"] = max(out.pop(f"told_{a}"), out.pop(f"told_{b}"))
        out["shrunk_s"] = max(out.pop(f"shrunk_{a}"), out.pop(f"shrunk_{b}"))
        return out
    finally:
        m.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(4):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    runs = []
    try:
        for i in range(args.reps):
            with tempfile.TemporaryDirectory() as d:
                runs.append(one(args.preset, Path(d)))
            print(f"rep {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items() if k != "arrival"),
                  flush=True)
    finally:
        ray.shutdown()
        c.shutdown()

    med = {k: statistics.median(r[k] for r in runs)
           for k in ("told_s", "shrink_s", "shrunk_s", "admitted_s", "first_step_s")}
    ratio = med["admitted_s"] / med["shrunk_s"]
    print(f"\n| {args.preset}, {args.reps} reps (median) | seconds |\n|---|---|")
    print(f"| planned shrink of the running jobs (told → first step on 1 worker, slower of two) | {med['shrink_s']:.2f} |")
    print(f"| arrival → the shrinks told (slower of two) | {med['told_s']:.2f} |")
    print(f"| arrival → both shrunk (first step on 1 worker) | {med['shrunk_s']:.2f} |")
    print(f"| urgent job: arrival → admitted (its grant) | {med['admitted_s']:.2f} |")
    print(f"| urgent job: arrival → first step | {med['first_step_s']:.2f} |")
    print(f"| admitted / the planned resizes it caused (arrival → both shrunk) | {ratio:.2f} |")
    print(f"| steps lost by the shrunk jobs (all reps) | {sum(r['steps_lost'] for r in runs)} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"preset": args.preset, "runs": runs, "median": med, "ratio": ratio},
                                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
