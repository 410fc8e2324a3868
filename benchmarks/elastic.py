"""Elastic events side by side in one run: Elastron moving state live, Elastron through storage, Ray Train v2.

    .venv/bin/python benchmarks/elastic.py [--state tiny|1gb] [--emulate-s-per-sample S] \
        [--scenarios resize join kill drain] [--systems elastron-live elastron-storage raytrain] [--json out.json]

Same simulated cluster (a head with no worker slots, 1-CPU worker nodes added per run), same model, same
data (byte corpus of the stdlib), checkpoint every 5 steps, the event at step ~12. `--state`:
  tiny  the tiny preset (0.85 M params, 10 MB of state), seq_len 32, global batch 12; the planner's
        default dp on CPU (replicas).
  1gb   the small preset with 30 blocks: 88.8 M params, 1.07 GB of fp32 weights + AdamW moments; seq_len
        16, global batch 6 (short steps: the first step at the new size is part of the figure); FSDP
        (`parallel.dp_mode: shard`), so every change of size moves shards between workers
        (`--dp-mode replicate`: replicas, so a kill can heal from the survivors). Ray Train runs the
        same model under DDP.
Scenarios (Elastron's systems differ in `parallel.reshard`, live or storage, and elastron-storage runs with
peer snapshots off, `checkpoint.peer_interval` 0, so that a kill restores from storage):
  (`--emulate-s-per-sample S`: every system's model waits S seconds per sample of each micro-batch, an
  emulated accelerator beside which the host is idle, `models.emulation`.)
  (`--tp N`: Elastron runs under `parallel.tp` N, on nodes of N slots each, two TP groups at most: a TP group
  stays in one node. Ray Train runs DDP as without.)
  resize 2 nodes, the user asks for 1 worker (`coord.resize`). Ray Train has no planned resize: not run.
  join   2 nodes, then one joins:                  event -> first step at world size 3
  kill   3 nodes, one dies without notice (kill_node): event -> first step at world size 2
  drain  3 nodes, one drained (preemption, 60 s deadline): event -> first step without that node
  steady 3 nodes, no event: the snapshots' cost. Elastron only (live), jobs back to back on the same nodes
         in rotation (`--steady-rounds` rotations, `--steady-steps` steps each): a snapshot after every
         step (`peer_budget` 0), none (`peer_interval` 0), and the default (paced by their measured cost,
         workers.pace); per job the median step (the trainer's step time), the median interval between two
         steps' ends (what a snapshot taken between steps adds), the snapshots per step, the first 3
         steps left out. A kill's steps redone depend on the interval: `--peer-budget 0` for one per step.
Ray Train v2 (`elastic_raytrain.measure_raytrain`) checkpoints with torch.distributed.checkpoint.

Per run: event -> first step at the new size, the stall (the end of the last step at the old size to
the end of the first at the new one; Ray Train's too), the coordinator's timeline after the event (events with
their offsets), the transfer record (live: handover, transfer, form; storage: the checkpoint and re-form
events), steps redone or lost, per-step losses. After each scenario's live run, on two of its nodes: raw
gloo point-to-point (two fresh Ray actors, `batch_isend_irecv` of the bytes the live transfer moved, one
direction), the denominator of the live transfer's throughput. Elastron grows after `--settle` seconds of
stable capacity (default 1 s); Ray Train's elastic monitor interval is 5 s (its default is 60 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.control.run_files import read_metrics  # noqa: E402

SCENARIOS = ("resize", "join", "kill", "drain", "steady")
SYSTEMS = ("elastron-live", "elastron-storage", "raytrain")
START_NODES = {"resize": 2, "join": 2, "kill": 3, "drain": 3, "steady": 3}
STEADY_WARMUP = 3  # steps left out of the steady medians (process warm-up, the first snapshot's buffers)
EVENT_STEP = 12  # between two checkpoints (every 5 steps): the event does not meet a background save


@dataclass(frozen=True, slots=True)
class State:
    """The workload both systems train: model, data shape and how Elastron spends data parallelism."""

    model: dict
    """JobConfig `model` section (preset + overrides); Ray Train builds the same ModelConfig."""
    seq_len: int
    global_batch_size: int
    """Divisible by 1, 2 and 3: the world sizes the scenarios pass through."""
    micro_batch_size: int
    dp_mode: str
    lr: float
    start_timeout_s: float
    """How long the first steps may take (process start, model build) before the run is abandoned."""
    peer_interval: int | None = None
    """Elastron's `checkpoint.peer_interval` (peer snapshots every N steps, 0 off); None: the job's default."""
    peer_budget: float | None = None
    """Elastron's `checkpoint.peer_budget` (0: a snapshot exactly every `peer_interval` steps; else they are
    taken less often where they cost more than that share of the step); None: the job's default."""
    tp: int | None = None
    """Elastron's `parallel.tp` (the planner picks the world size: a multiple of it); None: the planner's choice."""
    emulate_s_per_sample: float | None = None
    """`model.emulate_s_per_sample` for every system (an emulated accelerator, `models.emulation`: each
    micro-batch also waits this many seconds per sample, the host idle as beside a GPU); None: none."""

    @property
    def model_section(self) -> dict:
        """The JobConfig `model` section both systems build: `model` with the emulation's override."""
        if self.emulate_s_per_sample is None:
            return self.model
        return {**self.model, "overrides": {**self.model.get("overrides", {}),
                                            "emulate_s_per_sample": self.emulate_s_per_sample}}


