"""Goodput on a real spot trace: windows of AWS spot availability replayed onto a simulated Ray cluster,
against Elastron, Ray Train v2 elastic and fixed-size checkpoint-restart, one after the other, every
system on an emulated accelerator and on the same compressed clock.

    .venv/bin/python benchmarks/spot_trace.py [--trace FILE] [--k 4] [--windows busiest median calm] \
        [--window-min 20] [--compression 10] [--seeds 0 1] [--mappings events scaled] \
        [--systems elastron raytrain fixed] [--out benchmarks/results/spot-trace-emulated-k4]

What is emulated and what is real:
- the accelerator is emulated: the model (`--preset`, default `small`: 24M parameters, 0.29 GB of
  weights and AdamW moments, the state that moves on a resize) waits `--emulate-s-per-sample` seconds
  per sample of each micro-batch, a third in its forward and two thirds in its backward
  (`ModelConfig.emulate_s_per_sample`, models/emulation.py), on top of its real CPU computation; all three
  systems build the same model, so they run the same waits. The calibration states the real share of
  each step;
- everything else is real: the Ray cluster (`ray.cluster_utils.Cluster`: a head without worker slots,
  1-CPU nodes added, drained and killed), the worker processes, their gloo collectives, the state moves,
  the checkpoints on disk, each system's own control loop;
- the clock is compressed: the trace's seconds run `--compression` times as fast, and every configured
  wait of every system is divided by the same factor above stated floors (benchmarks/spot_clock.py);
  the JSON records each setting.

The trace (`--trace`, any file of `time_ms,add|remove,node_id` lines; its size, the most instances alive
at once, is read from it) and the mapping of a window onto K nodes: benchmarks/spot_schedule.py.
Windows: `busiest`, `median`, `calm` (by events in `--window-min` trace minutes) or trace minutes.

Every system trains the same job: `--preset`, byte corpus of the stdlib, seq_len `--seq-len`, global
batch lcm(1..K) (12 for K = 4, so every size divides it), one micro-batch per rank, lr 1e-3, a
checkpoint every `--ckpt-every` steps. Each replay starts when the system has trained its first step
at the starting size (process start-up is not counted) and lasts the window.
- elastron: the Coordinator with its defaults on the replay's clock, and a restart budget for a spot
  trace (its default, 3 failures in 10 minutes, is for crashes);
- raytrain: Ray Train v2 elastic as its documentation advises for spot (`ScalingConfig(num_workers=(1,
  K))`, unlimited failures, a just-in-time checkpoint on `get_preemption_info()`), the DDP + DCP loop of
  benchmarks/elastic_raytrain.py;
- fixed: the same loop at the starting size only (`num_workers=k0`): a lost node fails the group, which
  restarts from its last checkpoint once k0 nodes are there again.

Figures (benchmarks/spot_figures.py): goodput (each step once) per wall second; the ideal: the best
steady throughput measured at each size (the calibration, repeated, warm-up excluded, and every system's
own steady rate in the replay) integrated over the replay's availability with no cost for changing size
(a goodput above it is an error: the script says so and exits 1); work redone; stalls charged to the
event that started them; Elastron's per-step losses against an uninterrupted single-process run of the
same job without the emulation's waits (which change no value), fp32, 1e-4 relative. A system that fails
is a row with its error. With matplotlib installed, a PNG beside each replay's JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
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

from benchmarks.spot_clock import Clock  # noqa: E402
from benchmarks.spot_figures import (StallCause, above_ideal, analyse, best_by_size, ideal_samples,  # noqa: E402
                                     loss_agreement, steady_throughput, summarize)
from benchmarks.spot_schedule import (ActionKind, Mapping, Schedule, TraceEvent, WindowKind,  # noqa: E402,F401
                                      build_schedule, choose_windows, load_trace, mean_nodes, trace_size)

TRACE = ROOT.parent / "shared" / "data" / "spot-traces" / "aws-p3.2xlarge-32.csv"
SYSTEMS = ("elastron", "raytrain", "fixed")
SCALING_SHARE = 0.85
"""The calibration must show K workers at least this share of K times one worker's throughput."""
REAL_SHARE_MAX = 0.20
"""... and the real computation at most this share of the emulated device time at K workers."""


