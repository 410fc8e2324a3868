"""Baseline for Elastron's elastic coordinator: Ray Train v2 elastic mode on the same workload.

Run all three scenarios on a fresh simulated cluster (head with num_cpus=0, 1-CPU worker nodes):

    cd /work/main && .venv/bin/python benchmarks/elastic_raytrain.py [--scenarios join kill drain] \
        [--model-steps 30] [--ckpt-every 5] [--json out.json]

Or import `measure_raytrain` and call it on a live `ray.cluster_utils.Cluster` next to our own
measurement (benchmarks/elastic.py at 1-3 workers on 1-CPU nodes; benchmarks/ranks.py at N workers on
nodes of 2 slots: `nodes`, `slots_per_node`, `max_workers`). Each call adds its own worker nodes and
removes them before returning.

What is measured, per scenario (event at step ~10):
- join:  2 nodes, ScalingConfig(num_workers=(1, 3)); add a node; time from `add_node` returning to the
         first step at world size 3.
- kill:  3 nodes; `service.pool.cluster.kill_node` (raylet, agents and workers at once) on a node hosting a
         worker; time from the kill to the first step of the next worker group (whatever size it settles at).
- drain: 3 nodes; a preemption drain notice (60 s deadline) on a node hosting a worker; the train loop
         does what Ray documents (`get_preemption_info()` -> just-in-time checkpoint, keep training);
         time from the notice to the first step of a group without that node.
`steps_redone_or_lost` = highest step the pre-event group completed - the step the next group resumed
from (its checkpoint): all work thrown away, including steps the old group did after the event.
`moving_state_s` = rank 0's save of the checkpoint the new group resumed from + the slowest rank's load
of it (`save_s`, `load_s`).

The training function is Elastron's workload: a `models` preset (tiny unless `model` says otherwise),
byte corpus from `workers.data`, DDP via `ray.train.torch.prepare_model`, AdamW. Checkpoints are what a
Ray Train user writes with torch.distributed.checkpoint (DCP): every rank `dcp.save`s the
`get_state_dict(model, optimizer)` dicts into its own temporary directory and reports it (Ray merges the
ranks' files into one checkpoint; DCP spreads the replicated DDP state over the ranks), rank 0 adds the
step and data position as JSON; a restarted group `dcp.load`s them and `set_state_dict`s. Rank 0
appends one JSON line per step (and per save) to a file in the run directory; every rank one per start
(when its process started, entered the train function, began loading the checkpoint, was ready);
the driver thread watches it to fire the event and computes the metrics from it. With
RAY_TRAIN_ENABLE_STATE_TRACKING=1 Ray's own record of each attempt (worker group: its start, its end) is
read after the run (`ray_attempts`); with both, `phases` splits event -> first step (`PHASES`).

Ray 2.60 behaviour that shapes the numbers (read in ray/train/v2, seen in runs on the 2-core box):
- Growth is noticed only when the AutoscalingCoordinator actor refreshes its node list (a 20 s tick)
  and the elastic policy next looks (`elastic_resize_monitor_interval_s`); then the group is torn
  down and restarted from the last registered checkpoint.
- After a kill or a drain the coordinator's view is stale, so the first restart asks for 3 workers and
  waits out the 60 s worker-group start timeout before retrying with 2.
- A drain notice reaches the loop in ~4 s, but the controller keeps the old group until the drain
  deadline passes (the documented loop keeps training after its just-in-time checkpoint).
- `ray.train.report` puts into a 1-slot queue that the controller drains every 2 s; a checkpoint
  still in that queue when a worker dies is never registered.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger("elastic_raytrain")

SCENARIOS = ("join", "kill", "drain")
_INITIAL_NODES = {"join": 2, "kill": 3, "drain": 3}
_MAX_WORKERS = 3
_POLL_S = 0.1
_HEALTH_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
_STATE_ENV = "RAY_TRAIN_ENABLE_STATE_TRACKING"


# --------------------------------------------------------------------------------------------------
# What each Ray Train worker runs.
# --------------------------------------------------------------------------------------------------
def _append_jsonl(path: str, record: dict) -> None:
    # One write() per line on an O_APPEND file: lines from several processes never interleave.
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train_loop(config: dict) -> None:
    entered = time.time()  # Ray's backend has built the torch process group before the function runs
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import psutil

    import ray.train
    import ray.train.torch

    from models.config import model_config
    from models.llama import build_model, init_value
    from workers.data import CorpusSource, DataLoader, DataPosition

    torch.set_num_threads(1)  # one core per rank, as torchrun would (FACTS: 2-core box)
    log_path, stop_path = config["log_path"], config["stop_path"]
    ctx = ray.train.get_context()
    rank, ws = ctx.get_world_rank(), ctx.get_world_size()

    # One id for this worker group (attempt): rank 0's start time, shared by broadcast.
    t0 = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(t0, src=0)
    attempt = float(t0.item())

    model_spec = config["model"]
    cfg = model_config(model_spec["preset"], **model_spec.get("overrides", {}))
    seed, gbs = config["seed"], config["global_batch_size"]
    model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_value(cfg, name, tuple(p.shape), seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.1)

    ddp = ray.train.torch.prepare_model(model)
    step, position, load_s = 0, None, None
    load_started = time.time()  # with no checkpoint registered, the load phase is the check for one
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        t_load = time.perf_counter()
        with checkpoint.as_directory() as d:
            msd, osd = get_state_dict(ddp, optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=d)
            set_state_dict(ddp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            with open(os.path.join(d, "extra.json")) as f:
                extra = json.load(f)
        step, position = extra["step"], DataPosition.from_dict(extra["data"])
        load_s = time.perf_counter() - t_load

    source = CorpusSource(None, seq_len=config["seq_len"], max_bytes=300_000)
    loader = DataLoader(source, seed=seed, global_batch_size=gbs, micro_batch_size=gbs // ws,
                        dp_rank=rank, dp_size=ws, position=position)
    _append_jsonl(log_path, {"kind": "start", "attempt": attempt, "rank": rank, "world_size": ws,
                             "node_id": ray.get_runtime_context().get_node_id(), "resumed_from": step,
                             "load_s": load_s, "load_started": load_started, "entered": entered,
                             "process_started": psutil.Process().create_time(), "pid": os.getpid(),
                             "time": time.time()})

    saved_on_preemption = False
    stop_flag = torch.zeros(1)
    while True:
        t_compute = time.perf_counter()
        x, y = loader.next_batch().stacked()
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        compute_s = time.perf_counter() - t_compute

        # Ray's documented pattern: a barrier-like query every step, a just-in-time checkpoint once.
        # Metrics go to the step file; ray.train.report is called with checkpoints (and every step only
        # if asked): each report waits for the controller's poll (every 2 s by default) to drain a
        # 1-slot queue, so reporting every step caps training at one step per poll.
        preempted = ray.train.get_preemption_info() is not None
        jit = preempted and not saved_on_preemption
        metrics = {"step": step, "time": time.time(), "world_size": ws, "loss": loss.item()}
        if rank == 0:
            _append_jsonl(log_path, {"kind": "step", "attempt": attempt, "rank": rank, "step": step,
                                     "world_size": ws, "time": metrics["time"], "compute_s": compute_s,
                                     "preempted": preempted, "jit_checkpoint": jit})
        if step % config["ckpt_every"] == 0 or jit:
            saved_on_preemption = saved_on_preemption or jit
            t_save = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                msd, osd = get_state_dict(ddp, optimizer)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
                if rank == 0:
                    with open(os.path.join(d, "extra.json"), "w") as f:
                        json.dump({"step": step, "data": loader.state_dict()}, f)
                dcp_s = time.perf_counter() - t_save
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
            if rank == 0:
                _append_jsonl(log_path, {"kind": "save", "attempt": attempt, "step": step, "dcp_s": dcp_s,
                                         "save_s": time.perf_counter() - t_save, "time": time.time()})
        elif config["report_every_step"]:
            ray.train.report(metrics)

        # The driver asks to stop through a file; all ranks must agree on the step they stop at.
        stop_flag.fill_(1.0 if os.path.exists(stop_path) else 0.0)
        dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX)
        if stop_flag.item() > 0 and step >= config["model_steps"]:
            return


# --------------------------------------------------------------------------------------------------
# Driver side.
# --------------------------------------------------------------------------------------------------
class StepLog:
    """Incremental reader of the JSON-lines file the workers append to."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self.records = path, 0, []

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return self.records
        with open(self.path) as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind("\n") + 1  # a partly written last line waits for the next poll
        for line in chunk[:end].splitlines():
            if line.strip():
                self.records.append(json.loads(line))
        self._offset += len(chunk[:end].encode())
        return self.records

    def steps(self) -> list[dict]:
        return [r for r in self.records if r["kind"] == "step"]

    def starts(self, attempt: float) -> list[dict]:
        return [r for r in self.records if r["kind"] == "start" and r["attempt"] == attempt]