STATES = {
    "tiny": State(model={"preset": "tiny"}, seq_len=32, global_batch_size=12, micro_batch_size=2, dp_mode="auto",
                  lr=3e-3, start_timeout_s=180),
    "1gb": State(model={"preset": "small", "overrides": {"n_layers": 30}}, seq_len=16, global_batch_size=6,
                 micro_batch_size=2, dp_mode="shard", lr=1e-3, start_timeout_s=600),
}


def _cfg(state: State, steps: int, reshard: str) -> dict:
    return {
        "model": state.model_section,
        "data": {"source": "corpus", "seq_len": state.seq_len, "max_bytes": 300_000},
        "train": {"steps": steps, "global_batch_size": state.global_batch_size,
                  "micro_batch_size": state.micro_batch_size, "lr": state.lr, "warmup_steps": 2},
        "parallel": {"min_workers": 1, "max_workers": _max_workers(state), "dp_mode": state.dp_mode, "reshard": reshard,
                     **({} if state.tp is None else {"tp": state.tp})},
        "checkpoint": {"interval_steps": 5, "keep_last": 2,
                       **({} if state.peer_interval is None else {"peer_interval": state.peer_interval}),
                       **({} if state.peer_budget is None else {"peer_budget": state.peer_budget})},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }


def _max_workers(state: State) -> int:
    """3 workers; under TP two TP groups (a TP group stays in one node: nodes get tp slots each)."""
    return 3 if state.tp is None else 2 * state.tp


def world_for(state: State, nodes: int) -> int:
    """The world size the planner picks on `nodes` nodes of `state.tp or 1` slots: a multiple of tp, at most
    `_max_workers` (tp=2: 3 nodes of 2 slots hold a group of 4 on two of them; after a kill the third
    node's slots replace the dead node's, 4 again)."""
    slots = state.tp or 1
    return min(_max_workers(state), nodes * slots) // slots * slots


def state_bytes(state: State) -> int:
    """fp32 weights + the two AdamW moments of the whole model (each DP replica holds this much)."""
    from models.llama import build_model
    from workers.config import JobConfig

    meta = build_model(JobConfig.from_dict(_cfg(state, 1, "live")).model.build())
    return 3 * 4 * sum(p.numel() for p in meta.parameters())


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _timeline(events: list[dict], t_event: float, until: float) -> list[list]:
    """[what, seconds after the event] for each coordinator event from the event to the first step."""
    out = []
    for e in events:
        if t_event <= e["time"] <= until:
            what = f"-> {e['to_state']}" if e["kind"] == "transition" else e["kind"]
            out.append([what, round(e["time"] - t_event, 3)])
    return out


