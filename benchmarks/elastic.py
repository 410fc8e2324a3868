"""Elastron's coordinator vs Ray Train v2 elastic mode, side by side in one run.

    cd /work/main && .venv/bin/python benchmarks/elastic.py [--scenarios join kill drain] [--json out.json]

Same simulated cluster (a head with no worker slots, 1-CPU worker nodes added per scenario), same model
(tiny preset), same data (byte corpus of the stdlib, seq_len 32, global batch 12), checkpoint every 5
steps. Per scenario, with the event at step ~10:
  join   2 nodes, then one joins:           event -> first step at world size 3
  kill   3 nodes, one removed without notice: event -> first step at world size 2
  drain  3 nodes, one drained (preemption, 60 s deadline): event -> first step without that node
and the steps redone or lost. Elastron grows after `--settle` seconds of stable capacity (default 1 s);
Ray Train's elastic monitor interval is set to 5 s (its default is 60 s), the setting most favourable
to it. Targets: >= 4x faster reconfiguration in each case, 0 steps redone on join and drain.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCENARIOS = ("join", "kill", "drain")
EVENT_STEP = 10


def _cfg(steps: int) -> dict:
    return {
        "model": {"preset": "tiny"},
        "data": {"source": "corpus", "seq_len": 32, "max_bytes": 300_000},
        "train": {"steps": steps, "global_batch_size": 12, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 2},
        "parallel": {"min_workers": 1, "max_workers": 3},
        "checkpoint": {"interval_steps": 5, "keep_last": 2},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def measure_elastron(*, cluster, scenario: str, workdir: str, settle: float = 1.0, steps: int = 200) -> dict:
    import ray

    from service.cluster import drain_node
    from service.coordinator import Coordinator, CoordinatorOptions
    from workers.config import JobConfig

    start_n = 2 if scenario == "join" else 3
    added = [cluster.add_node(num_cpus=1) for _ in range(start_n)]
    cluster.wait_for_nodes()
    coord = Coordinator(JobConfig.from_dict(_cfg(steps)), run_dir=Path(workdir) / f"elastron-{scenario}",
                        options=CoordinatorOptions(settle_seconds=settle, chunk_seconds=0.2, poll_interval_s=0.1))
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    try:
        _wait(lambda: coord.step_done >= EVENT_STEP and str(coord.sm.state) == "RUNNING", 180, "the event step")
        before = coord.group.size
        me = ray.get_runtime_context().get_node_id()
        if scenario == "join":
            added.append(cluster.add_node(num_cpus=1))
            t_event = time.time()
            target = before + 1
        else:
            victim = next(n for n in added if n.node_id in coord.group.nodes() and n.node_id != me)
            t_event = time.time()
            if scenario == "kill":
                cluster.remove_node(victim, allow_graceful=False)
            else:
                drain_node(victim.node_id, message="benchmark: spot reclaim", deadline_remaining_s=60)
            target = before - 1
        n_rc = len(coord.reconfigs)
        # Every reconfiguration after the event counts; the measurement ends at the first step of the
        # one that reaches the target size (intermediate ones, if any, are reported).
        _wait(lambda: any(r.world_size == target for r in coord.reconfigs[n_rc:]), 180, "the reconfiguration")
        after = coord.reconfigs[n_rc:]
        rc = next(r for r in after if r.world_size == target)
        lost = sum(r.steps_lost for r in after[:after.index(rc) + 1])
        step_times = sorted(m["step_time"] for m in coord.metrics_since(0))
        return {"system": "elastron", "scenario": scenario, "event_to_first_step_s": rc.first_step_time - t_event,
                "decided_after_s": after[0].detected - t_event, "steps_redone_or_lost": lost,
                "reconfigurations": [r.to_dict() for r in after],
                "world_size_before": before, "world_size_after": rc.world_size,
                "workers_started": rc.started, "workers_stopped": rc.stopped,
                "step_time_s": step_times[len(step_times) // 2]}
    finally:
        coord.stop()
        t.join(timeout=60)
        for n in added:
            try:
                cluster.remove_node(n, allow_graceful=False)
            except Exception:
                pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--settle", type=float, default=1.0, help="Elastron: stable capacity needed before growing")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from benchmarks.elastic_raytrain import measure_raytrain

    rows = []
    work = tempfile.mkdtemp(prefix="elastic-bench-")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        for sc in args.scenarios:
            ours = measure_elastron(cluster=cluster, scenario=sc, workdir=work, settle=args.settle)
            print(json.dumps(ours), flush=True)
            theirs = measure_raytrain(cluster=cluster, model_steps=30, ckpt_every=5, scenario=sc,
                                      workdir=str(Path(work) / f"raytrain-{sc}"))
            print(json.dumps(theirs), flush=True)
            rows.append((sc, ours, theirs))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("\n| scenario | Elastron: event -> first step | Ray Train v2 | speed-up | steps redone/lost (Elastron / Ray Train) |")
    print("|---|---|---|---|---|")
    for sc, a, b in rows:
        ta, tb = a["event_to_first_step_s"], b["event_to_first_step_s"]
        print(f"| {sc} | {ta:.2f} s | {tb:.1f} s{' (timeout)' if b.get('timed_out') else ''} | "
              f"{tb / ta:.1f}x | {a['steps_redone_or_lost']} / {b['steps_redone_or_lost']} |")
    if args.json:
        Path(args.json).write_text(json.dumps([{"scenario": sc, "elastron": a, "raytrain": b} for sc, a, b in rows],
                                              indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