# -- the job ---------------------------------------------------------------------------------------------
def job_config(*, k: int, ckpt_every: int, preset: str, seq_len: int, emulate_s_per_sample: float,
               steps: int = 1_000_000) -> dict:
    gbs = math.lcm(*range(1, k + 1))
    gbs *= math.ceil(12 / gbs)
    overrides = {"emulate_s_per_sample": emulate_s_per_sample} if emulate_s_per_sample else {}
    return {
        "name": "spot-trace",
        "model": {"preset": preset, "overrides": overrides},
        "data": {"source": "corpus", "seq_len": seq_len, "max_bytes": 300_000},
        # micro_batch_size is an upper bound: the planner takes the whole per-rank batch, as Ray Train's loop does
        "train": {"steps": steps, "decay_steps": 100_000, "global_batch_size": gbs, "micro_batch_size": gbs,
                  "lr": 1e-3, "warmup_steps": 2, "seed": 11},
        "parallel": {"min_workers": 1, "max_workers": k},
        "checkpoint": {"interval_steps": ckpt_every, "keep_last": 2},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }


# -- the replay (on a live cluster) ------------------------------------------------------------------------
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
            rec = {"kind": a.kind.value, "slot": a.slot, "notice": a.notice, "planned": round(a.at, 2),
                   "at": round(t - t0, 2), "time": t}
            try:
                if a.kind is ActionKind.ADD:
                    self.nodes[a.slot] = self.cluster.add_node(num_cpus=1)
                elif a.kind is ActionKind.NOTICE:
                    drain_node(self.nodes[a.slot].node_id, message="spot trace: interruption notice",
                               deadline_remaining_s=self.schedule.notice_s)
                else:
                    kill_node(self.cluster, self.nodes.pop(a.slot))
            except Exception as e:  # noqa: BLE001 - a failed action is recorded; the replay goes on
                rec["error"] = f"{type(e).__name__}: {e}"
                self.log(f"replay: {a.kind.value} slot {a.slot} failed: {rec['error']}")
            rec["took_s"] = round(time.time() - t, 2)
            self.done.append(rec)

    def events(self) -> list[tuple[float, StallCause]]:
        """(unix time, cause) of what was done, for charging stalls."""
        out = []
        for r in self.done:
            if r["kind"] == ActionKind.ADD.value:
                out.append((r["time"], StallCause.JOIN))
            elif r["kind"] == ActionKind.NOTICE.value:
                out.append((r["time"], StallCause.NOTICED))
            else:
                out.append((r["time"], StallCause.NOTICED if r["notice"] else StallCause.UNNOTICED))
        return out

    def close(self) -> None:
        from service.pool.cluster import kill_node

        for slot in list(self.nodes):
            try:
                kill_node(self.cluster, self.nodes.pop(slot))
            except Exception as e:  # noqa: BLE001 - already gone
                self.log(f"replay: removing slot {slot} failed ({e}); it may already be gone")


def _wait(cond, timeout: float, what: str):
    """cond()'s first truthy value, or TimeoutError naming `what` (imported here, where Ray is loaded,
    so that the pure modules stay free of it)."""
    from benchmarks.chaos_env import wait

    return wait(cond, timeout, what)


@dataclass
class SystemRun:
    system: str
    t0: float
    t_end: float
    rows: list[dict]
    replay: list[dict]
    events: list[tuple[float, StallCause]]
    extra: dict = field(default_factory=dict)


def _coordinator(cfg: dict, run_dir: Path, clock: Clock):
    from service.control.coordinator import Coordinator, CoordinatorOptions
    from service.control.job import Job
    from workers.config import JobConfig

    opts = CoordinatorOptions(max_restarts=10_000, **clock.elastron())
    return Coordinator(Job.of(JobConfig.from_dict(cfg), job_id=f"spot-{run_dir.name}", run_dir=run_dir),
                       options=opts)