def measure_elastron(*, cluster, scenario: str, workdir: str, state: State, reshard: str, settle: float = 1.0,
                     steps: int = 10_000, raw_reps: int = 3) -> dict:
    import ray

    from service.control.commands import SetWorkers, Stop
    from service.control.coordinator import Coordinator, CoordinatorOptions
    from service.control.job import Job
    from service.control.reconfiguration import Live
    from service.pool.cluster import drain_node, kill_node
    from workers.config import JobConfig

    slots = state.tp or 1
    added = [cluster.add_node(num_cpus=slots) for _ in range(START_NODES[scenario])]
    cluster.wait_for_nodes()
    coord = Coordinator(Job.of(JobConfig.from_dict(_cfg(state, steps, reshard)), job_id=f"{reshard}-{scenario}",
                               run_dir=Path(workdir) / f"elastron-{reshard}-{scenario}"),
                        options=CoordinatorOptions(settle_seconds=settle, chunk_seconds=0.2, poll_interval_s=0.1))
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    victim, out = None, None
    try:
        _wait(lambda: coord.step_done >= EVENT_STEP and str(coord.state.name) == "RUNNING", state.start_timeout_s,
              "the event step")
        before = coord.group.size
        me = ray.get_runtime_context().get_node_id()
        if scenario == "resize":
            target = 1
            t_event = time.time()
            coord.send(SetWorkers(workers=target))
        elif scenario == "join":
            added.append(cluster.add_node(num_cpus=slots))
            t_event = time.time()
            target = before + 1
        else:
            victim = next(n for n in added if n.node_id in coord.group.nodes() and n.node_id != me)
            t_event = time.time()
            if scenario == "kill":
                kill_node(cluster, victim)  # raylet, agents and workers at once, as a machine dies
            else:
                drain_node(victim.node_id, message="benchmark: spot reclaim", deadline_remaining_s=60)
            target = world_for(state, len(added) - 1)
        n_rc = len(coord.reconfigs)
        # Every reconfiguration after the event counts; the measurement ends at the first step of the
        # one that reaches the target size (intermediate ones, if any, are reported).
        _wait(lambda: any(r.world_size == target and r.first_step_time for r in coord.reconfigs[n_rc:]), 600,
              "the first step at the new size")
        after = coord.reconfigs[n_rc:]
        rc = next(r for r in after if r.world_size == target)
        _wait(lambda: coord.step_done >= rc.resumed_step + 6, 300, "6 steps at the new size")
        metrics = coord.metrics_since(0)
        # metrics.jsonl keeps every step's row as trained, a redone step's first run included (the
        # coordinator's rows keep only the newest row of each step)
        logged = read_metrics(Path(workdir) / f"elastron-{reshard}-{scenario}" / "metrics.jsonl", after=0)
        old_rows = rows_before(logged, first_step_time(after))
        out = {"system": f"elastron-{reshard}", "scenario": scenario, "path": rc.transfer.path if rc.transfer else None,
               "event_to_first_step_s": rc.first_step_time - t_event,
               # the stall: from the last step at the old size to the end of the first at the new one
               "stall_s": rc.first_step_time - old_rows[-1]["time"],
               "decided_after_s": after[0].detected - t_event,
               # steps the old group finished between the event and the decision (it trains on meanwhile)
               "steps_before_decision": sum(t_event < m["time"] <= after[0].detected for m in old_rows),
               "steps_redone_or_lost": sum(r.steps_lost for r in after[:after.index(rc) + 1]),
               # the peer snapshots' interval the ranks had agreed on before the event (workers.pace)
               "snapshot_interval": next((m["snapshot"].get("interval") for m in sorted(
                   metrics, key=lambda m: -m["step"]) if m["time"] <= t_event and m.get("snapshot")), None),
               "timeline": _timeline(coord.events_since(0), t_event, rc.first_step_time),
               "reconfigurations": [r.to_dict() for r in after],
               "world_size_before": before, "world_size_after": rc.world_size,
               "workers_started": rc.started, "workers_stopped": rc.stopped,
               "step_time_s": statistics.median(m["step_time"] for m in old_rows),
               # the median step at the new size after its first (what the first step is compared with)
               "step_time_after_s": statistics.median([m["step_time"] for m in metrics
                                                       if m["step"] > rc.resumed_step + 1] or [float("nan")]),
               "losses": {str(m["step"]): m["loss"] for m in metrics}}  # str: as JSON gives them back
        if isinstance(rc.transfer, Live):
            mv = rc.transfer.moved
            out["moving_state_s"] = mv.handover_s + mv.transfer_s
            out["transfer_throughput_Bps"] = mv.bytes_moved / mv.transfer_s if mv.transfer_s else None
        else:  # storage: a planned change checkpoints first; every change re-forms and loads
            out["moving_state_s"] = _storage_seconds(out["timeline"])
    finally:
        coord.send(Stop())
        t.join(timeout=180)
        if out is not None and out.get("transfer_throughput_Bps"):
            pair = [n for n in added if n is not victim][:2]
            try:
                out["raw_gloo"] = measure_raw_gloo(pair[0].node_id, pair[1].node_id,
                                                   nbytes=out["reconfigurations"][-1]["transfer"]["bytes_moved"],
                                                   reps=raw_reps)
                out["transfer_vs_raw"] = out["transfer_throughput_Bps"] / out["raw_gloo"]["throughput_Bps"]
            except Exception as e:  # noqa: BLE001 - the run's own figures are still worth keeping
                out["raw_gloo"] = {"error": f"{type(e).__name__}: {e}"}
        from benchmarks.elastic_raytrain import remove_nodes

        remove_nodes(cluster, added)
    return out