def world_sizes(scenario: str, *, nodes: int, slots_per_node: int, max_workers: int) -> tuple[int, int]:
    """The world size before the event and the one Ray Train settles at after it: every slot, up to
    `max_workers`, of `nodes` nodes, then of one node more (join) or less (kill, drain)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    after = nodes + 1 if scenario == "join" else nodes - 1
    if min(nodes, after) < 1 or slots_per_node < 1 or max_workers < 1:
        raise ValueError(f"a {scenario} on {nodes} nodes of {slots_per_node} slots (max_workers={max_workers}) "
                         "leaves no worker: start with 2 nodes or more")
    return min(max_workers, nodes * slots_per_node), min(max_workers, after * slots_per_node)


def _wait_for(pred, *, timeout_s: float, what: str, fit_state: dict):
    """Poll `pred()` until it returns something truthy; None on timeout or when fit() ended."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        if fit_state.get("done"):
            got = pred()
            if not got:
                log.warning("fit() ended while waiting for %s: %r", what, fit_state.get("error"))
            return got or None
        time.sleep(_POLL_S)
    log.warning("timed out after %.0f s waiting for %s", timeout_s, what)
    return None


def kill_controllers() -> None:
    """Last resort when fit() hangs (e.g. a worker group that can never be placed): kill this job's
    TrainController actors; their workers and placement groups go with them."""
    import ray
    from ray.util.state import list_actors

    ctx = ray.get_runtime_context()
    job_id = ctx.get_job_id()
    # This driver's cluster by its GCS address: with no address the state API picks the newest cluster
    # on the machine, which on a shared box may be someone else's.
    for a in list_actors(address=ctx.gcs_address,
                         filters=[("class_name", "=", "TrainController"), ("state", "=", "ALIVE")]):
        if a.job_id == job_id:
            log.warning("killing hung TrainController %s", a.actor_id)
            ray._private.worker.global_worker.core_worker.kill_actor(ray.ActorID.from_hex(a.actor_id), True)


