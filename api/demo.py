"""`elastron demo`: an elastic run on simulated nodes, with nothing but this machine.

A local Ray cluster (`ray.cluster_utils.Cluster`: a head with no worker slots and one 1-CPU node per
worker) trains the tiny model on the Python standard library's source. While it trains, the demo sends
a preemption notice (drain with a deadline) to one node, kills another without notice, then adds
capacity back — and prints the layout timeline with each reconfiguration's time, steps redone or lost,
and the loss just before and after.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from api.progress import Progress, reconfig_table
from api.render import line_chart

DEMO_CONFIG = {
    "name": "demo",
    "model": {"preset": "tiny"},
    "data": {"source": "corpus", "seq_len": 64, "max_bytes": 2_000_000},
    "train": {"steps": 100, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 4},
    "parallel": {"min_workers": 1, "max_workers": 4},
    "checkpoint": {"interval_steps": 5, "keep_last": 3},
    "resources": {"device": "cpu", "cpus_per_worker": 1},
}


def _wait(cond, timeout: float, what: str, coord) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if coord.state.name.is_terminal:
            raise RuntimeError(f"job ended ({coord.state.name}: {coord.state.reason}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


class _Pace:
    """Slows the coordinator's loop, `pace_s` per iteration, from `start()` until `done(coord)` or for at
    most `cap_s`: the tiny model's remaining steps take a few seconds, about what Ray takes to start
    a node and the coordinator to settle on it, so unpaced the job could end before the capacity it is
    given back joins (it did in one of two runs). Only the wall clock changes: what the coordinator
    decides and what the workers compute are the same."""

    def __init__(self, done, *, pace_s: float = 1.0, cap_s: float = 120.0) -> None:
        self.done, self.pace_s, self.cap_s = done, pace_s, cap_s
        self.since: float | None = None

    def start(self) -> None:
        self.since = time.monotonic()

    def __call__(self, coord) -> None:  # runs between the coordinator's iterations (its on_tick)
        if self.since is None or time.monotonic() - self.since > self.cap_s or self.done(coord):
            return
        time.sleep(self.pace_s)


def run_demo(*, steps: int = 100, workers: int = 4, run_dir: str | None = None, layout: str | None = None,
             json_path: str | None = None) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from service.pool.cluster import drain_node, kill_node
    from service.control.job import Job
    from service.server.driver import JobRunner
    from service.server.specs import validate_spec

    if steps < 20 or workers < 3:
        raise ValueError(f"the demo needs --steps >= 20 and --workers >= 3 to show its events, "
                         f"got steps={steps}, workers={workers}")
    if layout is not None:
        raise ValueError("the demo plans its own layouts; use `elastron run --layout` to force one")
    cfg_dict = json.loads(json.dumps(DEMO_CONFIG))
    cfg_dict["train"]["steps"] = steps
    cfg_dict["parallel"]["max_workers"] = workers
    cfg = validate_spec(cfg_dict)  # parsed once, as the REST API would; the runner gets the JobConfig
    rd = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="elastron-demo-"))
    print(f"elastron demo: {workers} simulated nodes, tiny model on the stdlib corpus, {steps} steps, run dir {rd}",
          flush=True)
    t_start = time.time()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(workers)]
        ray.init(address=cluster.address, log_to_driver=False)
        progress = Progress(steps)
        pace = _Pace(lambda c: c.plan is not None and c.plan.world_size == workers)
        runner = JobRunner(Job.of(cfg, job_id="demo", run_dir=rd),
                           options={"settle_seconds": 2.0, "chunk_seconds": 0.3, "poll_interval_s": 0.25},
                           on_tick=lambda c: (progress.update(c.status()), pace(c)))
        coord = runner.coord

        def at_step(n):
            _wait(lambda: coord.step_done >= n and str(coord.state.name) == "RUNNING", 300, f"step {n}", coord)

        def reconfigured(k):
            _wait(lambda: len(coord.reconfigs) >= k, 300, "the reconfiguration", coord)

        # All simulated nodes share one IP, so the driver may be attached to any of their raylets:
        # never drain or kill that one (it would take the driver down with it).
        driver_node = ray.get_runtime_context().get_node_id()
        candidates = [n for n in nodes if n.node_id != driver_node]
        at_step(steps // 5)
        victim = next(n for n in candidates if n.node_id in coord.group.nodes())
        print(f"\n>>> preemption notice: draining node {victim.node_id[:8]} (deadline 30 s)", flush=True)
        drain_node(victim.node_id, message="elastron demo: spot reclaim", deadline_remaining_s=30)
        reconfigured(2)
        at_step(steps * 3 // 10)
        victim2 = next(n for n in candidates if n is not victim and n.node_id in coord.group.nodes())
        print(f"\n>>> node {victim2.node_id[:8]} killed without notice", flush=True)
        kill_node(cluster, victim2)
        reconfigured(3)
        at_step(steps // 2)
        print("\n>>> capacity added back: 2 nodes join (steps paced until the job has grown onto them)", flush=True)
        pace.start()
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        runner.join(timeout=600)
        progress.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return _summary(runner, rd, t_start, json_path)


def _summary(runner, rd: Path, t_start: float, json_path: str | None) -> int:
    st = runner.status()
    recs = runner.reconfigs()
    losses = [m["loss"] for m in runner.metrics_since(0)]
    print()
    print(line_chart(losses, label="loss"))
    print()
    print("layout timeline:")
    print(reconfig_table(recs))
    wall = time.time() - t_start
    print(f"\njob {st.state} at step {st.step}/{st.total_steps}, final loss "
          f"{st.loss:.4f}, {wall:.0f} s wall; events in {rd / 'events.jsonl'}")
    if json_path:
        Path(json_path).write_text(json.dumps({"status": st.to_dict(), "reconfigs": recs, "losses": losses, "wall_s": wall},
                                              indent=2, default=str))
    return 0 if st.state == "SUCCEEDED" else 1