def first_step_time(after: list) -> float:
    """When the first group formed after the event finished its first step (the reconfiguration records
    `after` the event, oldest first; one that never trained a step is passed over)."""
    return next(r.first_step_time for r in after if r.first_step_time)


def rows_before(logged: list[dict], until: float) -> list[dict]:
    """The rows of metrics.jsonl (`logged`, every step as trained, a redone step's first run included)
    that ended before `until`, the end of the first step at the new layout: the old group's steps. A
    redone step's later row must not stand in for its first: it ends after the new group's first step."""
    out = [r for r in logged if r["time"] < until]
    if not out:
        raise ValueError(f"no step ended before the first step at the new layout ({until}): the run logged none")
    return out


def _storage_seconds(timeline: list[list]) -> float | None:
    """From the first state change (RESIZING or the failure) to the group re-formed on loaded state."""
    start = next((s for what, s in timeline if what in ("-> RESIZING", "failure")), None)
    end = next((s for what, s in timeline if what == "resize"), None)
    return None if start is None or end is None else end - start


# --------------------------------------------------------------------------------------------------
# Raw gloo point-to-point between two processes on two of the benchmark's nodes.
# --------------------------------------------------------------------------------------------------
class _Peer:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def send_recv(self, *, rank: int, port: int, nbytes: int, reps: int) -> list[float]:
        """[group set-up + first barrier, first message (connection set-up), then `reps` messages]."""
        import torch
        import torch.distributed as dist

        t = time.perf_counter()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        dist.barrier()
        out = [time.perf_counter() - t]
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            op = dist.isend if rank == 0 else dist.irecv
            for _ in range(reps + 1):  # the first is a warm-up (connection set-up)
                dist.barrier()
                t = time.perf_counter()
                for w in dist.batch_isend_irecv([dist.P2POp(op, buf, 1 - rank)]):
                    w.wait()
                out.append(time.perf_counter() - t)
            return out
        finally:
            dist.destroy_process_group()