def _node_of(cluster, node_id: str):
    return next((n for n in cluster.worker_nodes if n.node_id == node_id), None)


def remove_nodes(cluster, nodes: list) -> None:
    """Kill each of a run's simulated `nodes` still in `cluster` (the event may have killed one), logging
    (not raising) a failure, then wait up to 30 s for Ray to see them gone."""
    import ray

    from service.pool.cluster import kill_node

    for node in nodes:
        if node in cluster.worker_nodes:
            try:
                kill_node(cluster, node)
            except Exception:
                log.warning("removing node %s failed; it may already be gone", node.node_id, exc_info=True)
    ids = {n.node_id for n in nodes}
    deadline = time.time() + 30
    while time.time() < deadline and any(n["Alive"] and n["NodeID"] in ids for n in ray.nodes()):
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------------
# An event's phases, from the loop's records and Ray's attempt records (pure).
# --------------------------------------------------------------------------------------------------
PHASES = ("detection", "restart", "actors", "worker start + process group", "build", "checkpoint load",
          "first step")
"""The phases of Ray Train's event -> first step, in order; each ends at a timestamp Ray or the loop wrote:
  detection        the event -> Ray's record of the old group's attempt ending (`TrainRunAttempt.end_time_ns`,
                   written in that group's shutdown, after its torch backend's shutdown): the controller's
                   poll noticing, its failure policy, the backend's shutdown
  restart          -> the start of the attempt that trains at the new size (`start_time_ns`, before its
                   placement group): the rest of the old group's shutdown, any failed start between (Ray
                   keeps no attempt record of a start that timed out: its controller log has it), the decision
  actors           -> the slowest rank's worker process created (its `psutil` create time): placement group,
                   actor creation
  worker start + process group
                   -> the slowest rank entered the train function: the process's start-up (Python, Ray's
                   core worker, imports), Ray's train context, its torch backend's `init_process_group`
                   over the new group, the function's launch; the loop cannot split these
  build            -> the slowest rank began loading the checkpoint: model build, DDP wrap (a broadcast of
                   rank 0's parameters)
  checkpoint load  -> the slowest rank ready to step: DCP load, `set_state_dict`, the data position
  first step       -> rank 0's first step at the new size ended (its all-reduce waits for every rank)
They sum to event -> first step."""


