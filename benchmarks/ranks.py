"""Elastic events with real worker processes at 2 ... 32 ranks on one box: every phase of each event
against the world size N, each phase's growth fitted (benchmarks.growth) and projected to 1,024 ranks.

    .venv/bin/python benchmarks/ranks.py [--sizes 2 4 8 16 32] [--scenarios resize kill join drain] \
        [--systems elastron raytrain] [--emulate-s-per-sample 0.1] [--reference-from 16] [--json out.json]

Simulated Ray nodes of 2 slots each (`ray.cluster_utils.Cluster`, a head with none), 1 CPU per worker,
a model of ~25 K parameters whose step is mostly an emulated accelerator's wait (`models.emulation`,
`--emulate-s-per-sample` per sample of each micro-batch), so 2 cores host 32 ranks. Global batch 3·N
(the LR schedule fixed by `decay_steps`, so that a reference run of fewer steps trains the same):
3 samples per rank at N, 4 at 3N/4; data parallel (the planner's default on CPU), checkpoint every 5
steps, the event after step `EVENT_STEP`. Each event at size N:
  resize  N/2 nodes, world N; the user asks for 3N/4 workers (N = 2: 1).
  kill    N/2 nodes, world N; one node dies without notice (`kill_node`): the planner's size on N-2 slots.
  join    N/2 - 1 nodes, the planner's size on N-2 slots; one node joins: world N.
  drain   as kill, the node drained with notice (60 s deadline).
(kill, join and drain need two nodes after the event or before it: N >= 4.)

Per event, every phase on its own row, read from what the coordinator and the workers record (the
reconfiguration record's transfer fields, the workers' `Joined.parts` and `Resharded.timings`, the
coordinator's events; `phases`); their sum is event -> first step:
  decision     the event to the coordinator acting on it (`Reconfig.detected`)
  coordinator  the coordinator's own work between the calls below (planning, salvage, fan-out)
  handover     the old members hand their shards over and leave their group (live path)
  actors       new workers started, standbys claimed (`Moved.start_s`, storage path `start_s`)
  rendezvous   every rank joined rank 0's TCP store (transfer group + training group)
  connections  the backend's group over the store: gloo connects every pair of ranks
  plan         each worker's exchange plan (`workers.reshard`)
  transfer     the state exchange itself (agree, send/recv, leave)
  form         the new training group's build and adoption (or load from storage)
  first step   the group formed to the end of its first step
and after it, not in the sum: durable checkpoint, the first step to the commit of the checkpoint that
follows a group formed from live state (its manifest on disk).
Memory: every worker's and standby's RSS and USS (psutil on their pids) and the box's memory in use.
Losses: from `--reference-from` N up, every step's loss against the same job uninterrupted in one
process (`spot_trace.reference_losses`), 1e-4 relative.

`--systems raytrain`: Ray Train v2 elastic on the same event, right after Elastron's at each size: the
DDP + DCP loop of benchmarks/elastic_raytrain.py (`measure_raytrain`) with the same model, emulation,
global batch, sequence length and checkpoint interval, `ScalingConfig(num_workers=(1, N))` on the same
nodes of 2 slots, the event after the same step. Ray Train has no user-driven resize: its resize is not
run. Its waits are Ray's defaults but the elastic monitor interval (`--ray-monitor-interval`, 5 s as in
elastic.py; Ray's default 60 s), each recorded in the JSON (`ray_settings`), and Ray's train state tracking
on (RAY_TRAIN_ENABLE_STATE_TRACKING=1), whose attempt records give its phases' first two ends
(`elastic_raytrain.PHASES`). Its losses are not compared (its own optimizer and schedule); its steps
redone are: the highest step its old group completed less the step the new group resumed from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.elastic import _commit, _timeline, _wait  # noqa: E402
from benchmarks.elastic_raytrain import PHASES as RAY_PHASES  # noqa: E402
from benchmarks.elastic_raytrain import remove_nodes  # noqa: E402
from benchmarks.growth import choose  # noqa: E402

SCENARIOS = ("resize", "kill", "join", "drain")
SYSTEMS = ("elastron", "raytrain")
RAY_SCENARIOS = ("kill", "join", "drain")
"""The events Ray Train v2 has: a lost node (a restart of every worker from the last checkpoint), a grown
cluster (at its monitor interval), a preemption notice (its poll and a just-in-time checkpoint)."""
SLOTS = 2
"""Worker slots per simulated node."""
EVENT_STEP = 7
"""The event comes after this step: between two checkpoints (every 5 steps)."""
STEPS_AFTER = 4
"""Steps trained at the new size before the run stops (the durable checkpoint commits meanwhile)."""
PHASES = ("decision", "coordinator", "handover", "actors", "rendezvous", "connections", "plan", "transfer", "form",
          "first step")
"""The phases of event -> first step, in order; they sum to it."""
AFTER = ("durable checkpoint",)
MODEL = {"preset": "tiny", "overrides": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64}}
REL_TOL = 1e-4


def job_config(n: int, emulate_s_per_sample: float, standby_per_node: int | None = None) -> dict:
    """The job of an event at world size `n` (the larger of its two sizes): global batch 3·n;
    `standby_per_node` None: the job's default (`resources.standby_per_node`)."""
    return {
        "model": {**MODEL, "overrides": {**MODEL["overrides"], "emulate_s_per_sample": emulate_s_per_sample}},
        "data": {"source": "corpus", "seq_len": 16, "max_bytes": 100_000},
        "train": {"steps": 10_000, "decay_steps": 100_000, "global_batch_size": 3 * n, "micro_batch_size": 3, "lr": 3e-3,
                  "warmup_steps": 2},
        "parallel": {"min_workers": 1, "max_workers": n, "reshard": "live"},
        "checkpoint": {"interval_steps": 5, "keep_last": 2},
        "resources": {"device": "cpu", "cpus_per_worker": 1,
                      **({} if standby_per_node is None else {"standby_per_node": standby_per_node})},
    }