def measure_raw_gloo(node_a: str, node_b: str, *, nbytes: int, reps: int = 3) -> dict:
    """`nbytes` from a process on `node_a` to one on `node_b` in one gloo message, `reps` times (after a
    warm-up); the receiver's clock, from a common barrier to the end of the receive."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    peer = ray.remote(num_cpus=0)(_Peer)
    a, b = (peer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
            for n in (node_a, node_b))
    try:
        port = ray.get(a.free_port.remote(), timeout=120)
        got = ray.get([a.send_recv.remote(rank=0, port=port, nbytes=nbytes, reps=reps),
                       b.send_recv.remote(rank=1, port=port, nbytes=nbytes, reps=reps)], timeout=600)[1]
    finally:
        for x in (a, b):
            ray.kill(x)
    init_s, first_s, times = got[0], got[1], got[2:]
    med = statistics.median(times)
    return {"bytes": nbytes, "seconds": times, "median_s": med, "throughput_Bps": nbytes / med,
            "group_setup_s": init_s, "first_message_s": first_s,
            "how": "2 fresh Ray actors on 2 of the run's nodes, one gloo batch_isend_irecv message, one direction"}


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def _fmt(x, unit="s", nd=2):
    return "—" if x is None else f"{x:.{nd}f} {unit}".strip()


def _system(r: dict) -> str:
    """The --systems name of a result (measure_raytrain calls itself ray-train-v2)."""
    return "raytrain" if r["system"] == "ray-train-v2" else r["system"]


def table(rows: list[dict]) -> str:
    lines = [("| scenario | system | path | event → first step | stall | moving state | transfer vs raw gloo | "
              "steps redone/lost | Ray Train ÷ this |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for sc in SCENARIOS:
        if sc == "steady":
            continue  # steady_table
        got = {_system(r): r for r in rows if r["scenario"] == sc}
        rt = got.get("raytrain")
        for name in SYSTEMS:
            r = got.get(name)
            if r is None:
                continue
            t = r.get("event_to_first_step_s")
            frac = r.get("transfer_vs_raw")
            if name == "raytrain":
                path, ratio = "DCP checkpoint", "—"
                move = r.get("moving_state_s")
                t_s = _fmt(t) + (" (timeout)" if r.get("timed_out") else "")
            else:
                path = r.get("path") or "?"
                move = r.get("moving_state_s")
                theirs = rt.get("event_to_first_step_s") if rt else None
                ratio = f"{theirs / t:.1f}×" if theirs and t else "—"
                t_s = _fmt(t)
            frac_s = "—" if frac is None else f"{100 * frac:.0f}%"
            lines.append(f"| {sc} | {name} | {path} | {t_s} | {_fmt(r.get('stall_s'))} | {_fmt(move)} | {frac_s} | "
                         f"{r.get('steps_redone_or_lost')} | {ratio} |")
    return "\n".join(lines)


def _loss_agreement(rows: list[dict]) -> dict:
    """Per scenario: the largest |loss(live) - loss(storage)| over the steps both ran at the new size."""
    out = {}
    for sc in SCENARIOS:
        got = {r["system"]: r for r in rows if r["scenario"] == sc and "losses" in r}
        a, b = got.get("elastron-live"), got.get("elastron-storage")
        if not a or not b:
            continue
        start = max(a["reconfigurations"][-1]["step_before"], b["reconfigurations"][-1]["step_before"])
        after = sorted(int(s) for s in set(a["losses"]) & set(b["losses"]) if int(s) > start)
        out[sc] = {"steps_compared": after, "same_event_step": a["reconfigurations"][-1]["step_before"] ==
                   b["reconfigurations"][-1]["step_before"],
                   "max_abs_diff": max((abs(a["losses"][str(s)] - b["losses"][str(s)]) for s in after), default=None)}
    return out


STEADY_MODES = {"every step": {"peer_interval": 1, "peer_budget": 0.0}, "off": {"peer_interval": 0},
                "paced (default)": {"peer_interval": None, "peer_budget": None}}
"""The steady scenario's jobs: (`checkpoint.peer_interval`, `checkpoint.peer_budget`) of each, None the
job's default: a snapshot after every step, none, and the default (every step unless they cost more than
`peer_budget` of the step, workers.pace)."""


def measure_steady(*, cluster, workdir: str, state: State, steps: int, rounds: int) -> dict:
    """The median step with peer snapshots every step, off, and paced by their cost (the default): 3
    workers, `rounds` rotations of jobs back to back (every step, off, paced, ...), `steps` steps each
    after `STEADY_WARMUP`; one row with every job's medians and the ratios of the pooled medians to off."""
    import ray  # noqa: F401 - the cluster's driver is connected by main

    from service.control.commands import Stop
    from service.control.coordinator import Coordinator, CoordinatorOptions
    from benchmarks.elastic_raytrain import remove_nodes
    from service.control.job import Job
    from workers.config import JobConfig

    added = [cluster.add_node(num_cpus=1) for _ in range(START_NODES["steady"])]
    cluster.wait_for_nodes()
    jobs: list[dict] = []
    try:
        for i, mode in enumerate(list(STEADY_MODES) * rounds):
            st = replace(state, **STEADY_MODES[mode])
            n = STEADY_WARMUP + steps  # the job runs 5 more, so that it is still running when stopped
            coord = Coordinator(Job.of(JobConfig.from_dict(_cfg(st, n + 5, "live")), job_id=f"steady-{i}",
                                       run_dir=Path(workdir) / f"steady-{i}"),
                                options=CoordinatorOptions(chunk_seconds=0.2, poll_interval_s=0.1))
            t = threading.Thread(target=coord.run, daemon=True)
            t.start()
            try:
                _wait(lambda: coord.step_done >= n, state.start_timeout_s + 60 * n, f"{n} steady steps")
                metrics = sorted(coord.metrics_since(0), key=lambda m: m["step"])
                world = coord.group.size if coord.group is not None else None
            finally:
                coord.send(Stop())
                t.join(timeout=180)
            kept = [m for m in metrics if m["step"] > STEADY_WARMUP]
            gaps = [b["time"] - a["time"] for a, b in zip(metrics, metrics[1:]) if a["step"] >= STEADY_WARMUP]
            jobs.append({"mode": mode, **STEADY_MODES[mode], "world_size": world,
                         "step_time_s": [m["step_time"] for m in kept], "interval_s": gaps,
                         "median_step_s": statistics.median(m["step_time"] for m in kept),
                         "median_interval_s": statistics.median(gaps),
                         "snapshot_steps": [m["step"] for m in metrics if m.get("snapshot")],
                         **snapshot_costs(kept),
                         "losses": {str(m["step"]): m["loss"] for m in metrics}})
            print(json.dumps({k: v for k, v in jobs[-1].items() if k != "losses"}), flush=True)
    finally:
        remove_nodes(cluster, added)
    return {"system": "elastron-live", "scenario": "steady", "jobs": jobs, "modes": steady_summary(jobs)}