def attempt_at(attempts: list[dict], t: float) -> dict | None:
    """The Ray attempt (`ray_attempts` rows) a worker group that entered its train function at unix time
    `t` belongs to: the last one started at or before `t`."""
    started = [a for a in attempts if a["start"] <= t]
    return max(started, key=lambda a: a["start"]) if started else None


def phases(*, t_event: float, first_step_time: float, starts: list[dict], old_attempt: dict | None,
           new_attempt: dict | None) -> dict[str, float | None]:
    """Seconds per phase (`PHASES`) of one event: `starts` the new group's "start" records (one per rank),
    `old_attempt` / `new_attempt` Ray's attempt records of the groups before and after (None: Ray's state
    tracking was off). A rank that loaded no checkpoint (`load_s` None) and has no `load_started` has an
    empty load. A phase whose end is unknown, or earlier than the phase before it ends (a worker
    process Ray had started before the attempt, from its pool), is None and its time goes to the next
    phase: the phases that are numbers always sum to `first_step_time - t_event`."""
    if not starts:
        raise ValueError("no start records of the new group: it never entered its train function")

    def slowest(key: str) -> float | None:
        xs = [r.get(key) for r in starts]
        return None if any(x is None for x in xs) else max(xs)

    # a rank that loaded nothing (load_s None: no checkpoint registered) and whose loop wrote no
    # load_started began its (empty) load when it was ready
    starts = [{**r, "load_started": r["time"]} if r.get("load_started") is None and r.get("load_s") is None else r
              for r in starts]

    ends = [None if old_attempt is None else old_attempt.get("end"),
            None if new_attempt is None else new_attempt["start"],
            slowest("process_started"), slowest("entered"), slowest("load_started"), slowest("time"),
            first_step_time]
    out: dict[str, float | None] = {}
    last = t_event
    for name, end in zip(PHASES, ends):
        if end is None or end < last:
            out[name] = None
            continue
        out[name], last = end - last, end
    return out


def settings(monitor_interval_s: float) -> dict:
    """Every Ray Train wait in effect for a run in this process, with Ray's default beside it: the
    RAY_TRAIN_* variables as set in this process's environment (Ray Train hands them to its controller
    and workers), the elastic monitor interval, and Ray's internal autoscaling constants (no knob: their
    defaults)."""
    from benchmarks.spot_clock import RAY_INTERNAL_INTERVALS, RAY_INTERVALS, RAY_MONITOR_INTERVAL_S, RAY_TIMEOUTS

    out = {k: {"default_s": v, "set_s": float(os.environ.get(k, v))}
           for k, v in {**RAY_INTERVALS, **RAY_TIMEOUTS}.items()}
    out["elastic_resize_monitor_interval_s"] = {"default_s": RAY_MONITOR_INTERVAL_S, "set_s": monitor_interval_s}
    out |= {k: {"default_s": v, "set_s": v} for k, v in RAY_INTERNAL_INTERVALS.items()}
    out[_STATE_ENV] = os.environ.get(_STATE_ENV, "0")
    return out


