"""Goodput on a real spot trace: one window of AWS spot availability replayed onto a simulated Ray cluster,
against Elastron, Ray Train v2 elastic and fixed-size checkpoint-restart, one after the other.

    .venv/bin/python benchmarks/spot_trace.py [--k 4] [--window-start-min auto] [--window-min 10] \
        [--compression 10] [--notice-share 0.75] [--systems elastron raytrain fixed] \
        [--json benchmarks/results/spot-trace.json]        # the PNG is written next to the JSON

The trace (`--trace`, default ../shared/data/spot-traces/aws-p3.2xlarge-32.csv; its README): 32 p3.2xlarge
spot instances over 11.4 h, one line per instance granted (`add`) or preempted (`remove`).

Mapping onto K simulated nodes (`ray.cluster_utils.Cluster`: a head without worker slots, 1-CPU nodes):
- the window starts with round(N * K / 32) nodes (N: instances alive in the trace then; at least 1);
- every trace event in the window is one simulated event at (t - window start) / `--compression` wall
  seconds: an `add` adds a node (the lowest free slot), a `remove` removes one (a seeded random present
  slot), except that the cluster stays within 1..K nodes: events past those bounds are dropped and counted.
  So bursts keep their shape (six removals in a minute stay six removals in 60/compression seconds),
  while the level of availability is the trace's only at the start.
- a removal has AWS's two-minute notice for a seeded `--notice-share` of removals: a Ray drain (reason
  PREEMPTION, the notice's deadline) 120 / compression seconds before the node is killed; the others are
  killed without a word (`kill_node`: raylet, agents and workers at once).
The schedule is computed once from the trace and the seed, so every system sees the same replay.

Every system trains the same job: the tiny Llama preset, byte corpus of the stdlib, seq_len 32, global
batch lcm(1..K) (12 for K = 4, so every size divides it), lr 1e-3 (constant after a 2-step warm-up
horizon of 100k steps), a checkpoint every `--ckpt-every` steps. The replay starts when the system has
trained its first step at the starting size (process start-up is not counted) and lasts the window.
- elastron: the Coordinator with its defaults (live moves, 10 s settle before growing), except a restart
  budget large enough for a spot trace (its default, 3 failures in 10 minutes, is for crashes).
- raytrain: Ray Train v2 elastic (`ScalingConfig(num_workers=(1, K))`, `elastic_resize_monitor_interval_s`
  5 s), the train loop of benchmarks/elastic_raytrain.py: DDP, DCP checkpoints every N steps and a
  just-in-time one on `get_preemption_info()`; unlimited failures.
- fixed: the torchrun habit, with the same loop: Ray Train v2 at the starting size only
  (`num_workers=k0`), so a lost node fails the group, which restarts from its last checkpoint once k0
  nodes are there again.

Figures per system, over the replay window:
- goodput: samples that count (the step reached at the end minus the step at the start, times the global
  batch: every step once, however often it was done) per wall second;
- ideal: the throughput measured at each cluster size (a calibration run of Elastron stepping down from
  K workers to 1, `--calibrate-steps` steps each), integrated over the replay's availability, with no cost
  for changing size; goodput / ideal is the headline ratio. Beside it, goodput / own ideal: the same
  integral over the system's own median throughput at each size it ran in the window (its step costs
  differ from Elastron's; this ratio isolates what its reactions to the events cost);
- work redone: steps trained in the window minus steps that count;
- stall per event kind: every gap between two steps longer than 3x the run's median step interval,
  less one interval, charged to the last replay event before the gap ended (join, removal with notice,
  removal without notice);
- Elastron's per-step losses against an uninterrupted single-process run of the same job (the rank
  `elastron train --nproc 1` runs, with one thread), fp32, 1e-4 relative (`--check-losses RUN_DIR` redoes this for a kept run).
A PNG beside the JSON plots the available nodes, each system's workers in use and cumulative samples.
Timings on the shared 2-core box include whatever else ran on it (the JSON keeps the 1-minute load).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRACE = ROOT.parent / "shared" / "data" / "spot-traces" / "aws-p3.2xlarge-32.csv"
TRACE_NODES = 32  # the trace's cluster asked for 32 instances
NOTICE_S = 120.0  # AWS's spot interruption notice
SYSTEMS = ("elastron", "raytrain", "fixed")
JOIN, NOTICED, UNNOTICED = "join", "removal with notice", "removal without notice"
TOL = 1e-4


# -- the trace and the schedule (pure) -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TraceEvent:
    t_s: float
    op: str
    """add or remove"""
    node: str


def load_trace(path: Path) -> list[TraceEvent]:
    """`time_ms,add|remove,node_id` lines, in time order (ties keep the file's order)."""
    out = []
    with open(path) as f:
        for i, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            if len(row) != 3 or row[1] not in ("add", "remove"):
                raise ValueError(f"{path}:{i}: expected time_ms,add|remove,node_id, got {row!r}")
            out.append(TraceEvent(t_s=int(row[0]) / 1000.0, op=row[1], node=row[2]))
    return sorted(out, key=lambda e: e.t_s)


def alive_at(events: list[TraceEvent], t_s: float) -> int:
    """Instances alive in the trace just before `t_s` (events at exactly t_s not yet applied)."""
    alive: set[str] = set()
    for e in events:
        if e.t_s >= t_s:
            break
        (alive.add if e.op == "add" else alive.discard)(e.node)
    return len(alive)


def busiest_window(events: list[TraceEvent], window_s: float, *, step_s: float = 60.0) -> float:
    """Start (a whole minute, after the initial grants at t=0) of the window with the most events."""
    end = events[-1].t_s
    best, best_n = step_s, -1
    t = step_s
    while t + window_s <= end:
        n = sum(1 for e in events if t <= e.t_s < t + window_s)
        if n > best_n:
            best, best_n = t, n
        t += step_s
    return best


@dataclass(frozen=True, slots=True)
class Action:
    at: float
    """Wall seconds after the replay starts."""
    kind: str
    """add, notice (a drain with the notice's deadline) or remove."""
    slot: int
    notice: bool = False
    """For a removal: whether a notice preceded it."""


@dataclass(frozen=True, slots=True)
class Schedule:
    k: int
    k0: int
    actions: tuple[Action, ...]
    availability: tuple[tuple[float, int], ...]
    """(wall seconds, nodes alive from then on), starting with (0, k0)."""
    duration_s: float
    notice_s: float
    """Wall seconds between a notice and its removal."""
    dropped: int
    """Trace events that would have left 1..k."""
    trace_events: int


MAPPINGS = ("events", "scaled")


def build_schedule(events: list[TraceEvent], *, start_s: float, window_s: float, k: int, compression: float,
                   notice_share: float, seed: int = 0, mapping: str = "events") -> Schedule:
    """`mapping`: "events" (each trace event is one simulated event, within 1..k) or "scaled" (the
    cluster follows round(alive * k / 32), within 1..k: one simulated node per 32/k instances)."""
    if k < 1 or compression <= 0 or window_s <= 0 or not 0 <= notice_share <= 1 or mapping not in MAPPINGS:
        raise ValueError(f"need k >= 1, compression > 0, window_s > 0, 0 <= notice_share <= 1 and a mapping in "
                         f"{MAPPINGS}; got k={k}, compression={compression}, window_s={window_s}, "
                         f"notice_share={notice_share}, mapping={mapping!r}")
    rng = random.Random(seed)
    scaled = lambda n: min(k, max(1, round(n * k / TRACE_NODES)))  # noqa: E731
    alive = set()
    for e in events:
        if e.t_s >= start_s:
            break
        (alive.add if e.op == "add" else alive.discard)(e.node)
    k0 = scaled(len(alive))
    present = set(range(k0))
    added_at = dict.fromkeys(present, 0.0)
    notice_wall = NOTICE_S / compression
    actions: list[Action] = []
    avail = [(0.0, k0)]
    dropped = n = 0
    for e in events:
        if not start_s <= e.t_s < start_s + window_s:
            continue
        n += 1
        at = (e.t_s - start_s) / compression
        (alive.add if e.op == "add" else alive.discard)(e.node)
        if mapping == "scaled":
            want = scaled(len(alive))
            if want == len(present):
                dropped += 1
                continue
            op = "add" if want > len(present) else "remove"
        else:
            op = e.op
        if op == "add":
            if len(present) >= k:
                dropped += 1
                continue
            slot = min(set(range(k)) - present)
            present.add(slot)
            added_at[slot] = at
            actions.append(Action(at=at, kind="add", slot=slot))
        else:
            if len(present) <= 1:
                dropped += 1
                continue
            slot = rng.choice(sorted(present))
            noticed = rng.random() < notice_share
            present.discard(slot)
            if noticed:
                actions.append(Action(at=max(added_at[slot], at - notice_wall), kind="notice", slot=slot))
            actions.append(Action(at=at, kind="remove", slot=slot, notice=noticed))
        avail.append((at, len(present)))
    order = {"add": 0, "notice": 1, "remove": 2}
    actions.sort(key=lambda a: (a.at, order[a.kind]))
    return Schedule(k=k, k0=k0, actions=tuple(actions), availability=tuple(avail), duration_s=window_s / compression,
                    notice_s=notice_wall, dropped=dropped, trace_events=n)


# -- the figures (pure) --------------------------------------------------------------------------------
def throughput_by_size(rows: list[dict], gbs: int) -> dict[int, float]:
    """Samples per second at each world size: gbs / the median interval between consecutive steps
    (step = previous + 1) at that size."""
    gaps: dict[int, list[float]] = {}
    for a, b in zip(rows, rows[1:]):
        if b["step"] == a["step"] + 1 and a["world_size"] == b["world_size"]:
            gaps.setdefault(b["world_size"], []).append(b["time"] - a["time"])
    return {ws: gbs / statistics.median(xs) for ws, xs in sorted(gaps.items()) if xs}


def ideal_samples(availability: list[tuple[float, int]], duration_s: float, thr: dict[int, float]) -> float:
    """∫ thr(k(t)) dt over the replay. A size without a measurement takes the nearest measured size's
    throughput (the larger one on a tie)."""
    if not thr:
        raise ValueError("no throughput measured at any size")

    def at(k: int) -> float:
        return thr[min(thr, key=lambda s: (abs(s - k), -s))]

    total = 0.0
    for (t, k), nxt in zip(availability, [*availability[1:], (duration_s, None)]):
        t1 = min(nxt[0], duration_s)
        if t1 > t:
            total += (t1 - t) * at(k)
    return total


def analyse(rows: list[dict], *, t0: float, t_end: float, gbs: int, events: list[tuple[float, str]],
            ideal: float | None = None, availability: list[tuple[float, int]] | None = None) -> dict:
    """Goodput, work redone and stalls of one system from its step rows ({time, step, world_size}, in
    the order trained) and the replay's events ((unix time, kind), kind one of JOIN/NOTICED/UNNOTICED).
    With `availability`, also the ratio to the system's own ideal: its own median throughput at each
    size it ran (in this window) integrated over the availability."""
    before = [r for r in rows if r["time"] <= t0]
    win = [r for r in rows if t0 < r["time"] <= t_end]
    step0 = before[-1]["step"] if before else 0
    step1 = win[-1]["step"] if win else step0
    counted = max(0, step1 - step0)
    wall = t_end - t0
    out = {"wall_s": round(wall, 2), "step_start": step0, "step_end": step1, "steps_counted": counted,
           "steps_trained": len(win), "steps_redone": len(win) - counted, "samples_counted": counted * gbs,
           "goodput_samples_per_s": counted * gbs / wall if wall > 0 else 0.0}
    if ideal:
        out["ideal_samples"] = round(ideal, 1)
        out["goodput_vs_ideal"] = counted * gbs / ideal
    times = [t0] + [r["time"] for r in win] + [t_end]
    intervals = [b - a for a, b in zip(times[1:-1], times[2:-1])]
    normal = statistics.median(intervals) if intervals else None
    stalls = {JOIN: 0.0, NOTICED: 0.0, UNNOTICED: 0.0, "start": 0.0}
    counts = dict.fromkeys(stalls, 0)
    if normal:
        for a, b in zip(times, times[1:]):
            if b - a > 3 * normal:
                cause = next((kind for t, kind in reversed(events) if t < b), "start")
                stalls[cause] += b - a - normal
                counts[cause] += 1
    out["median_step_interval_s"] = normal
    out["stall_s"] = {k: round(v, 2) for k, v in stalls.items()}
    out["stalls"] = counts
    by_ws = throughput_by_size(win, gbs)
    out["own_throughput_by_size"] = {str(k): round(v, 2) for k, v in by_ws.items()}
    if by_ws and availability is not None:
        own = ideal_samples(availability, wall, by_ws)
        out["own_ideal_samples"] = round(own, 1)
        out["goodput_vs_own_ideal"] = counted * gbs / own
    return out


def loss_agreement(rows: list[dict], reference: list[float]) -> dict:
    """Each step's latest loss (a redone step's last value: the run as it stands) against the
    uninterrupted run's; relative differences."""
    latest = {r["step"]: r["loss"] for r in rows}
    diffs = [abs(latest[s] - want) / abs(want) for s, want in enumerate(reference, 1) if s in latest]
    missing = [s for s in range(1, len(reference) + 1) if s not in latest]
    worst = max(diffs, default=None)
    return {"steps_compared": len(diffs), "missing": missing[:10], "max_rel_diff": worst,
            "within_1e-4": worst is not None and worst <= TOL and not missing}


# -- the replay (on a live cluster) --------------------------------------------------------------------
class Replay:
    """Carries a Schedule out on a `ray.cluster_utils.Cluster`: slot -> node; `start()` adds the k0
    starting nodes, `run(t0)` acts at t0 + each action's offset, `close()` kills what is left."""

    def __init__(self, cluster, schedule: Schedule, log=print):
        self.cluster, self.schedule, self.log = cluster, schedule, log
        self.nodes: dict[int, object] = {}
        self.done: list[dict] = []

    def start(self) -> None:
        for slot in range(self.schedule.k0):
            self.nodes[slot] = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()

    def run(self, t0: float, stop: threading.Event) -> None:
        from service.pool.cluster import drain_node, kill_node

        for a in self.schedule.actions:
            if stop.wait(max(0.0, t0 + a.at - time.time())):
                return
            t = time.time()
            rec = {"kind": a.kind, "slot": a.slot, "notice": a.notice, "planned": round(a.at, 2),
                   "at": round(t - t0, 2), "time": t}
            try:
                if a.kind == "add":
                    self.nodes[a.slot] = self.cluster.add_node(num_cpus=1)
                elif a.kind == "notice":
                    drain_node(self.nodes[a.slot].node_id, message="spot trace: interruption notice",
                               deadline_remaining_s=self.schedule.notice_s)
                else:
                    kill_node(self.cluster, self.nodes.pop(a.slot))
            except Exception as e:  # noqa: BLE001 - a failed action is recorded; the replay goes on
                rec["error"] = f"{type(e).__name__}: {e}"
                self.log(f"replay: {a.kind} slot {a.slot} failed: {rec['error']}")
            rec["took_s"] = round(time.time() - t, 2)
            self.done.append(rec)

    def events(self) -> list[tuple[float, str]]:
        """(unix time, kind) of what was done, for charging stalls."""
        out = []
        for r in self.done:
            if r["kind"] == "add":
                out.append((r["time"], JOIN))
            elif r["kind"] == "notice":
                out.append((r["time"], NOTICED))
            else:
                out.append((r["time"], NOTICED if r["notice"] else UNNOTICED))
        return out

    def close(self) -> None:
        from service.pool.cluster import kill_node

        for slot in list(self.nodes):
            try:
                kill_node(self.cluster, self.nodes.pop(slot))
            except Exception as e:  # noqa: BLE001 - already gone
                self.log(f"replay: removing slot {slot} failed ({e}); it may already be gone")


def _wait(cond, timeout: float, what: str):
    """cond()'s first truthy value, or TimeoutError naming `what` (chaos_env's poll; imported here, where
    Ray is already loaded, so the trace's pure parts stay free of it)."""
    from benchmarks.chaos_env import wait

    return wait(cond, timeout, what)


@dataclass
class SystemRun:
    system: str
    t0: float
    t_end: float
    rows: list[dict]
    replay: list[dict]
    events: list[tuple[float, str]]
    extra: dict = field(default_factory=dict)


def job_config(*, k: int, ckpt_every: int, steps: int = 1_000_000) -> dict:
    gbs = math.lcm(*range(1, k + 1))
    gbs *= math.ceil(12 / gbs)
    return {
        "name": "spot-trace",
        "model": {"preset": "tiny"},
        "data": {"source": "corpus", "seq_len": 32, "max_bytes": 300_000},
        # micro_batch_size is an upper bound: the planner takes the whole per-rank batch, as Ray Train's loop does
        "train": {"steps": steps, "decay_steps": 100_000, "global_batch_size": gbs, "micro_batch_size": gbs,
                  "lr": 1e-3, "warmup_steps": 2, "seed": 11},
        "parallel": {"min_workers": 1, "max_workers": k},
        "checkpoint": {"interval_steps": ckpt_every, "keep_last": 2},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }


def _coordinator(cfg: dict, run_dir: Path, *, settle: float | None):
    from service.control.coordinator import Coordinator, CoordinatorOptions
    from service.control.job import Job
    from workers.config import JobConfig

    opts = CoordinatorOptions(max_restarts=10_000)
    if settle is not None:
        opts = CoordinatorOptions(max_restarts=10_000, settle_seconds=settle)
    return Coordinator(Job.of(JobConfig.from_dict(cfg), job_id=f"spot-{run_dir.name}", run_dir=run_dir),
                       options=opts)


def _metric_rows(run_dir: Path) -> list[dict]:
    from service.control.run_files import read_metrics

    return [{"time": r["time"], "step": r["step"], "world_size": r["world_size"], "loss": r["loss"]}
            for r in read_metrics(run_dir / "metrics.jsonl", after=0)]


def run_elastron(cluster, sched: Schedule, cfg: dict, workdir: Path, *, settle: float | None, log=print) -> SystemRun:
    from service.control.commands import Stop

    replay = Replay(cluster, sched, log)
    replay.start()
    run_dir = workdir / "elastron"
    coord = _coordinator(cfg, run_dir, settle=settle)
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    stop = threading.Event()
    try:
        _wait(lambda: coord.step_done >= 1 and coord.group is not None and coord.group.size == sched.k0, 300,
              f"Elastron's first step on {sched.k0} workers")
        t0 = time.time()
        replay.run(t0, stop)  # in this thread: Cluster.add_node installs signal handlers
        time.sleep(max(0.0, t0 + sched.duration_s - time.time()))
        t_end = time.time()
        reconfigs = [r.to_dict() for r in coord.reconfigs]
    finally:
        stop.set()
        coord.send(Stop())
        thread.join(timeout=120)
        replay.close()
    return SystemRun("elastron", t0, t_end, _metric_rows(run_dir), replay.done, replay.events(),
                     {"reconfigurations": reconfigs, "run_dir": str(run_dir)})


def run_raytrain(cluster, sched: Schedule, cfg: dict, workdir: Path, *, elastic: bool, monitor_s: float,
                 log=print) -> SystemRun:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import benchmarks.elastic_raytrain as ert

    ray.cloudpickle.register_pickle_by_value(ert)
    name = "raytrain" if elastic else "fixed"
    run_dir = workdir / f"{name}-{uuid.uuid4().hex[:6]}"
    run_dir.mkdir(parents=True)
    log_path, stop_path = run_dir / "steps.jsonl", run_dir / "STOP"
    t = cfg["train"]
    scaling = (ScalingConfig(num_workers=(1, sched.k), elastic_resize_monitor_interval_s=monitor_s) if elastic
               else ScalingConfig(num_workers=sched.k0))
    trainer = TorchTrainer(
        ert.train_loop,
        train_loop_config={"log_path": str(log_path), "stop_path": str(stop_path), "seed": t["seed"],
                           "global_batch_size": t["global_batch_size"], "seq_len": cfg["data"]["seq_len"],
                           "lr": t["lr"], "model": cfg["model"], "ckpt_every": cfg["checkpoint"]["interval_steps"],
                           "model_steps": 1, "report_every_step": False},
        scaling_config=scaling,
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir / "ray_results"),
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    replay = Replay(cluster, sched, log)
    replay.start()
    fit_state: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - reported, never raised out of the thread
            fit_state["error"] = f"{type(e).__name__}: {e}"[:500]
        fit_state["done"] = True

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    steplog = ert.StepLog(log_path)
    stop = threading.Event()
    notes = []
    try:
        _wait(lambda: any(s["world_size"] == sched.k0 for s in steplog.poll() and steplog.steps()), 300,
              f"Ray Train's first step on {sched.k0} workers")
        t0 = time.time()
        replay.run(t0, stop)  # in this thread: Cluster.add_node installs signal handlers
        time.sleep(max(0.0, t0 + sched.duration_s - time.time()))
        t_end = time.time()
    finally:
        stop.set()
        stop_path.touch()
        thread.join(timeout=90)
        if thread.is_alive():
            notes.append("fit() did not return within 90 s of the stop request; controller killed")
            ert.kill_controllers()
            thread.join(timeout=30)
        replay.close()
    steplog.poll()
    rows = [{"time": s["time"], "step": s["step"], "world_size": s["world_size"], "attempt": s["attempt"]}
            for s in steplog.steps()]
    starts = len({r["attempt"] for r in steplog.records if r["kind"] == "start"})
    if fit_state.get("error"):
        notes.append(f"fit() raised {fit_state['error']}")
    return SystemRun(name, t0, t_end, rows, replay.done, replay.events(),
                     {"worker_group_starts": starts, "notes": "; ".join(notes)})


def calibrate(cluster, cfg: dict, workdir: Path, *, k: int, steps: int, log=print) -> dict:
    """Elastron on k nodes, stepping down from k workers to 1 (`SetWorkers`), `steps` steps at each:
    the step rows to measure throughput at every size from."""
    from service.control.commands import SetWorkers, Stop

    nodes = [cluster.add_node(num_cpus=1) for _ in range(k)]
    cluster.wait_for_nodes()
    run_dir = workdir / "calibration"
    coord = _coordinator(cfg, run_dir, settle=None)
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    try:
        for n in range(k, 0, -1):
            if n < k:
                coord.send(SetWorkers(workers=n))
            _wait(lambda n=n: coord.group is not None and coord.group.size == n and coord.step_done >= 1, 300,
                  f"calibration on {n} workers")
            start = coord.step_done
            _wait(lambda: coord.step_done >= start + steps, 300, f"{steps} steps on {n} workers")
            log(f"calibration: {n} workers done")
    finally:
        coord.send(Stop())
        thread.join(timeout=120)
        from service.pool.cluster import kill_node

        for nd in nodes:
            kill_node(cluster, nd)
    rows = _metric_rows(run_dir)
    gbs = cfg["train"]["global_batch_size"]
    return {"throughput_by_size": throughput_by_size(rows, gbs), "steps_per_size": steps}


def reference_losses(cfg: dict, workdir: Path, steps: int) -> list[float]:
    """The same job uninterrupted: one process, `elastron train`, no Ray."""
    import yaml

    ref = json.loads(json.dumps(cfg))
    ref["checkpoint"]["interval_steps"] = max(steps, 1)
    path = workdir / "reference.yaml"
    path.write_text(yaml.safe_dump(ref))
    out = workdir / "reference"
    # The one rank `elastron train --nproc 1` starts, but with one thread as each Ray worker has: the
    # launcher gives a lone rank every core, and two OpenMP threads spinning against the shared box's
    # other load made steps of 1-7 s where one thread takes ~0.05 s.
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "workers.train", str(path), "--run-dir", str(out), "--steps", str(steps)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
    rows = {r["step"]: r["loss"] for r in _metric_rows(out)}
    return [rows[s] for s in range(1, steps + 1)]


def check_losses(run_dir: Path, cfg: dict) -> dict:
    """Elastron's replay losses (RUN_DIR/metrics.jsonl) against the uninterrupted single-process run."""
    rows = _metric_rows(run_dir)
    steps = max(r["step"] for r in rows)
    ref = reference_losses(cfg, Path(tempfile.mkdtemp(prefix="spot-trace-ref-")), steps)
    return {**loss_agreement(rows, ref), "reference": "uninterrupted single-process run (workers.train, 1 rank)"}


# -- output --------------------------------------------------------------------------------------------
def _in_use(pts: list, duration_s: float) -> tuple[list[float], list[int]]:
    """The world size training at each moment from (t, world size, samples) points: 0 through any gap
    between steps longer than 2 s and 3x the median one (also after the last step, if it came that long
    before the end): the stalls a reader should see, not every slow step."""
    gaps = [b[0] - a[0] for a, b in zip(pts[1:], pts[2:])]
    typical = statistics.median(gaps) if gaps else 0.0
    limit = max(2.0, 3 * typical)
    xs, ys = [], []
    for p, nxt in zip(pts, [*pts[1:], (duration_s, None, None)]):
        xs.append(p[0])
        ys.append(p[1])
        if nxt[0] - p[0] > limit:
            xs.append(p[0] + typical)
            ys.append(0)
    return xs, ys


def plot(path: Path, sched: Schedule, runs: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    xs = [t for t, _ in sched.availability] + [sched.duration_s]
    ys = [k for _, k in sched.availability] + [sched.availability[-1][1]]
    ax1.step(xs, ys, where="post", color="black", lw=2.5, alpha=0.35, label="nodes available")
    for i, (name, r) in enumerate(runs.items()):
        pts = r["series"]
        lift = 0.04 * (i + 1)  # so that systems at the same size stay visible side by side
        xs_, ys_ = _in_use(pts, sched.duration_s)
        ax1.step(xs_, [y + lift for y in ys_], where="post", label=f"{name}: workers in use (0: stalled)")
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], label=name)
    ax1.set_ylabel("nodes / workers training")
    ax1.legend(loc="lower left", fontsize=8)
    ax2.set_ylabel("samples that count (cumulative)")
    ax2.set_xlabel("wall seconds since the replay started")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def series(run: SystemRun, gbs: int) -> list[tuple[float, int, int]]:
    """(seconds since t0, world size, samples progressed since t0) at each step in the window."""
    step0 = max((r["step"] for r in run.rows if r["time"] <= run.t0), default=0)
    out = [(0.0, 0, 0)]
    base = next((r for r in reversed(run.rows) if r["time"] <= run.t0), None)
    if base:
        out = [(0.0, base["world_size"], 0)]
    for r in run.rows:
        if run.t0 < r["time"] <= run.t_end:
            out.append((round(r["time"] - run.t0, 3), r["world_size"], (r["step"] - step0) * gbs))
    return out