def start_nodes(scenario: str, n: int) -> int:
    if scenario in ("kill", "join", "drain") and n < 4:
        raise ValueError(f"{scenario} at N={n}: needs N >= 4 (a node of {SLOTS} slots must stay)")
    return n // SLOTS - (1 if scenario == "join" else 0)


# -- phases ----------------------------------------------------------------------------------------------
def phases(rc: dict, *, t_event: float, timeline: list[list], commit_time: float | None = None) -> dict[str, float]:
    """Seconds per phase (`PHASES`, then `AFTER`) of one event, from its reconfiguration record `rc`
    (`Reconfig.to_dict`), the event's unix time and the coordinator's timeline after it (`_timeline`: [what,
    seconds after the event]); `commit_time`: when the durable checkpoint after the first step committed.
    The phases before the first step sum to `rc.first_step_time - t_event`."""
    tr = rc.get("transfer") or {}
    fp, tp = tr.get("form_parts") or {}, tr.get("transfer_parts") or {}
    formed = next((s for what, s in timeline if what == "resize"), None)
    if formed is None or rc.get("first_step_time") is None:
        raise ValueError("the timeline has no 'resize' event or the record no first step: the event did not finish")
    out = dict.fromkeys(PHASES, 0.0)
    out["decision"] = rc["detected"] - t_event
    out["first step"] = rc["first_step_time"] - t_event - formed
    out["rendezvous"] = fp.get("pg.rendezvous_s", 0.0) + tp.get("rendezvous.rendezvous_s", 0.0)
    out["connections"] = fp.get("pg.connect_s", 0.0) + tp.get("rendezvous.connect_s", 0.0)
    out["form"] = tr.get("form_s", 0.0) - fp.get("pg_s", 0.0)
    if tr.get("path") in ("live", "peers", "memory"):
        out["actors"] = tr.get("start_s", 0.0)
        out["handover"] = tr["handover_s"] - out["actors"]
        out["plan"] = tp.get("plan", 0.0)
        out["transfer"] = tr["transfer_s"] - tp.get("rendezvous", 0.0) - out["plan"]
        work = tr["handover_s"] + tr["transfer_s"] + tr["form_s"]
    else:  # storage: start the missing workers, then form on the last committed checkpoint
        out["actors"] = tr.get("start_s", 0.0)
        work = out["actors"] + tr.get("form_s", 0.0)
    # group-wide connections inside the transfer call's and the form's fan-out: what those calls took
    # beyond the slowest rank's parts is the coordinator's fan-out, counted with its own work
    out["coordinator"] = formed - out["decision"] - work
    out["durable checkpoint"] = None if commit_time is None else commit_time - rc["first_step_time"]
    return out