def steady_summary(jobs: list[dict]) -> dict[str, dict]:
    """Per mode: the pooled medians of its jobs (step time, interval between step ends, each part of a
    snapshot's take), its snapshots per measured step, and the two medians' ratios to the mode "off"."""
    out: dict[str, dict] = {}
    for mode in dict.fromkeys(j["mode"] for j in jobs):
        mine = [j for j in jobs if j["mode"] == mode]
        m = {"jobs": len(mine),
             "median_step_s": statistics.median(x for j in mine for x in j["step_time_s"]),
             "median_interval_s": statistics.median(x for j in mine for x in j["interval_s"]),
             "snapshots_per_step": sum(len(j.get("take_copy_s", [])) for j in mine)
             / max(1, sum(len(j["step_time_s"]) for j in mine))}
        for part in ("wait", "agree", "copy"):
            if xs := [x for j in mine for x in j.get(f"take_{part}_s", [])]:
                m[f"median_take_{part}_s"] = statistics.median(xs)
        out[mode] = m
    if off := out.get("off"):
        for m in out.values():
            m["step_ratio"] = m["median_step_s"] / off["median_step_s"]
            m["interval_ratio"] = m["median_interval_s"] / off["median_interval_s"]
    return out


def snapshot_costs(rows: list[dict]) -> dict[str, list[float]]:
    """Per part of `PeerSnapshots.take` (wait for the previous round, agree on the committed step, and
    the wait before the last update for the previous round's background copy into host memory), its
    seconds on rank 0 at every step of `rows` that took a snapshot."""
    taken = [r["snapshot"] for r in rows if r.get("snapshot")]
    return {f"take_{part}_s": [t[f"{part}_s"] for t in taken] for part in ("wait", "agree", "copy")} if taken else {}