def ray_attempts(run_name: str) -> list[dict]:
    """Ray's records of every attempt (worker group) of the run named `run_name`, oldest first: start and
    end (unix seconds), status, workers asked for. Empty unless RAY_TRAIN_ENABLE_STATE_TRACKING=1 (then
    Ray's train state actor, which its dashboard reads, keeps them)."""
    import ray

    try:
        actor = ray.get_actor("train_v2_state_actor", namespace="_train_state_actor")
    except ValueError:
        return []
    runs = ray.get(actor.get_train_runs.remote(), timeout=60)
    ids = [rid for rid, r in runs.items() if r.name == run_name]
    if not ids:
        return []
    attempts = ray.get(actor.get_train_run_attempts.remote(), timeout=60).get(ids[0], {})
    return sorted(({"attempt_id": a.attempt_id, "status": str(a.status.value), "start": a.start_time_ns / 1e9,
                    "end": None if a.end_time_ns is None else a.end_time_ns / 1e9, "workers": len(a.resources)}
                   for a in attempts.values()), key=lambda a: a["start"])


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def _step_intervals(steps: list[dict]) -> dict[int, list[float]]:
    """Wall time between consecutive steps of one worker group, by world size."""
    out: dict[int, list[float]] = {}
    prev: dict[float, dict] = {}
    for s in sorted(steps, key=lambda r: r["time"]):
        p = prev.get(s["attempt"])
        if p is not None and s["step"] == p["step"] + 1:
            out.setdefault(s["world_size"], []).append(s["time"] - p["time"])
        prev[s["attempt"]] = s
    return out