# -- memory ----------------------------------------------------------------------------------------------
def memory(group) -> dict:
    """RSS, USS and PSS of every member and standby worker of `group` (psutil on the pids their `Worker.info`
    answers; all on this box, the nodes being simulated), and the box's memory in use. RSS counts the pages
    of the shared libraries (libtorch) every worker maps; USS is what each holds alone, what one more
    worker costs the box."""
    import psutil

    def rss(handles) -> list[int]:
        import ray

        infos = ray.get([h.actor.info.remote() for h in list(handles)], timeout=120)
        out = []
        for info in infos:
            try:
                m = psutil.Process(info.pid).memory_full_info()
            except psutil.Error:  # the process gone since it answered
                continue
            out.append({"rss": m.rss, "uss": m.uss, "pss": m.pss})
        return sorted(out, key=lambda m: m["rss"])

    vm = psutil.virtual_memory()
    return {"worker_rss": rss(group.members), "standby_rss": rss(group.standby),
            "box_used_bytes": vm.total - vm.available, "box_total_bytes": vm.total}


def _commit_time(run_dir: Path, after_step: int, timeout: float) -> float | None:
    """When the first checkpoint of a step after `after_step` committed: its manifest's mtime (written last)."""
    from parallel.checkpoint.manifest import MANIFEST_NAME
    from parallel.checkpoint.validate import parse_step

    def found():
        for m in run_dir.rglob(MANIFEST_NAME):
            s = parse_step(m.parent.name)
            if s is not None and s > after_step:
                return m.stat().st_mtime
        return None

    try:
        _wait(lambda: found() is not None, timeout, "the durable checkpoint's commit")
    except TimeoutError:
        return None
    return found()