def _metric_rows(run_dir: Path) -> list[dict]:
    from service.control.run_files import read_metrics

    return [{"time": r["time"], "step": r["step"], "world_size": r["world_size"], "loss": r["loss"]}
            for r in read_metrics(run_dir / "metrics.jsonl", after=0)]


def run_elastron(cluster, sched: Schedule, cfg: dict, workdir: Path, clock: Clock, log=print) -> SystemRun:
    from service.control.commands import Stop

    replay = Replay(cluster, sched, log)
    replay.start()
    run_dir = workdir / f"elastron-{uuid.uuid4().hex[:6]}"
    coord = _coordinator(cfg, run_dir, clock)
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


def run_raytrain(cluster, sched: Schedule, cfg: dict, workdir: Path, clock: Clock, *, elastic: bool,
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
    scaling = (ScalingConfig(num_workers=(1, sched.k), elastic_resize_monitor_interval_s=clock.ray_monitor_interval_s())
               if elastic else ScalingConfig(num_workers=sched.k0))
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
        _wait(lambda: fit_state.get("done") or any(s["world_size"] == sched.k0 for s in steplog.poll() and steplog.steps()),
              300, f"Ray Train's first step on {sched.k0} workers")
        if fit_state.get("done"):
            raise RuntimeError(f"fit() ended before its first step: {fit_state.get('error')}")
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


def calibrate(cluster, cfg: dict, workdir: Path, clock: Clock, *, k: int, steps: int, warmup: int, repeats: int,
              log=print) -> dict:
    """Elastron on k nodes, stepping down from k workers to 1 (`SetWorkers`), `warmup` + `steps` steps at
    each, `repeats` times: each size's steady throughput per repeat (warm-up excluded) and the best."""
    from service.control.commands import SetWorkers, Stop
    from service.pool.cluster import kill_node

    nodes = [cluster.add_node(num_cpus=1) for _ in range(k)]
    cluster.wait_for_nodes()
    run_dir = workdir / "calibration"
    coord = _coordinator(cfg, run_dir, clock)
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    spans: list[tuple[int, int, int, int]] = []  # (repeat, size, first step, last step)
    try:
        for rep in range(repeats):
            for n in range(k, 0, -1):
                if (rep, n) != (0, k):
                    coord.send(SetWorkers(workers=n))
                _wait(lambda n=n: coord.group is not None and coord.group.size == n and coord.step_done >= 1,
                      600, f"calibration on {n} workers")
                _wait(lambda n=n: _metric_rows(run_dir) and _metric_rows(run_dir)[-1]["world_size"] == n, 600,
                      f"a step on {n} workers")
                first = coord.step_done
                _wait(lambda first=first: coord.step_done >= first + warmup + steps, 600,
                      f"{warmup + steps} steps on {n} workers")
                spans.append((rep, n, first, coord.step_done))
                log(f"calibration: repeat {rep + 1}, {n} workers done")
    finally:
        coord.send(Stop())
        thread.join(timeout=120)
        for nd in nodes:
            kill_node(cluster, nd)
    rows = _metric_rows(run_dir)
    gbs = cfg["train"]["global_batch_size"]
    per_repeat: list[dict[int, float]] = []
    for rep in range(repeats):
        thr: dict[int, float] = {}
        for r, n, first, last in spans:
            if r == rep:
                seg = [x for x in rows if first <= x["step"] <= last and x["world_size"] == n]
                thr |= steady_throughput(seg, gbs, warmup=warmup)
        per_repeat.append(thr)
    best = best_by_size(*per_repeat)
    s = cfg["model"]["overrides"].get("emulate_s_per_sample", 0.0)
    emulated = {n: gbs / n * s for n in best}
    real_share = {n: (gbs / best[n] - emulated[n]) / emulated[n] for n in best} if s else {}
    scaling = best.get(k, 0.0) / (k * best[1]) if best.get(1) else None
    return {"throughput_by_size": best, "per_repeat": [{str(n): round(v, 2) for n, v in t.items()} for t in per_repeat],
            "steps_per_size": steps, "warmup_steps": warmup, "repeats": repeats,
            "emulated_step_s": {str(n): round(v, 3) for n, v in emulated.items()},
            "measured_step_s": {str(n): round(gbs / v, 3) for n, v in best.items()},
            "real_share_of_emulated": {str(n): round(v, 3) for n, v in real_share.items()},
            "scaling_k_over_k_times_1": scaling,
            "emulation_ok": bool(scaling is not None and scaling >= SCALING_SHARE and real_share
                                 and real_share.get(k, 1.0) <= REAL_SHARE_MAX)}


def reference_losses(cfg: dict, workdir: Path, steps: int) -> list[float]:
    """The same job uninterrupted, without the emulation's waits (they change no value): one process,
    `workers.train` (what `elastron train --nproc 1` runs), one thread as each Ray worker has."""
    import yaml

    ref = json.loads(json.dumps(cfg))
    ref["checkpoint"]["interval_steps"] = max(steps, 1)
    ref["model"]["overrides"].pop("emulate_s_per_sample", None)
    path = workdir / "reference.yaml"
    path.write_text(yaml.safe_dump(ref))
    out = workdir / "reference"
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "workers.train", str(path), "--run-dir", str(out), "--steps", str(steps)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
    rows = {r["step"]: r["loss"] for r in _metric_rows(out)}
    return [rows[s] for s in range(1, steps + 1)]


# -- output ------------------------------------------------------------------------------------------------
def _in_use(pts: list, duration_s: float) -> tuple[list[float], list[int]]:
    """The world size training at each moment from (t, world size, samples) points: 0 through any gap
    between steps longer than 3x the median one (also after the last step): the stalls a reader should
    see, not every slow step."""
    import statistics

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


def plot(path: Path, availability: list, duration_s: float, runs: dict[str, dict]) -> bool:
    """The available nodes, each system's workers in use and its cumulative samples, as a PNG; False
    (and a line saying how to get it) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot {path.name} (pip install matplotlib, or "
              "pip install -e '.[bench]'; --replot draws it later from the JSON)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    xs = [t for t, _ in availability] + [duration_s]
    ys = [k for _, k in availability] + [availability[-1][1]]
    ax1.step(xs, ys, where="post", color="black", lw=2.5, alpha=0.35, label="nodes available")
    for i, (name, r) in enumerate(runs.items()):
        pts = r["series"]
        lift = 0.04 * (i + 1)  # so that systems at the same size stay visible side by side
        xs_, ys_ = _in_use(pts, duration_s)
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
    return True


def series(run: SystemRun, gbs: int) -> list[tuple[float, int, int]]:
    """(seconds since t0, world size, samples progressed since t0) at each step in the window."""
    base = next((r for r in reversed(run.rows) if r["time"] <= run.t0), None)
    step0 = base["step"] if base else 0
    out = [(0.0, base["world_size"] if base else 0, 0)]
    for r in run.rows:
        if run.t0 < r["time"] <= run.t_end:
            out.append((round(r["time"] - run.t0, 3), r["world_size"], (r["step"] - step0) * gbs))
    return out


def table(systems: dict[str, dict]) -> str:
    """One replay's rows, a failed system as a row with its error."""
    lines = ["| system | goodput (samples/s) | ÷ ideal | steps counted | redone | stall: join | stall: notice | "
             "stall: no notice | stall: start |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in systems.items():
        a = r.get("analysis")
        if a is None:
            lines.append(f"| {name} | failed: {r.get('error', '?')} | | | | | | | |")
            continue
        st, n = a["stall_s"], a["stalls"]
        cell = lambda c: f"{st[c.value]:.1f} s ({n[c.value]})"  # noqa: E731
        lines.append(f"| {name} | {a['goodput_samples_per_s']:.2f} | {100 * a['goodput_vs_ideal']:.0f}% | "
                     f"{a['steps_counted']} | {a['steps_redone']} | {cell(StallCause.JOIN)} | "
                     f"{cell(StallCause.NOTICED)} | {cell(StallCause.UNNOTICED)} | {cell(StallCause.START)} |")
    return "\n".join(lines)


def summary_table(summary: dict[str, dict]) -> str:
    lines = ["| system | replays | ÷ ideal: mean | min | max | stdev | goodput mean (samples/s) | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        r, g = s["goodput_vs_ideal"], s["goodput_samples_per_s"]
        if not r["n"]:
            lines.append(f"| {name} | 0 | | | | | | {s['failed_replays']} |")
            continue
        lines.append(f"| {name} | {r['n']} | {100 * r['mean']:.1f}% | {100 * r['min']:.1f}% | {100 * r['max']:.1f}% | "
                     f"{100 * r['stdev']:.1f} pts | {g['mean']:.2f} | {s['failed_replays']} |")
    return "\n".join(lines)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# -- one replay, many replays ------------------------------------------------------------------------------
def replay_window(cluster, sched: Schedule, cfg: dict, work: Path, clock: Clock, systems: list[str],
                  calibration: dict[int, float]) -> dict:
    """Every system on one schedule; the ideal from the calibration and every system's own steady rates."""
    gbs = cfg["train"]["global_batch_size"]
    runs: dict[str, SystemRun] = {}
    out: dict[str, dict] = {}
    for name in systems:
        t_start = time.time()
        try:
            if name == "elastron":
                runs[name] = run_elastron(cluster, sched, cfg, work, clock)
            else:
                runs[name] = run_raytrain(cluster, sched, cfg, work, clock, elastic=name == "raytrain")
        except Exception as e:  # noqa: BLE001 - a failed system is a row with its error
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500], "run_s": round(time.time() - t_start, 1),
                         "load_avg_1m": os.getloadavg()[0]}
            print(f"{name} failed: {e}", flush=True)
            continue
        out[name] = {"run_s": round(time.time() - t_start, 1), "load_avg_1m": os.getloadavg()[0]}
    own = {n: steady_throughput([r for r in run.rows if run.t0 < r["time"] <= run.t_end], gbs)
           for n, run in runs.items()}
    thr = best_by_size(calibration, *own.values())
    ideal = ideal_samples(list(sched.availability), sched.duration_s, thr)
    for name, run in runs.items():
        a = analyse(run.rows, t0=run.t0, t_end=run.t_end, gbs=gbs, events=run.events, thr=thr, ideal=ideal)
        out[name] |= {"analysis": a, "replay": run.replay, "extra": run.extra, "series": series(run, gbs),
                      "t0": run.t0, "t_end": run.t_end, "events": [(t, c.value) for t, c in run.events],
                      "rows": [{k: r[k] for k in ("time", "step", "world_size", "attempt") if k in r} for r in run.rows]}
        print(json.dumps({"system": name, **{k: v for k, v in a.items() if k != "own_throughput_by_size"}}), flush=True)
    return {"ideal_throughput_by_size": {str(k): round(v, 2) for k, v in thr.items()},
            "ideal_samples": round(ideal, 1), "systems": out}


def _schedule_meta(sched: Schedule) -> dict:
    return {"k0": sched.k0, "replay_s": sched.duration_s, "notice_s": sched.notice_s,
            "trace_events": sched.trace_events, "dropped": sched.dropped, "trace_size": sched.trace_size,
            "mean_nodes": round(mean_nodes(sched), 3), "actions": [asdict(a) for a in sched.actions],
            "availability": sched.availability}


def write_summary(out: Path) -> int:
    """summary.json from every replay JSON in `out` (runs of several invocations, one calibration): the
    table per replay and the mean and spread per system; 1 if a goodput exceeds its ideal."""
    replays = [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "summary.json"]
    replays = [r for r in replays if "systems" in r and "window" in r]
    if not replays:
        raise SystemExit(f"no replay JSON in {out}; run the replays with --out {out} first")
    old = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    summary = {"calibration": old.get("calibration"), "clock": replays[0]["clock"],
               "replays": [{"name": f"{r['window']}-{r['mapping']}-seed{r['seed']}", "window_start_min":
                            r["window_start_min"], "ideal_samples": r["ideal_samples"], "commit": r.get("commit"),
                            "date": r.get("date"), "systems": {n: {k: v for k, v in x.items()
                                                                 if k in ("analysis", "error", "losses", "load_avg_1m")}
                                                             for n, x in r["systems"].items()}} for r in replays],
               "summary": summarize(replays)}
    summary["above_ideal"] = {x["name"]: above_ideal(x["systems"]) for x in summary["replays"] if above_ideal(x["systems"])}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    for x in summary["replays"]:
        print(f"\n{x['name']} (trace minute {x['window_start_min']:.0f})\n" + table(x["systems"]))
    print("\n" + summary_table(summary["summary"]))
    if summary["above_ideal"]:
        print(f"error: goodput above the ideal in {summary['above_ideal']}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE, help="time_ms,add|remove,node_id lines")
    ap.add_argument("--k", type=int, default=4, help="simulated nodes at most (4 fit a 2-core box)")
    ap.add_argument("--windows", nargs="+", default=[w.value for w in WindowKind],
                    help="busiest, median, calm (by events per window) or a trace minute the window starts at")
    ap.add_argument("--window-min", type=float, default=20.0, help="trace minutes replayed per window")
    ap.add_argument("--compression", type=float, default=10.0, help="trace seconds per wall second")
    ap.add_argument("--interval-floor", type=float, default=0.5, help="s: the least any compressed interval is set to")
    ap.add_argument("--timeout-floor", type=float, default=20.0,
                    help="s: the least a compressed timeout bounding real work (a start) is set to")
    ap.add_argument("--notice-share", type=float, default=0.75, help="share of removals with the 2-min notice")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--mappings", nargs="+", choices=[m.value for m in Mapping], default=[m.value for m in Mapping])
    ap.add_argument("--preset", default="small", help="model preset (small: 0.29 GB of weights + AdamW state)")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--emulate-s-per-sample", type=float, default=1.0,
                    help="emulated device seconds per sample (forward + backward)")
    ap.add_argument("--ckpt-every", type=int, default=20, help="checkpoint interval (steps), every system")
    ap.add_argument("--calibrate-steps", type=int, default=6, help="steady steps per size, after the warm-up")
    ap.add_argument("--calibrate-warmup", type=int, default=2)
    ap.add_argument("--calibrate-repeats", type=int, default=2)
    ap.add_argument("--calibration", type=Path, help="reuse the calibration of an earlier summary JSON (same job)")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run for the loss check")
    ap.add_argument("--out", type=Path, help="directory: one JSON (+ PNG) per replay and summary.json")
    ap.add_argument("--dry-run", action="store_true", help="print the windows and schedules and exit")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNGs of --out's replays")
    ap.add_argument("--summarize", action="store_true",
                    help="only write --out's summary.json (mean and spread per system) from every replay JSON there")
    args = ap.parse_args(argv)
    if args.summarize:
        return write_summary(args.out)

    if args.replot:
        for p in sorted(args.out.glob("*.json")):
            res = json.loads(p.read_text())
            if "availability" in res:
                done = {n: r for n, r in res["systems"].items() if "series" in r}
                plot(p.with_suffix(".png"), [tuple(x) for x in res["availability"]], res["replay_s"], done)
        return 0
    events = load_trace(args.trace)
    window_s = args.window_min * 60
    chosen = choose_windows(events, window_s)
    starts = {w: chosen[WindowKind(w)] if w in WindowKind._value2member_map_ else float(w) * 60 for w in args.windows}
    clock = Clock(args.compression, interval_floor_s=args.interval_floor, timeout_floor_s=args.timeout_floor)
    plan = [(w, m, seed, build_schedule(events, start_s=starts[w], window_s=window_s, k=args.k,
                                        compression=args.compression, notice_share=args.notice_share, seed=seed,
                                        mapping=Mapping(m)))
            for w in args.windows for m in args.mappings for seed in args.seeds]
    cfg = job_config(k=args.k, ckpt_every=args.ckpt_every, preset=args.preset, seq_len=args.seq_len,
                     emulate_s_per_sample=args.emulate_s_per_sample)
    gbs = cfg["train"]["global_batch_size"]
    meta = {"trace": args.trace.name, "trace_size": trace_size(events), "k": args.k, "window_min": args.window_min,
            "windows": {w: s / 60 for w, s in starts.items()}, "notice_share": args.notice_share,
            "seeds": args.seeds, "mappings": args.mappings, "job": cfg, "global_batch_size": gbs,
            "clock": clock.record(), "date": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(),
            "argv": sys.argv[1:]}
    print(json.dumps({k: v for k, v in meta.items() if k not in ("job", "clock")}), flush=True)
    for w, m, seed, s in plan:
        print(f"{w} (minute {starts[w] / 60:.0f}) {m} seed {seed}: k0 {s.k0}, {s.trace_events} events, "
              f"{s.dropped} dropped, {len(s.actions)} actions, mean {mean_nodes(s):.2f} nodes", flush=True)
    if args.dry_run:
        return 0

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.update(clock.ray_env())
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    import ray
    from ray.cluster_utils import Cluster

    out = args.out
    if out:
        out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="spot-trace-"))
    summary: dict = {**meta, "replays": []}
    replays: list[dict] = []
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "benchmarks.spot_clock.ray_worker_setup"})
    try:
        if args.calibration:
            cal = json.loads(args.calibration.read_text())["calibration"]
            print(f"calibration reused from {args.calibration.name}", flush=True)
        else:
            cal = calibrate(cluster, cfg, work, clock, k=args.k, steps=args.calibrate_steps,
                            warmup=args.calibrate_warmup, repeats=args.calibrate_repeats)
            cal = {**cal, "throughput_by_size": {str(k): round(v, 3) for k, v in cal["throughput_by_size"].items()},
                   "load_avg_1m": os.getloadavg()[0]}
        summary["calibration"] = cal
        print(json.dumps({"calibration": cal}), flush=True)
        if out:
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        cal_thr = {int(k): v for k, v in cal["throughput_by_size"].items()}
        for w, m, seed, sched in plan:
            name = f"{w}-{m}-seed{seed}"
            print(f"== {name}", flush=True)
            res = {**{k: v for k, v in meta.items() if k != "job"}, "window": w, "window_start_min": starts[w] / 60,
                   "mapping": m, "seed": seed, **_schedule_meta(sched)}
            res |= replay_window(cluster, sched, cfg, work, clock, args.systems, cal_thr)
            res["above_ideal"] = above_ideal(res["systems"])
            replays.append(res)
            summary["replays"].append({"name": name, "ideal_samples": res["ideal_samples"],
                                       "systems": {n: {k: v for k, v in r.items() if k in ("analysis", "error")}
                                                   for n, r in res["systems"].items()}})
            print(table(res["systems"]), flush=True)
            if out:
                (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
                plot(out / f"{name}.png", list(sched.availability), sched.duration_s,
                     {n: r for n, r in res["systems"].items() if "series" in r})
                (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    finally:
        ray.shutdown()
        cluster.shutdown()
    if not args.no_reference and "elastron" in args.systems:
        kept = [(i, r["systems"]["elastron"]) for i, r in enumerate(replays) if "extra" in r["systems"].get("elastron", {})]
        rows = {i: _metric_rows(Path(e["extra"]["run_dir"])) for i, e in kept}
        steps = max((x["step"] for rs in rows.values() for x in rs), default=0)
        if steps:
            ref = reference_losses(cfg, work, steps)
            for i, e in kept:
                own = max((x["step"] for x in rows[i]), default=0)  # the steps this replay's run trained
                e["losses"] = summary["replays"][i]["systems"]["elastron"]["losses"] = loss_agreement(rows[i], ref[:own])
                print(json.dumps({"replay": summary["replays"][i]["name"], "elastron_losses": e["losses"]}), flush=True)
    summary["summary"] = summarize(replays)
    bad = {r["window"] + "-" + r["mapping"] + f"-seed{r['seed']}": r["above_ideal"] for r in replays if r["above_ideal"]}
    summary["above_ideal"] = bad
    print()
    print(summary_table(summary["summary"]))
    if out:
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        for r in replays:
            name = f"{r['window']}-{r['mapping']}-seed{r['seed']}"
            (out / f"{name}.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    if bad:
        print(f"error: goodput above the ideal in {bad}: the ideal is not an upper bound; the calibration or "
              "the steady-rate measurement is wrong", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