def measure_raytrain(*, cluster, model_steps: int, ckpt_every: int, scenario: str, workdir: str,
                     event_step: int = 10, post_event_steps: int = 8, timeout_s: float = 240.0,
                     warmup_timeout_s: float = 180.0, drain_deadline_s: float = 60.0,
                     global_batch_size: int = 12, seq_len: int = 32, seed: int = 0, lr: float = 1e-3,
                     model: dict | None = None,
                     elastic_resize_monitor_interval_s: float = 5.0, report_every_step: bool = False,
                     health_check_interval_s: float | None = None, nodes: int | None = None,
                     slots_per_node: int = 1, max_workers: int = _MAX_WORKERS) -> dict:
    """Run one scenario under Ray Train v2 elastic mode and return its timings.

    `cluster` is a live `ray.cluster_utils.Cluster` (head num_cpus=0) with `ray.init` done. The run
    trains until it has reached `model_steps` and done `post_event_steps` steps in the new worker
    group (or timed out), checkpointing every `ckpt_every` steps. It starts on `nodes` nodes (None: 2
    for join, else 3) of `slots_per_node` CPUs, `ScalingConfig(num_workers=(1, max_workers))`; the event
    adds or takes one node. `global_batch_size` must divide by the world sizes before and after
    (`world_sizes`). `elastic_resize_monitor_interval_s` defaults to 5 s rather
    than Ray's 60 s, so the baseline is the fastest reasonable Ray configuration.
    `model`: a JobConfig `model` section ({"preset", "overrides"}), tiny by default.
    `report_every_step` also calls `ray.train.report(metrics)` on steps without a checkpoint (slow:
    see `train_loop`). `health_check_interval_s` sets RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (the
    controller's poll period, Ray default 2 s) for this run only.
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.constants import is_v2_enabled

    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    if not is_v2_enabled():
        raise ValueError("Ray Train v2 is disabled (RAY_TRAIN_V2_ENABLED=0); elastic mode needs v2")
    if min(model_steps, ckpt_every, event_step, post_event_steps) <= 0:
        raise ValueError(f"model_steps={model_steps}, ckpt_every={ckpt_every}, event_step={event_step} and "
                         f"post_event_steps={post_event_steps} must all be > 0")
    nodes_before = _INITIAL_NODES[scenario] if nodes is None else nodes
    sizes = world_sizes(scenario, nodes=nodes_before, slots_per_node=slots_per_node, max_workers=max_workers)
    ws_before = sizes[0]
    if any(global_batch_size % ws for ws in sizes):
        raise ValueError(f"global_batch_size={global_batch_size} does not divide by the world sizes {sizes} of a "
                         f"{scenario} on {nodes_before} nodes of {slots_per_node}: pick a multiple of each")
    # Workers must import the train function even when this file is not importable from their cwd.
    if __name__ != "__main__":  # __main__'s functions are pickled by value anyway
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    run_dir = Path(workdir) / f"raytrain-{scenario}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    log_path, stop_path = run_dir / "steps.jsonl", run_dir / "STOP"
    steplog = StepLog(log_path)
    result: dict[str, Any] = {"system": "ray-train-v2", "scenario": scenario, "event_to_first_step_s": None,
                              "steps_redone_or_lost": None, "world_size_before": None,
                              "world_size_after": None, "step_time_s": None, "notes": "", "timed_out": False}
    notes: list[str] = []
    added: list = []
    fit_state: dict[str, Any] = {}
    thread = None
    env_before = os.environ.get(_HEALTH_ENV)
    if health_check_interval_s is not None:  # read by the controller at fit(), propagated to workers
        os.environ[_HEALTH_ENV] = str(health_check_interval_s)
    try:
        for _ in range(nodes_before):
            added.append(cluster.add_node(num_cpus=slots_per_node))
        cluster.wait_for_nodes()

        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"log_path": str(log_path), "stop_path": str(stop_path), "seed": seed,
                               "global_batch_size": global_batch_size, "seq_len": seq_len, "lr": lr,
                               "model": model or {"preset": "tiny"},
                               "ckpt_every": ckpt_every, "model_steps": model_steps,
                               "report_every_step": report_every_step},
            scaling_config=ScalingConfig(num_workers=(1, max_workers),
                                         elastic_resize_monitor_interval_s=elastic_resize_monitor_interval_s),
            run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir / "ray_results"),
                                 failure_config=FailureConfig(max_failures=3),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )

        def fit() -> None:
            t = time.time()
            try:
                trainer.fit()
            except BaseException as e:  # reported in the result, never raised out of the thread
                fit_state["error"] = f"{type(e).__name__}: {e}"
            finally:
                fit_state["fit_s"], fit_state["done"] = time.time() - t, True

        t_fit = time.time()
        thread = threading.Thread(target=fit, name=f"raytrain-{scenario}", daemon=True)
        thread.start()

        # 1. Train at the initial size up to the event step.
        def at_event_step():
            steplog.poll()
            return next((s for s in steplog.steps()
                         if s["step"] >= event_step and s["world_size"] == ws_before), None)

        first = _wait_for(at_event_step, timeout_s=warmup_timeout_s, what=f"step {event_step} at "
                          f"world size {ws_before}", fit_state=fit_state)
        if first is None:
            raise RuntimeError(f"Ray Train did not reach step {event_step} at world size {ws_before} within "
                               f"{warmup_timeout_s:.0f} s (fit error: {fit_state.get('error')})")
        old_attempt = first["attempt"]
        result["world_size_before"] = first["world_size"]
        notes.append(f"first step {min(s['time'] for s in steplog.steps()) - t_fit:.1f} s after fit()")

        # 2. The event.
        victim = None
        if scenario == "join":
            added.append(cluster.add_node(num_cpus=slots_per_node))
            t_event = time.time()
        else:
            # The node hosting the highest rank that is not the node this driver is attached to (all
            # simulated nodes share one IP, so the driver may sit on any raylet; losing it kills the driver).
            me = ray.get_runtime_context().get_node_id()
            starts = [r for r in sorted(steplog.starts(old_attempt), key=lambda r: r["rank"]) if r["node_id"] != me]
            victim = starts[-1]["node_id"]
            node = _node_of(cluster, victim)
            if node is None:
                raise RuntimeError(f"node {victim} hosting rank {starts[-1]['rank']} is not one we added")
            if scenario == "kill":
                from service.pool.cluster import kill_node

                t_event = time.time()  # the node dies during kill_node: raylet, agents and workers at once
                kill_node(cluster, node)
                notes.append(f"kill_node took {time.time() - t_event:.1f} s (the event time is its start)")
            else:
                from service.pool.cluster import drain_node

                drain_node(victim, message="elastic_raytrain benchmark: simulated spot reclaim",
                           deadline_remaining_s=drain_deadline_s)
                t_event = time.time()
        steplog.poll()
        max_step_at_event = max(s["step"] for s in steplog.steps() if s["time"] <= t_event)

        # 3. Wait for the first step of a new worker group at a different size.
        def new_group_step():
            steplog.poll()
            for s in steplog.steps():
                if s["attempt"] > t_event and s["world_size"] != result["world_size_before"]:
                    if victim is None or all(r["node_id"] != victim for r in steplog.starts(s["attempt"])):
                        return s
            return None

        target = _wait_for(new_group_step, timeout_s=timeout_s, what="a step at the new size",
                           fit_state=fit_state)
        if target is None:
            result["timed_out"] = True
            result["event_to_first_step_s"] = round(time.time() - t_event, 2)
            notes.append(f"no step at a new size within {result['event_to_first_step_s']} s "
                         "(event_to_first_step_s is a lower bound)")
        else:
            result["event_to_first_step_s"] = round(target["time"] - t_event, 2)
            result["world_size_after"] = target["world_size"]
            new_attempt = target["attempt"]
            result["new_group_started_s"] = round(new_attempt - t_event, 2)  # train fn entered on rank 0
            _wait_for(lambda: steplog.poll() and sum(s["attempt"] == new_attempt for s in steplog.steps())
                      >= post_event_steps, timeout_s=60, what=f"{post_event_steps} steps at the new size",
                      fit_state=fit_state)

        # 4. Stop the run and let fit() return.
        stop_path.touch()
        thread.join(timeout=120)
        if thread.is_alive():
            notes.append("fit() did not return within 120 s of the stop request; controller killed")
            kill_controllers()
            thread.join(timeout=30)

        # 5. Metrics from the step log.
        steplog.poll()
        steps = steplog.steps()
        old_steps = [s["step"] for s in steps if s["attempt"] == old_attempt]
        result["max_step_at_event"] = max_step_at_event
        result["max_step_old_group"] = max(old_steps)
        if target is not None:
            new_starts = steplog.starts(target["attempt"])
            resumed = new_starts[0]["resumed_from"]
            result["resumed_from_step"] = resumed
            result["steps_redone_or_lost"] = max(old_steps) - resumed
            loads = [r["load_s"] for r in new_starts if r.get("load_s") is not None]
            saves = [r for r in steplog.records if r["kind"] == "save" and r["step"] == resumed]
            result["load_s"] = round(max(loads), 3) if loads else None
            result["save_s"] = round(saves[-1]["save_s"], 3) if saves else None
            if result["load_s"] is not None and result["save_s"] is not None:
                result["moving_state_s"] = round(result["save_s"] + result["load_s"], 3)
            # the stall: from the old group's last step to the first at the new size
            result["stall_s"] = round(target["time"] - max(s["time"] for s in steps if s["attempt"] == old_attempt), 2)
            attempts = ray_attempts(run_dir.name)
            entered = lambda starts: min(r.get("entered", r["time"]) for r in starts)  # noqa: E731
            old_ray = attempt_at(attempts, entered(steplog.starts(old_attempt)))
            new_ray = attempt_at(attempts, entered(new_starts))
            result["t_event"], result["first_step_time"] = t_event, target["time"]
            result["phases"] = phases(t_event=t_event, first_step_time=target["time"], starts=new_starts,
                                      old_attempt=old_ray, new_attempt=new_ray)
            result["ray_attempts"] = attempts
            result["new_group_starts"] = new_starts
            if old_ray is not None and new_ray is not None:
                result["attempts_between"] = sum(old_ray["start"] < a["start"] < new_ray["start"] for a in attempts)
        by_ws = _step_intervals(steps)
        result["step_time_s"] = _median([x for xs in by_ws.values() for x in xs])
        result["step_time_s_by_world_size"] = {ws: _median(xs) for ws, xs in sorted(by_ws.items())}
        result["compute_time_s"] = _median([s["compute_s"] for s in steps])
        result["save_s_median"] = _median([r["save_s"] for r in steplog.records if r["kind"] == "save"])
        attempts = sorted({r["attempt"] for r in steplog.records if r["kind"] == "start"})
        result["worker_group_starts"] = len(attempts)
        result["fit_s"] = round(fit_state.get("fit_s", time.time() - t_fit), 1)
        result["global_batch_size"], result["seq_len"] = global_batch_size, seq_len
        result["elastic_resize_monitor_interval_s"] = elastic_resize_monitor_interval_s
        result["report_every_step"] = report_every_step
        result["health_check_interval_s"] = float(os.environ.get(_HEALTH_ENV, 2.0))
        result["ray_settings"] = settings(elastic_resize_monitor_interval_s)
        if (result["step_time_s"] or 0) > 3 * (result["compute_time_s"] or float("inf")):
            notes.append(f"steps are paced by ray.train.report (median {result['step_time_s']} s/step vs "
                         f"{result['compute_time_s']} s compute)")
        old_end = max(s["time"] for s in steps if s["attempt"] == old_attempt)
        notes.append(f"old group's last step {old_end - t_event:+.1f} s after the event")
        if scenario == "drain":
            noticed = [s for s in steps if s.get("preempted")]
            if noticed:
                result["preemption_notice_s"] = round(noticed[0]["time"] - t_event, 2)
                jit = [s["step"] for s in steps if s.get("jit_checkpoint")]
                notes.append(f"get_preemption_info() non-None {result['preemption_notice_s']} s after the "
                             f"drain; JIT checkpoint at step {jit[0] if jit else None}")
            else:
                notes.append("the preemption notice never reached the train loop")
        if len(attempts) > 2:
            notes.append(f"{len(attempts)} worker groups started (failed/retried starts in between)")
        if fit_state.get("error"):
            notes.append(f"fit() raised {fit_state['error'][:300]}")
    except Exception as e:
        log.exception("scenario %s failed", scenario)
        notes.append(f"scenario failed: {type(e).__name__}: {e}")
        stop_path.touch()
        if thread is not None and thread.is_alive():
            thread.join(timeout=60)
            if thread.is_alive():
                kill_controllers()
                thread.join(timeout=30)
    finally:
        stop_path.touch()
        if health_check_interval_s is not None:
            if env_before is None:
                os.environ.pop(_HEALTH_ENV, None)
            else:
                os.environ[_HEALTH_ENV] = env_before
        remove_nodes(cluster, added)
        result["notes"] = "; ".join(notes)
    return result


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
_COLUMNS = ("scenario", "event_to_first_step_s", "steps_redone_or_lost", "world_size_before",
            "world_size_after", "step_time_s", "timed_out")


def _table(results: list[dict]) -> str:
    rows = [[str(r.get(c)) for c in _COLUMNS] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]
    line = lambda cells: "  ".join(x.ljust(w) for x, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(_COLUMNS), line(["-" * w for w in widths]), *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--model-steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--monitor-interval", type=float, default=5.0,
                   help="ScalingConfig(elastic_resize_monitor_interval_s); Ray's default is 60")
    p.add_argument("--report-every-step", action="store_true",
                   help="call ray.train.report(metrics) every step, not only with checkpoints")
    p.add_argument("--health-check-interval", type=float, default=None,
                   help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for the runs (Ray's default is 2)")
    p.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray
    from ray.cluster_utils import Cluster

    workdir = args.workdir or tempfile.mkdtemp(prefix="elastic_raytrain-")
    results = []
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        ray.init(address=cluster.address)
        for scenario in args.scenarios:
            log.info("=== scenario %s ===", scenario)
            r = measure_raytrain(cluster=cluster, model_steps=args.model_steps, ckpt_every=args.ckpt_every,
                                 scenario=scenario, workdir=workdir,
                                 elastic_resize_monitor_interval_s=args.monitor_interval,
                                 report_every_step=args.report_every_step,
                                 health_check_interval_s=args.health_check_interval)
            log.info("%s: %s", scenario, json.dumps(r))
            results.append(r)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(_table(results))
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