# -- one event -------------------------------------------------------------------------------------------
def measure(cluster, *, scenario: str, n: int, workdir: Path, emulate_s_per_sample: float, settle: float,
            standby_per_node: int | None = None) -> dict:
    import ray

    from service.control.commands import SetWorkers, Stop
    from service.control.coordinator import Coordinator, CoordinatorOptions
    from service.control.job import Job
    from service.pool.cluster import drain_node, kill_node
    from workers.config import JobConfig

    cfg = job_config(n, emulate_s_per_sample, standby_per_node)
    run_dir = workdir / f"{scenario}-{n}"
    added = [cluster.add_node(num_cpus=SLOTS) for _ in range(start_nodes(scenario, n))]
    cluster.wait_for_nodes()
    t_start = time.time()
    coord = Coordinator(Job.of(JobConfig.from_dict(cfg), job_id=f"ranks-{scenario}-{n}", run_dir=run_dir),
                        options=CoordinatorOptions(settle_seconds=settle, chunk_seconds=0.2, poll_interval_s=0.1))
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    victim, out = None, None
    try:
        _wait(lambda: coord.step_done >= EVENT_STEP and str(coord.state.name) == "RUNNING", 900, "the event step")
        started_s = time.time() - t_start
        before = coord.group.size
        mem_before = memory(coord.group)
        me = ray.get_runtime_context().get_node_id()
        n_rc = len(coord.reconfigs)
        if scenario == "resize":
            t_event = time.time()
            coord.send(SetWorkers(workers=max(1, 3 * n // 4)))
        elif scenario == "join":
            added.append(cluster.add_node(num_cpus=SLOTS))
            t_event = time.time()
        else:
            victim = next(x for x in added if x.node_id in coord.group.nodes() and x.node_id != me)
            t_event = time.time()
            if scenario == "kill":
                kill_node(cluster, victim)
            else:
                drain_node(victim.node_id, message="benchmark: spot reclaim", deadline_remaining_s=60)
        _wait(lambda: any(r.first_step_time and r.world_size != before for r in coord.reconfigs[n_rc:]), 600,
              "the first step at the new size")
        rc = next(r for r in coord.reconfigs[n_rc:] if r.first_step_time and r.world_size != before)
        _wait(lambda: coord.step_done >= rc.resumed_step + STEPS_AFTER, 300, f"{STEPS_AFTER} steps at the new size")
        durable = rc.transfer is not None and rc.transfer.path in ("live", "peers", "memory")
        commit = _commit_time(run_dir, rc.resumed_step, 60) if durable else None
        mem_after = memory(coord.group)
        timeline = _timeline(coord.events_since(0), t_event, time.time())
        metrics = sorted(coord.metrics_since(0), key=lambda m: m["step"])
        old_rows = [m for m in metrics if m["step"] <= rc.step_before and m["time"] <= t_event]
        out = {"system": "elastron", "scenario": scenario, "n": n, "world_size_before": before,
               "world_size_after": rc.world_size, "steps_redone": rc.steps_lost,
               "path": None if rc.transfer is None else str(rc.transfer.path), "t_event": t_event,
               "event_to_first_step_s": rc.first_step_time - t_event,
               "phases": phases(rc.to_dict(), t_event=t_event, timeline=timeline, commit_time=commit),
               "reconfigurations": [r.to_dict() for r in coord.reconfigs[n_rc:]], "timeline": timeline,
               "step_time_s": sorted(m["step_time"] for m in old_rows[-4:]),
               "emulated_wait_per_step_s": 3 * emulate_s_per_sample,
               "start_to_event_step_s": started_s, "memory_before": mem_before, "memory_after": mem_after,
               "losses": {str(m["step"]): m["loss"] for m in metrics}}
    finally:
        coord.send(Stop())
        t.join(timeout=180)
        remove_nodes(cluster, added)
    return out


def measure_ray(cluster, *, scenario: str, n: int, workdir: Path, emulate_s_per_sample: float,
                monitor_interval_s: float) -> dict:
    """Ray Train v2 on the event of `measure` at size `n`: the same nodes, job and event step."""
    from benchmarks.elastic_raytrain import measure_raytrain

    cfg = job_config(n, emulate_s_per_sample)
    r = measure_raytrain(cluster=cluster, scenario=scenario, workdir=str(workdir / f"raytrain-{scenario}-{n}"),
                         model_steps=1, ckpt_every=cfg["checkpoint"]["interval_steps"], event_step=EVENT_STEP,
                         post_event_steps=STEPS_AFTER, timeout_s=480, warmup_timeout_s=600,
                         global_batch_size=cfg["train"]["global_batch_size"], seq_len=cfg["data"]["seq_len"],
                         lr=cfg["train"]["lr"], model=cfg["model"],
                         elastic_resize_monitor_interval_s=monitor_interval_s,
                         nodes=start_nodes(scenario, n), slots_per_node=SLOTS, max_workers=n)
    return {**r, "system": "raytrain", "scenario": scenario, "n": n}


def loss_check(losses: dict[str, float], reference: list[float]) -> dict:
    """Every step's loss against the reference run's (reference[s - 1] for step s), relative."""
    rel = {s: abs(v - reference[int(s) - 1]) / abs(reference[int(s) - 1]) for s, v in losses.items()
           if int(s) <= len(reference)}
    worst = max(rel.values(), default=None)
    return {"steps": len(rel), "max_rel": worst, "ok": worst is not None and worst <= REL_TOL}


# -- tables ----------------------------------------------------------------------------------------------
def growth(rows: list[dict], project_to: int = 1024) -> dict[str, dict[str, dict]]:
    """Per scenario and phase (and event -> first step): the fits over the sizes Elastron was measured at."""
    out: dict[str, dict[str, dict]] = {}
    for sc in SCENARIOS:
        mine = sorted((r for r in _of("elastron", rows) if r["scenario"] == sc and "phases" in r), key=lambda r: r["n"])
        if len({r["n"] for r in mine}) < 2:
            continue
        ns = [r["n"] for r in mine]
        out[sc] = {}
        for ph in (*PHASES, *AFTER, "event → first step"):
            ys = [r["event_to_first_step_s"] if ph == "event → first step" else r["phases"][ph] for r in mine]
            if any(y is None for y in ys):
                continue
            out[sc][ph] = choose(ns, ys).to_dict(project_to)
    return out


def _of(system: str, rows: list[dict]) -> list[dict]:
    """The rows of one system (rows written before Ray Train ran beside Elastron have no "system")."""
    return [r for r in rows if r.get("system", "elastron") == system]


def phase_table(rows: list[dict], fits: dict, project_to: int = 1024) -> str:
    rows = _of("elastron", rows)
    sizes = sorted({r["n"] for r in rows})
    lines = []
    for sc in SCENARIOS:
        got = {r["n"]: r for r in rows if r["scenario"] == sc and "phases" in r}
        if not got:
            continue
        lines += [f"**{sc}**", "", "| phase | " + " | ".join(f"N={n}" for n in sizes) +
                  f" | growth (fit) | at {project_to} |", "|---|" + "---|" * (len(sizes) + 2)]
        for ph in (*PHASES, "event → first step", *AFTER):
            cells = []
            for n in sizes:
                r = got.get(n)
                v = None if r is None else (r["event_to_first_step_s"] if ph == "event → first step"
                                            else r["phases"][ph])
                cells.append("—" if v is None else f"{v:.3f}")
            f = fits.get(sc, {}).get(ph)
            fit_s = "—" if f is None else (f"{f['best']['growth']}: " +
                                           ", ".join(f"{c:.3g}" for c in f["best"]["coefficients"]))
            proj = "—" if f is None else f"{f[f'projected_{project_to}_s']:.2f} s"
            lines.append(f"| {ph} | " + " | ".join(cells) + f" | {fit_s} | {proj} |")
        sizes_row = " | ".join(f"{got[n]['world_size_before']}→{got[n]['world_size_after']}" if n in got else "—"
                               for n in sizes)
        lines += [f"| world sizes | {sizes_row} | | |", ""]
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    lines = ["| event | N | workers | worker RSS / USS (median) | standbys | standby RSS / USS (median) | "
             "all workers' USS | box in use |", "|---|---|---|---|---|---|---|---|"]
    gib = 2 ** 30
    for r in sorted((r for r in _of("elastron", rows) if "memory_before" in r), key=lambda r: (r["n"], r["scenario"])):
        m = r["memory_before"]
        w, s = m["worker_rss"], m["standby_rss"]

        def mm(xs):
            mid = xs[len(xs) // 2] if xs else None
            return "—" if mid is None else f"{mid['rss'] / 2**20:.0f} / {mid['uss'] / 2**20:.0f} MiB"
        lines.append(f"| {r['scenario']} | {r['n']} | {len(w)} | {mm(w)} | {len(s)} | {mm(s)} | "
                     f"{sum(x['uss'] for x in w + s) / gib:.2f} GiB | {m['box_used_bytes'] / gib:.1f} GiB |")
    return "\n".join(lines)


def ray_phase_table(rows: list[dict]) -> str:
    """Ray Train's phases per event and size (`elastic_raytrain.PHASES`; "—" a phase whose end it did not
    record, its time in the next), event -> first step, the stall (its old group trains on after a join or
    a drain until it is stopped), steps redone, the drain's notice in the loop."""
    rows = _of("raytrain", rows)
    sizes = sorted({r["n"] for r in rows})
    lines = []
    for sc in RAY_SCENARIOS:
        got = {r["n"]: r for r in rows if r["scenario"] == sc and r.get("phases")}
        if not got:
            continue
        lines += [f"**{sc}** (Ray Train v2)", "", "| phase | " + " | ".join(f"N={n}" for n in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]

        def row(label, value):
            cells = ["—" if n not in got or value(got[n]) is None else value(got[n]) for n in sizes]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")

        for ph in RAY_PHASES:
            row(ph, lambda r, ph=ph: None if r["phases"][ph] is None else f"{r['phases'][ph]:.3f}")
        row("event → first step", lambda r: f"{r['first_step_time'] - r['t_event']:.3f}")
        row("stall (not in the sum): the old group's last step → this one", lambda r: f"{r['stall_s']:.2f}")
        row("steps redone", lambda r: str(r["steps_redone_or_lost"]))
        row("worker groups started", lambda r: str(r["worker_group_starts"]))
        if sc == "drain":
            row("notice in the loop (not in the sum)",
                lambda r: None if r.get("preemption_notice_s") is None else f"{r['preemption_notice_s']:.2f}")
        row("world sizes", lambda r: f"{r['world_size_before']}→{r['world_size_after']}")
        lines.append("")
    return "\n".join(lines)


def side_by_side(rows: list[dict]) -> str:
    """Per event and size: each system's event -> first step and steps redone, Ray Train's time over
    Elastron's, and the load average at the end of each run."""
    lines = ["| event | N | Elastron: event → first step | steps redone | Ray Train v2: event → first step | "
             "steps redone | Ray Train ÷ Elastron | load (1 min): Elastron / Ray Train |",
             "|---|---|---|---|---|---|---|---|"]
    el = {(r["scenario"], r["n"]): r for r in _of("elastron", rows)}
    rt = {(r["scenario"], r["n"]): r for r in _of("raytrain", rows)}
    for sc, n in sorted(set(el) | set(rt), key=lambda k: (SCENARIOS.index(k[0]), k[1])):
        e, r = el.get((sc, n)), rt.get((sc, n))
        te = None if e is None else e.get("event_to_first_step_s")
        tr = None if r is None or r.get("timed_out") else r.get("event_to_first_step_s")
        e_cells = (["not run", ""] if e is None else [f"failed: {e['error']}", ""] if "error" in e else
                   [f"{te:.2f} s", str(e.get("steps_redone", "—"))])
        if sc not in RAY_SCENARIOS:
            r_cells = ["no counterpart (Ray Train has no user-driven resize)", "—"]
        elif r is None:
            r_cells = ["not run", ""]
        elif tr is None:
            r_cells = [f"none within {r.get('event_to_first_step_s')} s: {r.get('notes', '')[:120]}", "—"]
        else:
            r_cells = [f"{tr:.2f} s", str(r.get("steps_redone_or_lost"))]
        ratio = f"{tr / te:.1f}×" if te and tr else "—"
        load = " / ".join("—" if x is None else f"{x['load_avg_1m']:.0f}" for x in (e, r))
        lines.append(f"| {sc} | {n} | " + " | ".join(e_cells + r_cells) + f" | {ratio} | {load} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[2, 4, 8, 16, 32])
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                    help="Elastron and/or Ray Train v2 (kill, join and drain only), one after the other per event")
    ap.add_argument("--ray-monitor-interval", type=float, default=5.0,
                    help="Ray Train's ScalingConfig(elastic_resize_monitor_interval_s); Ray's default is 60")
    ap.add_argument("--emulate-s-per-sample", type=float, default=0.1)
    ap.add_argument("--settle", type=float, default=1.0, help="stable capacity needed before growing (join)")
    ap.add_argument("--standby-per-node", type=int, default=None,
                    help="the job's resources.standby_per_node (idle warm workers per node); default: the job's")
    ap.add_argument("--reference-from", type=int, default=16, help="check losses against a reference from this N up")
    ap.add_argument("--json", help="write all results here (merged with the file's rows of other sizes/events)")
    args = ap.parse_args(argv)
    for n in args.sizes:
        if n < 2 or n % SLOTS:
            raise SystemExit(f"--sizes: {n} is not a positive multiple of {SLOTS} (nodes have {SLOTS} slots)")

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")  # Ray's attempt records: its phases' ends
    import ray
    from ray.cluster_utils import Cluster

    from benchmarks.elastic_raytrain import settings
    from benchmarks.spot_trace import reference_losses

    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(), "argv": sys.argv[1:],
            "emulate_s_per_sample": args.emulate_s_per_sample, "standby_per_node": args.standby_per_node,
            "model": MODEL, "slots_per_node": SLOTS, "systems": args.systems,
            "elastron_options": {"settle_seconds": args.settle, "chunk_seconds": 0.2, "poll_interval_s": 0.1},
            "ray_settings": settings(args.ray_monitor_interval) if "raytrain" in args.systems else None}
    prior = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    runs = [(n, sc, system) for n in args.sizes for sc in args.scenarios for system in args.systems
            if (sc == "resize" or n >= 4) and (system == "elastron" or sc in RAY_SCENARIOS)]
    rows = [r for r in prior.get("results", []) if (r["n"], r["scenario"], r.get("system", "elastron")) not in runs]
    work = Path(tempfile.mkdtemp(prefix="ranks-bench-"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        for n, sc, system in runs:
            t0 = time.time()
            try:
                if system == "raytrain":
                    r = measure_ray(cluster, scenario=sc, n=n, workdir=work,
                                    emulate_s_per_sample=args.emulate_s_per_sample,
                                    monitor_interval_s=args.ray_monitor_interval)
                else:
                    r = measure(cluster, scenario=sc, n=n, workdir=work, emulate_s_per_sample=args.emulate_s_per_sample,
                                settle=args.settle, standby_per_node=args.standby_per_node)
            except Exception as e:  # noqa: BLE001 - keep the other runs
                r = {"system": system, "scenario": sc, "n": n, "error": f"{type(e).__name__}: {e}"}
            r["load_avg_1m"], r["run_s"] = os.getloadavg()[0], round(time.time() - t0, 1)
            if system == "elastron" and n >= args.reference_from and "losses" in r:  # at once: a run cut short keeps it
                ref_dir = work / f"ref-{sc}-{n}"
                ref_dir.mkdir()
                ref = reference_losses(job_config(n, args.emulate_s_per_sample, args.standby_per_node), ref_dir,
                                       max(int(s) for s in r["losses"]))
                r["loss_check"] = loss_check(r["losses"], ref)
            print(json.dumps({k: v for k, v in r.items() if k not in ("losses", "timeline", "reconfigurations",
                                                                       "memory_before", "memory_after", "ray_attempts",
                                                                       "new_group_starts", "ray_settings")},
                             default=str), flush=True)
            rows.append(r)
            if args.json:
                _write(args.json, meta, rows)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    fits = growth(rows)
    if args.json:
        _write(args.json, meta, rows, fits)
    print(phase_table(rows, fits))
    print(memory_table(rows))
    if _of("raytrain", rows):
        print(ray_phase_table(rows))
    print(side_by_side(rows))
    return 0


def _write(path: str, meta: dict, rows: list[dict], fits: dict | None = None) -> None:
    Path(path).write_text(json.dumps({**meta, "results": rows, "growth": fits or growth(rows)}, indent=1,
                                     default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