def steady_table(rows: list[dict]) -> str:
    lines = ["| peer snapshots | median step | median interval between step ends | ÷ off | snapshots per step "
             "| of a snapshot, in the training thread (median) | jobs |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["scenario"] != "steady" or "modes" not in r:
            continue
        for mode, m in r["modes"].items():
            take = (f"wait {_fmt(m.get('median_take_wait_s'))}, agree {_fmt(m.get('median_take_agree_s'))}, "
                    f"copy {_fmt(m.get('median_take_copy_s'))}" if "median_take_copy_s" in m else "-")
            ratio = f"{m['interval_ratio']:.3f}×" if "interval_ratio" in m else "-"
            lines.append(f"| {mode} | {_fmt(m['median_step_s'])} | {_fmt(m['median_interval_s'])} | {ratio} | "
                         f"{m['snapshots_per_step']:.2f} | {take} | {m['jobs']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", choices=tuple(STATES), default="tiny")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--dp-mode", choices=("auto", "shard", "replicate"),
                    help="Elastron's parallel.dp_mode instead of the state's (replicate: a kill can heal from peers)")
    ap.add_argument("--peer-interval", type=int, default=None,
                    help="Elastron's checkpoint.peer_interval (0: no peer snapshots); default: the job's default")
    ap.add_argument("--tp", type=int, help="Elastron's parallel.tp (Ray Train's DDP has no TP: it runs as without)")
    ap.add_argument("--emulate-s-per-sample", type=float, default=None,
                    help="model.emulate_s_per_sample for every system: an emulated accelerator's seconds per sample "
                         "of each micro-batch, the host waiting as beside a GPU (models.emulation); default: none")
    ap.add_argument("--settle", type=float, default=1.0, help="Elastron: stable capacity needed before growing")
    ap.add_argument("--steady-steps", type=int, default=10, help="steady: measured steps per job")
    ap.add_argument("--peer-budget", type=float, default=None,
                    help="Elastron's checkpoint.peer_budget (0: a snapshot exactly every peer_interval steps, as a "
                         "kill's steps-redone target needs); default: the job's default")
    ap.add_argument("--steady-rounds", type=int, default=1,
                    help="steady: rotations of jobs (snapshots every step, off, paced)")
    ap.add_argument("--keep-workdir", action="store_true",
                    help="keep the runs' directories (checkpoints, events, metrics) instead of removing them")
    ap.add_argument("--json", help="write all results here (merged into the file if it exists)")
    args = ap.parse_args(argv)

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray
    from ray.cluster_utils import Cluster

    from benchmarks.elastic_raytrain import measure_raytrain

    state = STATES[args.state]
    if args.dp_mode:
        state = replace(state, dp_mode=args.dp_mode)
    if args.peer_interval is not None:
        state = replace(state, peer_interval=args.peer_interval)
    if args.peer_budget is not None:
        state = replace(state, peer_budget=args.peer_budget)
    if args.tp is not None:
        state = replace(state, tp=args.tp)
    if args.emulate_s_per_sample is not None:
        state = replace(state, emulate_s_per_sample=args.emulate_s_per_sample)
    meta = {"state": args.state, "state_bytes": state_bytes(state), "workload": asdict(state),
            "date": time.strftime("%Y-%m-%d"), "commit": _commit(), "argv": sys.argv[1:]}
    print(json.dumps(meta), flush=True)
    prior = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    rows: list[dict] = [r for r in prior.get("results", [])
                        if not (r["scenario"] in args.scenarios and _system(r) in args.systems)]
    work = tempfile.mkdtemp(prefix="elastic-bench-")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        for sc in args.scenarios:
            if sc == "steady":
                t0 = time.time()
                try:
                    r = measure_steady(cluster=cluster, workdir=work, state=state, steps=args.steady_steps,
                                       rounds=args.steady_rounds)
                except Exception as e:  # noqa: BLE001 - keep the other runs
                    r = {"system": "elastron-live", "scenario": sc, "error": f"{type(e).__name__}: {e}"}
                r["load_avg_1m"], r["run_s"] = os.getloadavg()[0], round(time.time() - t0, 1)
                print(json.dumps({k: v for k, v in r.items() if k != "jobs"}, default=str), flush=True)
                rows.append(r)
                if args.json:
                    _write(args.json, meta, rows)
                continue
            for system in args.systems:
                t0 = time.time()
                if system == "raytrain":
                    if sc == "resize":
                        continue  # Ray Train has no user-driven resize of a running job
                    r = measure_raytrain(cluster=cluster, model_steps=EVENT_STEP + 10, ckpt_every=5, scenario=sc,
                                         event_step=EVENT_STEP, workdir=str(Path(work) / f"raytrain-{sc}"),
                                         model=state.model_section,
                                         global_batch_size=state.global_batch_size, seq_len=state.seq_len,
                                         lr=state.lr, warmup_timeout_s=state.start_timeout_s)
                else:
                    try:
                        # elastron-storage is the path without peer memory: peer snapshots off too
                        st = state if system == "elastron-live" else replace(state, peer_interval=0)
                        r = measure_elastron(cluster=cluster, scenario=sc, workdir=work, state=st,
                                             reshard=system.split("-")[1], settle=args.settle)
                    except Exception as e:  # noqa: BLE001 - keep the other runs
                        r = {"system": system, "scenario": sc, "error": f"{type(e).__name__}: {e}"}
                r["load_avg_1m"], r["run_s"] = os.getloadavg()[0], round(time.time() - t0, 1)
                print(json.dumps({k: v for k, v in r.items() if k != "losses"}, default=str), flush=True)
                rows.append(r)
                if args.json:
                    _write(args.json, meta, rows)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if args.keep_workdir:
            print(f"run directories kept in {work}", file=sys.stderr)
        else:  # each 1 GB run leaves 1-5 GB of checkpoints: a few runs filled this box's disk
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    if any(r["scenario"] == "steady" for r in rows):
        print(steady_table(rows))
    print(json.dumps(_loss_agreement(rows), indent=1))
    return 0


def _write(path: str, meta: dict, rows: list[dict]) -> None:
    Path(path).write_text(json.dumps({**meta, "results": rows, "loss_agreement": _loss_agreement(rows)},
                                     indent=1, default=str) + "\n")


def _commit() -> str | None:
    """HEAD of the tree the code runs from; ELASTIC_BENCH_COMMIT names it for a copy outside git."""
    if os.environ.get("ELASTIC_BENCH_COMMIT"):
        return os.environ["ELASTIC_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