def table(results: dict) -> str:
    lines = ["| system | goodput (samples/s) | ÷ ideal | ÷ own ideal | steps counted | redone | stall: join | "
             "stall: notice | stall: no notice |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["systems"].items():
        a = r["analysis"]
        st = a["stall_s"]
        lines.append(f"| {name} | {a['goodput_samples_per_s']:.1f} | {100 * a.get('goodput_vs_ideal', 0):.0f}% | "
                     f"{100 * a.get('goodput_vs_own_ideal', 0):.0f}% | "
                     f"{a['steps_counted']} | {a['steps_redone']} | {st[JOIN]:.1f} s ({a['stalls'][JOIN]}) | "
                     f"{st[NOTICED]:.1f} s ({a['stalls'][NOTICED]}) | {st[UNNOTICED]:.1f} s ({a['stalls'][UNNOTICED]}) |")
    return "\n".join(lines)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--k", type=int, default=4, help="simulated nodes at most (4-6 fit a 2-core box)")
    ap.add_argument("--window-start-min", default="auto",
                    help="trace minute the window starts at (default: the busiest window of its length)")
    ap.add_argument("--window-min", type=float, default=10.0, help="trace minutes replayed")
    ap.add_argument("--compression", type=float, default=10.0, help="trace seconds per wall second")
    ap.add_argument("--notice-share", type=float, default=0.75, help="share of removals with the 2-min notice")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mapping", choices=MAPPINGS, default="events",
                    help="events: one simulated event per trace event, within 1..K; scaled: round(alive*K/32)")
    ap.add_argument("--ckpt-every", type=int, default=20, help="checkpoint interval (steps), every system")
    ap.add_argument("--settle", type=float, default=None, help="Elastron's settle_seconds (default: its own)")
    ap.add_argument("--monitor-interval", type=float, default=5.0, help="Ray Train's elastic monitor interval")
    ap.add_argument("--calibrate-steps", type=int, default=40)
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run for the loss check")
    ap.add_argument("--json", type=Path, help="write the results here (and the plot beside it, .png)")
    ap.add_argument("--dry-run", action="store_true", help="print the schedule and exit")
    ap.add_argument("--check-losses", type=Path, metavar="RUN_DIR",
                    help="only compare an earlier replay's Elastron losses (its run dir, kept in the JSON's "
                         "extra.run_dir) with an uninterrupted run; stored into --json")
    ap.add_argument("--replot", action="store_true", help="only redraw --json's PNG from the JSON")
    args = ap.parse_args(argv)
    if args.replot:
        res = json.loads(args.json.read_text())
        done = {n: r for n, r in res["systems"].items() if "series" in r}
        sched = Schedule(k=res["k"], k0=res["k0"], actions=(), availability=tuple(map(tuple, res["availability"])),
                         duration_s=res["replay_s"], notice_s=res["notice_s"], dropped=res["dropped"],
                         trace_events=res["trace_events"])
        plot(args.json.with_suffix(".png"), sched, done)
        print(table({"systems": done}))
        return 0
    if args.check_losses:
        res = json.loads(args.json.read_text())
        out = check_losses(args.check_losses, job_config(k=res["k"], ckpt_every=res["ckpt_every"]))
        res["systems"]["elastron"]["losses"] = out
        args.json.write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(json.dumps(out))
        return 0

    events = load_trace(args.trace)
    window_s = args.window_min * 60
    start_s = busiest_window(events, window_s) if args.window_start_min == "auto" else float(args.window_start_min) * 60
    sched = build_schedule(events, start_s=start_s, window_s=window_s, k=args.k, compression=args.compression,
                           notice_share=args.notice_share, seed=args.seed, mapping=args.mapping)
    meta = {"trace": str(args.trace), "k": args.k, "window_start_min": start_s / 60, "window_min": args.window_min,
            "compression": args.compression, "notice_share": args.notice_share, "seed": args.seed,
            "mapping": args.mapping,
            "ckpt_every": args.ckpt_every, "settle": args.settle, "monitor_interval": args.monitor_interval,
            "k0": sched.k0, "replay_s": sched.duration_s, "notice_s": sched.notice_s,
            "trace_events": sched.trace_events, "dropped": sched.dropped,
            "actions": [asdict(a) for a in sched.actions], "availability": sched.availability,
            "date": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(), "argv": sys.argv[1:]}
    print(json.dumps({k: v for k, v in meta.items() if k not in ("actions", "availability")}), flush=True)
    if args.dry_run:
        for a in sched.actions:
            print(a)
        return 0

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray
    from ray.cluster_utils import Cluster

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    cfg = job_config(k=args.k, ckpt_every=args.ckpt_every)
    gbs = cfg["train"]["global_batch_size"]
    work = Path(tempfile.mkdtemp(prefix="spot-trace-"))
    results: dict = {**meta, "global_batch_size": gbs, "systems": {}}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address, log_to_driver=False)
    runs: dict[str, SystemRun] = {}
    try:
        cal = calibrate(cluster, cfg, work, k=args.k, steps=args.calibrate_steps)
        thr = cal["throughput_by_size"]
        results["calibration"] = {str(k): round(v, 2) for k, v in thr.items()}
        print(json.dumps({"calibration_samples_per_s": results["calibration"]}), flush=True)
        ideal = ideal_samples(list(sched.availability), sched.duration_s, thr)
        for name in args.systems:
            t_start = time.time()
            try:
                if name == "elastron":
                    run = run_elastron(cluster, sched, cfg, work, settle=args.settle)
                else:
                    run = run_raytrain(cluster, sched, cfg, work, elastic=name == "raytrain",
                                       monitor_s=args.monitor_interval)
            except Exception as e:  # noqa: BLE001 - keep the other systems
                results["systems"][name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name} failed: {e}", flush=True)
                continue
            runs[name] = run
            a = analyse(run.rows, t0=run.t0, t_end=run.t_end, gbs=gbs, events=run.events, ideal=ideal,
                        availability=list(sched.availability))
            results["systems"][name] = {"analysis": a, "replay": run.replay, "extra": run.extra,
                                        "series": series(run, gbs), "load_avg_1m": os.getloadavg()[0],
                                        "run_s": round(time.time() - t_start, 1)}
            print(json.dumps({"system": name, **a}), flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    finally:
        ray.shutdown()
        cluster.shutdown()
    el = runs.get("elastron")
    if el is not None and not args.no_reference:
        results["systems"]["elastron"]["losses"] = check_losses(Path(el.extra["run_dir"]), cfg)
        print(json.dumps({"elastron_losses": results["systems"]["elastron"]["losses"]}), flush=True)
    done = {n: r for n, r in results["systems"].items() if "analysis" in r}
    el_g = done.get("elastron", {}).get("analysis", {}).get("goodput_samples_per_s")
    results["elastron_over"] = {n: (el_g / r["analysis"]["goodput_samples_per_s"]
                                    if el_g and r["analysis"]["goodput_samples_per_s"] else None)
                                for n, r in done.items() if n != "elastron"}
    print()
    print(table({"systems": done}))
    print(json.dumps({"elastron_over": results["elastron_over"]}))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        plot(args.json.with_suffix(".png"), sched, done)
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
