"""The whole AWS spot trace at a GPU cluster's scale, simulated: Elastron, Ray Train v2 elastic and a
fixed-size checkpoint-restart job over all 11.4 h, each trace instance a node of 8 H100s.

    .venv/bin/python benchmarks/spot_sim.py [--trace FILE] [--jobs 8b 70b] [--set GROUP.FIELD=VALUE ...] \
        [--json benchmarks/results/spot-sim.json] [--check-replay REPLAY.json ...]

Pure Python, no Ray, no torch: a discrete-event simulation that runs in seconds. Every assumption is a
field of the parameter dataclasses below (`Common`, `Hardware`, `Job`, `ElastronCosts`, `RayTrainCosts`,
`FixedCosts`), each with where its value comes from; all of them are printed into the JSON. `--set`
changes one (`--set common.kill_detect_s=50`).

The trace (its README): one line per instance granted (`add`) or preempted (`remove`). A seeded
`notice_share` of removals gets AWS's two-minute notice (a NOTICE event `notice_s` before the removal,
never before the node's own add); the others vanish without one. Events at the same instant are one batch.

Throughput per size (`SizeTable`): the project's planner (`parallel.planner.plan`) picks the layout for
n nodes x 8 GPUs under the job's batch, micro batch, sequence and memory budget; the tokens/s are
  GPUs used x the job's reference tokens/s per GPU x (1 + dp_loss_per_doubling x log2(ref_nodes / nodes
  used)) x the 1F1B pipeline efficiency m / (m + pp - 1), m = microbatches per step.
Every system trains at that table's rate for the nodes it uses; only how each handles events differs.

The ideal: at every instant the best rate of any size up to the nodes alive (the table's running
maximum: a system may always leave nodes idle), integrated over the trace, with no cost for changing
size. No system can exceed it; one that does is a model error: the script says so and exits 1.

The systems (all start at t=0 training on what is alive, at no cost; each event costs what follows):
- elastron: the coordinator's policy (`service.control.policy`), which decides only between training
  calls (a call: as many steps as fit in the chunk, at least one; calls follow each other from the end
  of the last move), so a growth or a drain waits for the end of the call in flight: on a notice it
  trains on with the noticed node until its deadline less the product's lead (`service.control.drain`:
  `drain_margin` x (the call + the last live move's hand-over, plan, rendezvous and transfer), at least
  `drain_floor_s`; `drain_move_s` assumed before a move), then shrinks off it at that call's end (a
  live move; at the next call's end where the lead exceeds the notice or the rest cannot run); it
  grows at the first call's end once the offer has been stable `settle_s` and the joiners are warm
  (both counted from the decision that first saw the new nodes: the coordinator starts their workers
  then, beside the training group). A loss without notice is not held (the probes abort the call): the
  survivors re-form from peer snapshots, redoing the part of the step in flight trained so far (plus
  one step when the loss lands inside the snapshot round after a step). A move is hand-over + plan +
  rendezvous + the bytes the busiest node moves + communicator init + form + the first step's compile.
  A sharded (FSDP) loss whose buddy (the next member in join order, which holds its snapshot) is lost
  in the same batch falls back to the last durable checkpoint in object storage; a replicated group
  (`Job.replicated`) re-forms from any survivor's own copy.
- raytrain: Ray Train v2 elastic: a change of size is decided at the autoscaler tick + the monitor
  interval and restarts every worker (group stop, start, build, communicator init, DCP load from object
  storage, compile), redoing the steps since the last checkpoint (none is taken before a resize); a
  notice makes the train loop save one just-in-time checkpoint after the preemption poll and train on;
  a loss adds the worker-group start timeout that the dead node's stale view costs.
- fixed: the same loop on exactly `nodes` nodes; a loss restarts it from its last checkpoint once
  `nodes` nodes are usable again (it waits meanwhile); added nodes beyond those are left idle.
Figures per job and system: tokens trained that count (redone work subtracted), ÷ the ideal, and where
the rest went (`Cause`: nodes unused while an event is handled, redone work, the planner's layout at the
size); then each SWEEP parameter at a low and a high value, and the two that move Elastron most together.

`--check-replay` runs the same Elastron model at the 2-core box's scale (`cpu_box_params`) on replays of
benchmarks/spot_trace.py (their schedule as executed, their per-size throughput and layout kind) and
compares the goodput, the replay's stalls before its first event left out of its time: every replay
within 10%, or exit 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import spot_schedule  # noqa: E402
from models.config import ModelConfig, model_config  # noqa: E402
from parallel.planner import Constraints, PlanError, plan  # noqa: E402
from service.control.drain import DrainLead  # noqa: E402
from workers.config import ParallelConfig  # noqa: E402

TRACE = ROOT.parent / "shared" / "data" / "spot-traces" / "aws-p3.2xlarge-32.csv"
GB = 1e9
TOL = 1e-9  # relative slack on the ideal (float sums)


# -- the trace --------------------------------------------------------------------------------------
class Kind(StrEnum):
    ADD = "add"
    NOTICE = "notice"
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class Event:
    t: float
    kind: Kind
    node: str
    deadline: float | None = None
    """A NOTICE's: when the node goes (its removal)."""


def load_trace(path: Path) -> list[Event]:
    """The trace as `spot_schedule.load_trace` reads it (`time_ms,add|remove,node_id` lines, in time order),
    as this simulator's events."""
    return [Event(t=e.t_s, kind=Kind(e.op), node=e.node) for e in spot_schedule.load_trace(path)]


def with_notices(events: list[Event], *, share: float, notice_s: float, seed: int) -> list[Event]:
    """The trace plus a NOTICE `notice_s` before a seeded `share` of removals (not before the node's add),
    sorted by time; at one instant adds come first, then notices, then removals."""
    rng = random.Random(seed)
    added: dict[str, float] = {}
    out = list(events)
    for e in events:
        if e.kind is Kind.ADD:
            added[e.node] = e.t
        elif rng.random() < share:
            out.append(Event(t=max(added.get(e.node, 0.0), e.t - notice_s), kind=Kind.NOTICE, node=e.node,
                             deadline=e.t))
    order = {Kind.ADD: 0, Kind.NOTICE: 1, Kind.REMOVE: 2}
    return sorted(out, key=lambda e: (e.t, order[e.kind]))


def batches(events: list[Event]) -> list[tuple[float, tuple[Event, ...]]]:
    """Events grouped by instant."""
    out: list[tuple[float, list[Event]]] = []
    for e in events:
        if out and out[-1][0] == e.t:
            out[-1][1].append(e)
        else:
            out.append((e.t, [e]))
    return [(t, tuple(b)) for t, b in out]


def availability(events: list[Event]) -> list[tuple[float, int]]:
    """(time, nodes alive from then on), one point per instant."""
    alive: set[str] = set()
    pts: list[tuple[float, int]] = []
    for t, batch in batches(events):
        for e in batch:
            if e.kind is Kind.ADD:
                alive.add(e.node)
            elif e.kind is Kind.REMOVE:
                alive.discard(e.node)
        pts.append((t, len(alive)))
    return pts


# -- parameters -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Common:
    """What every system shares: the trace's mapping, failure detection, checkpoints, a process's start."""

    notice_share: float = 0.75
    """Removals that get AWS's notice (seeded); spot_trace.py's default, so the K=4 check sees the same mix."""
    notice_s: float = 120.0
    """AWS's spot interruption notice (FACTS.md, published)."""
    seed: int = 0
    """Which removals get a notice."""
    kill_detect_s: float = 15.0
    """A node vanishing without notice until the cluster knows: Ray's GCS health check, period 3 s x 5
    failures (ray_config_def.h defaults; up to 55 s when each check times out). On this box a killed
    raylet was noticed in 0.28 s, because its sockets closed (docs/benchmarks.md, elastic.py kill)."""
    ckpt_interval_s: float = 600.0
    """Durable checkpoint cadence of every system (training seconds): assumed, the same for all."""
    ckpt_block_s: float = 0.11
    """Training blocked per async checkpoint: 11-14 ms call + 0.10 s staging wait (H200, FACTS.md)."""
    build_s: float = 2.66
    """A fresh process's build (model, allocate, init, optimizer): H200, `1b`, startup.py."""
    compile_cold_s: float = 12.6
    """First step's extra at a layout never compiled: 34.06 - 21.45 s, H200 `1b`, startup.py."""
    compile_warm_s: float = 2.35
    """First step's extra at a layout compiled before (warm cache): 23.80 - 21.45 s, H200 `1b`, startup.py."""
    comm_init_s: float = 5.0
    """NCCL communicator initialisation of a new group of up to 256 ranks: assumed (not measured here;
    scale.py's projection: 'typically seconds')."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """A node: 8 H100s, NVLink inside, IB/EFA between nodes, object storage for durable checkpoints."""

    gpus_per_node: int = 8
    network_gbit_s: float = 400.0
    """Per node between nodes (the scale.py projection's figure; p5 instances have 3,200)."""
    nvlink_gbyte_s: float = 900.0
    """Per GPU inside a node (H100 NVLink 4): moves inside a node are not on the critical path here."""
    transfer_efficiency: float = 0.47
    """Live moves reach this share of the line rate: the send/recv of 0.53 GB at 46-47% of raw gloo into
    warm buffers (live_reshard.py, dp=2 -> dp=1)."""
    object_store_gbit_s: float = 25.0
    """Per node read or write of DCP checkpoints to object storage (S3-like): assumed."""
    d2h_gbyte_s: float = 25.0
    """Device-to-host copy of a peer snapshot (pinned, PCIe Gen5): assumed."""

    @property
    def net_bytes_s(self) -> float:
        return self.network_gbit_s / 8 * GB * self.transfer_efficiency

    @property
    def store_bytes_s(self) -> float:
        return self.object_store_gbit_s / 8 * GB


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A training job: shape, batch, and its reference throughput per GPU on H100s."""

    name: str
    model: ModelConfig
    params: float
    """Parameter count."""
    seq_len: int
    global_batch: int
    """Samples per step, fixed under every layout (many divisors, as the planner's hint advises)."""
    micro_batch: int
    tokens_per_gpu_s: float
    """Reference rate at `ref_nodes` without pipeline stages (torchtitan docs/performance.md, H100)."""
    ref_nodes: int
    dp_loss_per_doubling: float = 0.0057
    """Per-GPU rate lost per doubling of nodes: torchtitan 8B FSDP + compile, 6,667 TPS/GPU on 8 GPUs,
    6,514 on 128 (2.3% over 4 doublings); used for 70B too (no published 70B scaling)."""
    state_bytes_per_param: float = 12.0
    """fp32 weights + AdamW's two moments: what moves and what a checkpoint holds."""
    memory_budget_gib: float = 70.0
    plan_s: float = 0.1
    """The slowest worker's live-reshard plan (scale.py at 512-1,024 ranks)."""
    replicated: bool = False
    """Every member holds the whole state (pure data-parallel replicas, DDP): a loss re-forms from the
    survivors' own copies (no buddy, no storage while one survives, no snapshot lag, nothing sent), and a
    growth sends each joiner the whole state. False: sharded (FSDP), each member holds its shard."""

    @property
    def state_bytes(self) -> float:
        return self.params * self.state_bytes_per_param

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def job_8b() -> Job:
    return Job(name="8b", model=model_config("8b"), params=8.03e9, seq_len=8192, global_batch=960, micro_batch=2,
               tokens_per_gpu_s=6514.0, ref_nodes=16, plan_s=0.103)  # torchtitan Table 3 (128 H100, FSDP+compile)


def job_70b() -> Job:
    m = model_config("8b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672)
    return Job(name="70b", model=m, params=70.6e9, seq_len=8192, global_batch=960, micro_batch=1,
               tokens_per_gpu_s=829.0, ref_nodes=32, plan_s=0.511)  # torchtitan Table 4 (256 H100, 2D)


_PRODUCT = ParallelConfig()
"""The job config's defaults: the drain's lead rule of a job that sets none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ElastronCosts:
    """Elastron's per-event parts, from this project's measurements (docs/benchmarks.md)."""

    settle_s: float = 10.0
    """Offer stable this long before growing (CoordinatorOptions.settle_seconds)."""
    joiner_start_s: float = 10.09
    """A joiner's process start to a warm worker, beside training: H200 `1b` restart to first step in a
    fresh process (startup.py; it includes reading 13.2 GB, so an upper figure)."""
    handover_s: float = 0.31
    """Stopping at the step boundary and handing over: median of 4 resizes (elastic.py, 36e1984)."""
    rendezvous_s: float = 0.57
    """The transfer group's rendezvous (elastic.py join, 1365ff3)."""
    form_s: float = 0.99
    """Forming the new group: process group, build, adopt, snapshot set-up (elastic.py FSDP kill, 29b2efd)."""
    failure_handled_s: float = 0.34
    """Noticed -> survivors known (elastic.py FSDP kill after the fixes)."""
    probe_cap_s: float = 3.0
    """While the coordinator waits on a training call it probes its nodes (a tiny placement on each,
    `service.pool.calls.probe_gaps`): 0.5 s into the call, then at gaps of 1, 2 s and at most this
    (CoordinatorOptions.reprobe_interval_s); a node that does not place within `probe_timeout_s` fails
    the wait (NODE_LOST), before Ray's health check has declared it dead."""
    probe_timeout_s: float = 2.0
    """How long a probed node has to answer (CoordinatorOptions.probe_timeout_s)."""

    def detect_s(self, common: "Common") -> float:
        """A vanished node until the coordinator knows: the next probe (a loss comes at a uniform point
        of a gap of at most `probe_cap_s`: half of it on average) plus its timeout, or the cluster's own
        detection (`common.kill_detect_s`) if that comes first."""
        return min(common.kill_detect_s, self.probe_cap_s / 2 + self.probe_timeout_s)
    drain_margin: float = _PRODUCT.drain_margin
    """A notice's node trains on until its deadline less the lead, max(drain_floor_s, drain_margin x (the
    call between two decisions + the last move off a node)), the product's rule (service.control.drain)
    with its defaults (workers.config.ParallelConfig); 0: move off at once."""
    drain_floor_s: float = _PRODUCT.drain_floor_s
    drain_move_s: float = _PRODUCT.drain_move_s
    """The move off a node assumed before one has been made (the trace's first drains)."""
    chunk_s: float = 0.5
    """The coordinator's training call between two decisions, when longer than a step
    (CoordinatorOptions.chunk_seconds)."""

    def drain_lead(self) -> DrainLead:
        return DrainLead(margin=self.drain_margin, floor_s=self.drain_floor_s, default_move_s=self.drain_move_s)
    snapshot_every: int = 1
    """Peer snapshot cadence at the defaults when its cost is within `peer_budget` (workers.pace)."""
    peer_budget: float = 0.1
    """The pace's budget: snapshots cost at most this share of the steps (workers.pace)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RayTrainCosts:
    """Ray Train v2's fixed waits and restart (FACTS.md "Ray Train v2 elastic mode", ray 2.60)."""

    autoscaler_tick_s: float = 20.0
    """The elastic autoscaling coordinator's tick."""
    monitor_interval_s: float = 5.0
    """elastic_resize_monitor_interval_s as elastic.py sets it; its default, which spot_trace.py keeps,
    is 60 s (the shorter wait favours Ray Train)."""
    preemption_poll_s: float = 5.0
    """How often draining nodes are polled; the loop's just-in-time checkpoint follows."""
    group_stop_s: float = 14.0
    """From the train function's end until fit() returns (measured, 2 workers)."""
    group_start_s: float = 7.7
    """TorchTrainer start to the first line of the train function (measured, 2 workers)."""
    stale_start_timeout_s: float = 60.0
    """The worker-group start timeout a loss costs: the dead node's stale view (measured kill: 76 s, 60 s of it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedCosts:
    """The fixed-size job: Ray Train v2's loop at one size."""

    nodes: int = 0
    """Nodes it needs; 0: the best size in hindsight (every size simulated, the best kept: charitable)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Params:
    common: Common = field(default_factory=Common)
    hardware: Hardware = field(default_factory=Hardware)
    elastron: ElastronCosts = field(default_factory=ElastronCosts)
    raytrain: RayTrainCosts = field(default_factory=RayTrainCosts)
    fixed: FixedCosts = field(default_factory=FixedCosts)

    def set(self, assignment: str) -> "Params":
        """`group.field=value` -> a copy with that field changed."""
        key, sep, value = assignment.partition("=")
        group, _, name = key.partition(".")
        if not sep or group not in {f.name for f in dataclasses.fields(self)}:
            raise ValueError(f"--set {assignment!r}: expected GROUP.FIELD=VALUE with GROUP one of "
                             f"{[f.name for f in dataclasses.fields(self)]}")
        sub = getattr(self, group)
        kinds = {f.name: f.type for f in dataclasses.fields(sub)}
        if name not in kinds:
            raise ValueError(f"--set {assignment!r}: {group} has no field {name!r}; fields: {sorted(kinds)}")
        old = getattr(sub, name)
        try:
            new = type(old)(value)
        except ValueError:
            raise ValueError(f"--set {assignment!r}: {value!r} is not a {type(old).__name__}") from None
        return dataclasses.replace(self, **{group: dataclasses.replace(sub, **{name: new})})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- throughput per size ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Size:
    """One node count: the planner's layout there and the tokens/s it trains."""

    nodes: int
    layout: str
    gpus: int
    microbatches: int
    pipeline_eff: float
    tokens_s: float


@dataclass(frozen=True, slots=True)
class SizeTable:
    """Tokens/s at each node count (index = nodes, 0 included) and the ideal's running maximum."""

    sizes: tuple[Size, ...]

    def rate(self, nodes: int) -> float:
        return self.sizes[min(nodes, len(self.sizes) - 1)].tokens_s

    def best(self, nodes: int) -> float:
        """The best rate on at most `nodes` nodes."""
        return max(s.tokens_s for s in self.sizes[:min(nodes, len(self.sizes) - 1) + 1])

    @property
    def min_nodes(self) -> int:
        return next((s.nodes for s in self.sizes if s.tokens_s > 0), 0)


def size_table(job: Job, hw: Hardware, max_nodes: int) -> SizeTable:
    """The planner's layout and the modelled tokens/s at 1..max_nodes nodes (0 where no layout fits)."""
    sizes = [Size(0, "-", 0, 0, 0.0, 0.0)]
    for n in range(1, max_nodes + 1):
        c = Constraints(global_batch_size=job.global_batch, micro_batch_size=job.micro_batch, seq_len=job.seq_len,
                        gpus_per_node=hw.gpus_per_node, max_tp=hw.gpus_per_node, device_type="cuda",
                        memory_budget_bytes=job.memory_budget_gib * 2**30)
        try:
            p = plan(n * hw.gpus_per_node, job.model, c)
        except PlanError:
            sizes.append(Size(n, "none fits", 0, 0, 0.0, 0.0))
            continue
        m, pp = p.grad_accum_steps, p.layout.pp
        eff = m / (m + pp - 1)
        used_nodes = math.ceil(p.world_size / hw.gpus_per_node)
        per_gpu = job.tokens_per_gpu_s * (1 + job.dp_loss_per_doubling * math.log2(job.ref_nodes / used_nodes))
        sizes.append(Size(n, str(p.layout), p.world_size, m, round(eff, 4), p.world_size * per_gpu * eff))
    return SizeTable(tuple(sizes))


# -- the simulation ---------------------------------------------------------------------------------
class Cause(StrEnum):
    """Where capacity went (the ideal minus what a system trained), one spelling each."""

    JOIN = "join: nodes not yet used"
    NOTICE = "notice: nodes drained before their end"
    LOSS = "loss: detect, restart or re-form"
    REDONE = "work redone"
    LAYOUT = "layout: the planner's pick below the best size"
    IDLE = "nodes beyond the fixed size"
    STEADY = "snapshots and checkpoints in steady state"


class Phase(StrEnum):
    TRAINING = "training"
    MOVING = "moving"
    """Reconfiguring or restarting: nothing trains until the move ends."""
    WAITING = "waiting"
    """Too few nodes to run."""


@dataclass(frozen=True, slots=True)
class Timer:
    """A system's own event: `gen` voids it when a newer timer of the same name was set or it was cancelled."""

    name: str
    gen: int


class System:
    """The book-keeping every system shares: the nodes alive and noticed, its members, what it has
    trained and where the rest of the ideal went. Subclasses decide what events cost (`react`, `timer`)."""

    name = "system"
    size: int | None = None
    """The nodes a fixed-size system needs; None for an elastic one."""

    def __init__(self, job: Job, table: SizeTable, params: Params):
        self.job, self.table, self.p = job, table, params
        self.alive: dict[str, float] = {}  # node -> add time (join order)
        self.noticed: set[str] = set()
        self.members: tuple[str, ...] = ()
        self.phase = Phase.WAITING
        self.cause = Cause.JOIN  # what a stall is charged to
        self.training_since = 0.0  # when the group last started training
        self.t = 0.0
        self.trained = 0.0
        self.lost: dict[Cause, float] = {c: 0.0 for c in Cause}
        self.events: dict[str, int] = {}
        self.since_ckpt_tokens = 0.0
        self.since_ckpt_s = 0.0
        self.compiled: set[int] = set()
        self.timers: list[tuple[float, Timer]] = []
        self.gens: dict[str, int] = {}
        self.timeline: list[dict] | None = None
        """When a list (`record()`): each span of one phase at one size, and each event handled, in order."""

    def record(self) -> "System":
        """Keep the timeline (the replay check prints it beside the replay's own)."""
        self.timeline = []
        return self

    # -- timers: a newer timer of the same name voids the older --
    def schedule(self, at: float, name: str, *, replace: bool = True) -> None:
        if replace:
            self.gens[name] = self.gens.get(name, 0) + 1
        self.timers.append((at, Timer(name, self.gens.get(name, 0))))

    def cancel(self, name: str) -> None:
        self.gens[name] = self.gens.get(name, 0) + 1

    def on_timer(self, t: float, timer: Timer) -> None:
        if timer.gen != self.gens.get(timer.name, 0):
            return
        if timer.name == "moved":
            self.phase, self.training_since = Phase.TRAINING, t
            self.react(t, ())
        else:
            self.timer(t, timer.name)

    # -- the clock --
    def steady_overhead(self, nodes: int) -> float:
        """Share of each step lost in steady state at `nodes`: blocking time of the periodic checkpoints."""
        return self.p.common.ckpt_block_s / self.p.common.ckpt_interval_s

    def unused_causes(self) -> tuple[Cause, Cause]:
        """What alive nodes outside the group are charged to: (usable ones, noticed ones)."""
        return Cause.JOIN, Cause.NOTICE

    def advance(self, t: float) -> None:
        dt = t - self.t
        if dt <= 0:
            return
        if self.timeline is not None:
            span = {"from_s": self.t, "to_s": t, "phase": self.phase.value, "workers": len(self.members)}
            last = self.timeline[-1] if self.timeline else {}
            if last.get("phase") == span["phase"] and last.get("workers") == span["workers"] and last["to_s"] == self.t:
                last["to_s"] = t
            else:
                self.timeline.append(span)
        best = self.table.best(len(self.alive))
        if self.phase is Phase.TRAINING:
            n = len(self.members)
            rate = self.table.rate(n) * (1 - self.steady_overhead(n))
            spare = sum(1 for x in self.alive if x not in self.noticed and x not in self.members)
            new_cause, noticed_cause = self.unused_causes()
            joined = self.table.best(min(len(self.alive), n + spare)) - self.table.best(n)
            self.lost[new_cause] += joined * dt
            self.lost[noticed_cause] += (best - self.table.best(n) - joined) * dt
            self.lost[Cause.LAYOUT] += (self.table.best(n) - self.table.rate(n)) * dt
            self.lost[Cause.STEADY] += (self.table.rate(n) - rate) * dt
            self.trained += rate * dt
            total, every = self.since_ckpt_s + dt, self.p.common.ckpt_interval_s
            if total >= every:
                self.since_ckpt_s = total % every
                self.since_ckpt_tokens = rate * self.since_ckpt_s
            else:
                self.since_ckpt_s, self.since_ckpt_tokens = total, self.since_ckpt_tokens + rate * dt
        else:
            self.lost[self.cause] += best * dt
        self.t = t

    def redo(self, tokens: float) -> None:
        """Work trained since the state it resumes from: trained, but it does not count."""
        tokens = min(tokens, self.trained)
        self.trained -= tokens
        self.lost[Cause.REDONE] += tokens

    def checkpoint_now(self) -> None:
        self.since_ckpt_tokens, self.since_ckpt_s = 0.0, 0.0

    def count(self, what: str) -> None:
        self.events[what] = self.events.get(what, 0) + 1
        if self.timeline is not None:
            self.timeline.append({"at_s": self.t, "event": what})

    # -- the nodes --
    @property
    def usable(self) -> tuple[str, ...]:
        """Alive nodes not under notice, in join order."""
        return tuple(sorted((n for n in self.alive if n not in self.noticed), key=lambda n: (self.alive[n], n)))

    @property
    def lost_members(self) -> list[str]:
        return [m for m in self.members if m not in self.alive]

    def apply(self, batch: tuple[Event, ...]) -> None:
        for e in batch:
            if e.kind is Kind.ADD:  # a node that comes (back) is a new instance: no notice of an earlier one holds
                self.alive[e.node] = e.t
                self.noticed.discard(e.node)
            elif e.kind is Kind.NOTICE:
                self.noticed.add(e.node)
            else:
                self.alive.pop(e.node, None)

    def start(self, t: float, batch: tuple[Event, ...]) -> None:
        """The trace's first instant: train at once on what is there, at no cost."""
        self.apply(batch)
        self.members = self.pick(self.usable)
        self.phase = Phase.TRAINING if self.table.rate(len(self.members)) > 0 else Phase.WAITING
        self.training_since = t
        self.compiled.add(len(self.members))
        self.t = t

    def pick(self, usable: tuple[str, ...]) -> tuple[str, ...]:
        """The members a (re)start takes from the usable nodes."""
        return usable

    def on_batch(self, t: float, batch: tuple[Event, ...]) -> None:
        self.apply(batch)
        self.react(t, batch)

    def react(self, t: float, batch: tuple[Event, ...]) -> None:
        raise NotImplementedError

    def timer(self, t: float, name: str) -> None:
        raise NotImplementedError

    # -- costs --
    def step_s(self, nodes: int) -> float:
        r = self.table.rate(nodes)
        return self.job.tokens_per_step / r if r > 0 else 0.0

    def compile_s(self, nodes: int) -> float:
        """The first step's compile at this size: cold the first time, warm after."""
        warm = nodes in self.compiled
        self.compiled.add(nodes)
        return self.p.common.compile_warm_s if warm else self.p.common.compile_cold_s

    def load_s(self, nodes: int) -> float:
        """A DCP load of the whole state from object storage, every node reading its share."""
        return self.job.state_bytes / (max(nodes, 1) * self.p.hardware.store_bytes_s)

    def move(self, until: float, members: tuple[str, ...], cause: Cause) -> None:
        if self.table.rate(len(members)) <= 0:
            self.wait(cause)
            return
        self.phase, self.cause, self.members = Phase.MOVING, cause, members
        self.schedule(until, "moved")

    def wait(self, cause: Cause) -> None:
        self.phase, self.cause, self.members = Phase.WAITING, cause, ()
        self.cancel("moved")

    def restart_from_checkpoint(self, t: float, members: tuple[str, ...], cause: Cause, *, before_s: float) -> None:
        """Every worker started anew on `members` after `before_s`, the state loaded from the last
        checkpoint; what was trained since it is redone."""
        self.redo(self.since_ckpt_tokens)
        self.checkpoint_now()
        n = len(members)
        if self.table.rate(n) <= 0:
            self.wait(cause)
            return
        c = self.p.common
        self.move(t + before_s + c.build_s + c.comm_init_s + self.load_s(n) + self.compile_s(n), members, cause)


class Elastron(System):
    """The coordinator's policy with this project's measured per-event parts."""

    name = "elastron"

    def __init__(self, job: Job, table: SizeTable, params: Params):
        super().__init__(job, table, params)
        self.settled_at = 0.0
        self.warm_at: dict[str, float] = {}
        """Node -> when the worker a growth adds there is warm: started at the first decision after the
        node came (the coordinator's prewarm), `joiner_start_s` later."""
        self.drain_at: dict[str, float] = {}
        """Noticed node -> when the group moves off it (its deadline less the lead, or the notice)."""
        self.deadline: dict[str, float] = {}
        self.last_move_off_s: float | None = None
        """The last live move's hand-over and transfer (a growth or a drain), as the coordinator records it."""

    def snapshot_copy_s(self, nodes: int) -> float:
        hw = self.p.hardware
        return self.job.state_bytes / (nodes * hw.gpus_per_node) / (hw.d2h_gbyte_s * GB)

    def snapshot_every(self, nodes: int) -> int:
        """workers.pace: every `snapshot_every` steps unless a snapshot costs more than `peer_budget` of them."""
        e, step = self.p.elastron, self.step_s(nodes)
        if step <= 0:
            return e.snapshot_every
        return max(e.snapshot_every, math.ceil(self.snapshot_copy_s(nodes) / (e.peer_budget * step)))

    def snapshot_round_s(self, nodes: int) -> float:
        """The snapshot round after a step, sending each member's shard to its buddy: a loss inside it
        finds the last step's snapshot incomplete and restores the one before. (On this box a round
        outlasted a step: a kill after step 12 restored step 11, elastic.py FSDP kill.)"""
        return self.job.state_bytes / nodes / self.p.hardware.net_bytes_s

    def steady_overhead(self, nodes: int) -> float:
        step = self.step_s(nodes)
        snap = self.snapshot_copy_s(nodes) / (self.snapshot_every(nodes) * step) if step > 0 else 0.0
        return super().steady_overhead(nodes) + snap

    def wire_s(self, old: int, nodes: int) -> float:
        """The bytes the busiest node moves from `old` members to `nodes`: sharded, each node receives its
        new shard (FSDP's chunks shift, so nearly all of it); replicated, each joiner receives the whole
        state from an old member (an old member serving several joiners sends it to each), and a shrink
        moves nothing."""
        state, bw = self.job.state_bytes, self.p.hardware.net_bytes_s
        if not self.job.replicated:
            return state / nodes / bw
        joiners = max(0, nodes - old)
        return state * math.ceil(joiners / max(old, 1)) / bw if joiners else 0.0

    def move_off_s(self, old: int, nodes: int) -> float:
        """The part of a move from `old` members to `nodes` that needs the old workers: hand-over, plan,
        rendezvous, the bytes moved."""
        e = self.p.elastron
        return e.handover_s + self.job.plan_s + e.rendezvous_s + self.wire_s(old, nodes)

    def move_s(self, old: int, nodes: int) -> float:
        """The move off, then communicator init, form, the first step's compile."""
        e, c = self.p.elastron, self.p.common
        return self.move_off_s(old, nodes) + c.comm_init_s + e.form_s + self.compile_s(nodes)

    def live_move(self, t: float, members: tuple[str, ...], cause: Cause) -> float:
        """A sound group's live move to `members` (a growth, a drain); returns when its move off ends."""
        old = len(self.members)
        off = self.move_off_s(old, len(members))
        self.last_move_off_s = off
        self.move(t + self.move_s(old, len(members)), members, cause)
        return t + off

    def call_s(self, nodes: int) -> float:
        """A training call between two decisions at `nodes`: as many steps as fit in the coordinator's
        chunk, at least one (service.control.progress.steps_per_call)."""
        step, chunk = self.step_s(nodes), self.p.elastron.chunk_s
        return step * max(1, min(100, int(chunk / step))) if step > 0 else chunk

    def next_decision(self, t: float) -> float:
        """The first decision at or after `t`: the policy decides only between training calls, so while
        the group trains that is the end of the call in flight (calls follow each other from the move's
        end); otherwise `t`. A loss is not held: the coordinator's probes abort the call."""
        if self.phase is not Phase.TRAINING:
            return t
        call = self.call_s(len(self.members))
        return self.training_since + max(0, math.ceil((t - self.training_since) / call - 1e-9)) * call

    def on_timer(self, t: float, timer: Timer) -> None:
        if timer.name == "moved" and timer.gen == self.gens.get("moved", 0):
            # a resize resets the policy's settle timer: a growth still pending settles anew from the first
            # decision after the move
            self.settled_at = t + self.p.elastron.settle_s
        super().on_timer(t, timer)

    def drain_lead_s(self) -> float | None:
        """The product's lead (service.control.drain) from this group's call and its last move off."""
        e = self.p.elastron
        call = max(self.step_s(len(self.members)), e.chunk_s)
        return e.drain_lead().lead_s(call_s=call, move_s=self.last_move_off_s)

    def on_batch(self, t: float, batch: tuple[Event, ...]) -> None:
        before = self.usable
        self.apply(batch)
        seen = self.next_decision(t)  # the policy sees the change at its next decision
        if self.usable != before:  # any change of the offer restarts the growth's settle timer
            self.settled_at = seen + self.p.elastron.settle_s
            self.cancel("grow")
        for e in batch:
            if e.kind is Kind.ADD:  # the growth's workers there start at that decision (the prewarm)
                self.warm_at[e.node] = seen + self.p.elastron.joiner_start_s
            if e.kind is Kind.NOTICE:
                self.deadline[e.node] = e.deadline if e.deadline is not None else t
                self.drain_at[e.node] = seen
                keep = [m for m in self.members if m not in self.noticed]
                lead = self.drain_lead_s()
                # the policy holds only where the rest can still run (a Wait releases the group at once)
                if lead is not None and e.node in self.members and self.table.rate(len(keep)) > 0:
                    self.drain_at[e.node] = self.next_decision(max(t, self.deadline[e.node] - lead))
                if self.drain_at[e.node] > t:
                    self.schedule(self.drain_at[e.node], "drain", replace=False)
        self.react(t, batch)

    def react(self, t: float, batch: tuple[Event, ...]) -> None:
        if self.phase is Phase.MOVING:
            return  # the move's end looks again
        usable = self.usable
        if self.lost_members:
            self.recover(t)
        elif any(m in self.noticed and self.drain_at.get(m, 0.0) <= t for m in self.members):
            # the earliest move-off moves the group off every noticed member at once, as the policy does
            self.count("drain")
            # the policy's shrink takes what the rest offers: the members that stay and the warm joiners
            # (a node whose worker is still starting waits for a growth)
            keep = tuple(n for n in usable if n in self.members or self.warm_at.get(n, math.inf) <= t)
            deadline = min(self.deadline.get(m, t) for m in self.members if m in self.noticed)
            if self.table.rate(len(keep)) <= 0:  # nothing left to run on: save (the notice allows it) and wait
                self.checkpoint_now()
                self.wait(Cause.NOTICE)
            elif self.live_move(t, keep, Cause.NOTICE) > deadline:
                self.count("drain, moved off after its deadline")
        elif self.phase is Phase.WAITING:
            if self.table.rate(len(usable)) > 0:
                self.count("start")
                self.restart_from_checkpoint(t, usable, Cause.JOIN, before_s=self.p.elastron.joiner_start_s)
        elif len(usable) > len(self.members):
            self.schedule(self.next_decision(max(t, self.settled_at)), "grow")

    def recover(self, t: float) -> None:
        """Survivors re-form from peer snapshots; from the durable checkpoint instead when a lost member's
        buddy (the next member in the group, which holds its snapshot) is lost too."""
        e, c = self.p.elastron, self.p.common
        members, lost = self.members, set(self.lost_members)
        n_old = len(members)
        buddy_lost = any(members[(i + 1) % n_old] in lost for i, m in enumerate(members) if m in lost)
        keep = tuple(m for m in members if m in self.alive and m not in self.noticed)
        survivor = any(m in self.alive for m in members)
        detect = e.detect_s(c) + e.failure_handled_s
        if (buddy_lost and not self.job.replicated) or not survivor:
            self.count("loss, from storage")
            self.restart_from_checkpoint(t, keep, Cause.LOSS, before_s=detect)
            return
        self.count("loss, from peers")
        # the step in flight (where the group is in it), one step more when the loss lands inside the
        # snapshot round that sends the last step's shard (sharded only: a replica's own copy is complete),
        # and the steps since the last snapshot when the pace spaces them; never more than the group
        # trained since it formed (the move's end is a complete state)
        step = self.step_s(n_old)
        trained_s = t - self.training_since if self.phase is Phase.TRAINING else 0.0
        in_flight = trained_s % step if step > 0 else 0.0
        lag = 0.0 if self.job.replicated or in_flight >= self.snapshot_round_s(n_old) else step
        lost_s = in_flight + lag + step * (self.snapshot_every(n_old) - 1) / 2
        self.redo(self.table.rate(n_old) * min(lost_s, trained_s))
        if self.table.rate(len(keep)) <= 0:
            self.wait(Cause.LOSS)
            return
        self.move(t + detect + self.move_s(n_old, len(keep)), keep, Cause.LOSS)

    def timer(self, t: float, name: str) -> None:
        if self.phase is not Phase.TRAINING:
            return
        if name == "drain":
            self.react(t, ())
            return
        usable = self.usable
        if len(usable) <= len(self.members):
            return
        warm = max(self.warm_at.get(n, self.alive[n] + self.p.elastron.joiner_start_s)
                   for n in usable if n not in self.members)
        if t < max(warm, self.settled_at) - 1e-9:
            self.schedule(self.next_decision(max(warm, self.settled_at)), "grow")
            return
        self.count("grow")
        self.live_move(t, usable, Cause.JOIN)


class RayTrain(System):
    """Ray Train v2 elastic: every change restarts every worker from the last checkpoint."""

    name = "raytrain"

    def __init__(self, job: Job, table: SizeTable, params: Params):
        super().__init__(job, table, params)
        self.resize_pending = False

    def react(self, t: float, batch: tuple[Event, ...]) -> None:
        r = self.p.raytrain
        for e in batch:
            if e.kind is Kind.NOTICE and e.node in self.members:
                self.schedule(t + r.preemption_poll_s, "jit", replace=False)
        if self.phase is Phase.MOVING:
            return
        usable = self.usable
        lost = self.lost_members
        if lost:
            self.count("loss")
            cause = Cause.NOTICE if all(m in self.noticed for m in lost) else Cause.LOSS
            self.noticed -= set(lost)
            self.cancel("resize")
            self.resize_pending = False
            self.restart_from_checkpoint(t, self.pick(usable), cause,
                                         before_s=self.p.common.kill_detect_s + r.stale_start_timeout_s
                                         + r.group_start_s)
        elif self.phase is Phase.WAITING:
            if self.table.rate(len(self.pick(usable))) > 0:
                self.count("start")
                self.restart_from_checkpoint(t, self.pick(usable), Cause.JOIN, before_s=r.group_start_s)
        elif self.grows(usable) and not self.resize_pending:
            self.resize_pending = True
            self.schedule(t + r.autoscaler_tick_s + r.monitor_interval_s, "resize")

    def grows(self, usable: tuple[str, ...]) -> bool:
        return len(usable) > len(self.members)

    def timer(self, t: float, name: str) -> None:
        r = self.p.raytrain
        if name == "jit":
            if self.phase is Phase.TRAINING:
                self.checkpoint_now()
            return
        self.resize_pending = False
        usable = self.usable
        if self.phase is Phase.TRAINING and self.grows(usable):
            self.count("grow")
            self.restart_from_checkpoint(t, self.pick(usable), Cause.JOIN, before_s=r.group_stop_s + r.group_start_s)

    def on_timer(self, t: float, timer: Timer) -> None:
        if timer.name == "jit":  # one per notice: none voids another
            self.timer(t, "jit")
        else:
            super().on_timer(t, timer)


class Fixed(RayTrain):
    """The same loop on exactly `size` nodes: it never grows, and waits while fewer are usable."""

    name = "fixed"

    def __init__(self, job: Job, table: SizeTable, params: Params, size: int):
        super().__init__(job, table, params)
        self.size = size

    def pick(self, usable: tuple[str, ...]) -> tuple[str, ...]:
        return usable[:self.size] if len(usable) >= self.size else ()

    def grows(self, usable: tuple[str, ...]) -> bool:
        return False

    def unused_causes(self) -> tuple[Cause, Cause]:
        return Cause.IDLE, Cause.IDLE


@dataclass(frozen=True, slots=True)
class Result:
    system: str
    trained_tokens: float
    lost: dict[str, float]
    events: dict[str, int]
    nodes: int | None = None
    """The fixed job's size."""

    def to_dict(self, ideal: float, duration_s: float) -> dict:
        return {"system": self.system, "tokens_per_s": self.trained_tokens / duration_s,
                "trained_tokens": self.trained_tokens, "of_ideal": self.trained_tokens / ideal,
                "lost_of_ideal": {k: v / ideal for k, v in self.lost.items() if abs(v) > 1e-9 * ideal},
                "events": self.events, **({"nodes": self.nodes} if self.nodes is not None else {})}


def simulate(system: System, events: list[Event], end: float) -> Result:
    """One system over the events (notices included) from the first instant to `end`."""
    bs = batches(events)
    system.start(*bs[0])
    heap: list[tuple[float, int, int, object]] = [(t, 0, i, b) for i, (t, b) in enumerate(bs[1:])]
    heapq.heapify(heap)
    seq = len(heap)
    while True:
        for at, timer in system.timers:
            heapq.heappush(heap, (at, 1, seq, timer))
            seq += 1
        system.timers.clear()
        if not heap or heap[0][0] > end:
            break
        t, _, _, item = heapq.heappop(heap)
        system.advance(t)
        if isinstance(item, Timer):
            system.on_timer(t, item)
        else:
            system.on_batch(t, item)
    system.advance(end)
    return Result(system.name, system.trained, {str(c): v for c, v in system.lost.items()}, dict(system.events),
                  system.size)


def ideal_tokens(events: list[Event], table: SizeTable, end: float) -> float:
    """The best rate on the nodes alive, integrated over the trace: no cost for changing size."""
    pts = availability(events)
    return sum(table.best(n) * (min(t1, end) - t0) for (t0, n), (t1, _) in zip(pts, pts[1:] + [(end, 0)]))


SYSTEMS: dict[str, type[System]] = {"elastron": Elastron, "raytrain": RayTrain}
"""The elastic systems simulated beside the fixed job (a seam: tests add their own)."""


@dataclass(frozen=True, slots=True)
class JobRun:
    job: Job
    table: SizeTable
    ideal: float
    duration_s: float
    rows: tuple[Result, ...]
    fixed_by_size: dict[int, float]
    event_counts: dict[str, int]

    @property
    def errors(self) -> list[str]:
        return [f"{self.job.name}: {r.system} trained {r.trained_tokens:.6g} tokens, above the ideal "
                f"{self.ideal:.6g}: the simulation is wrong" for r in self.rows if r.trained_tokens > self.ideal * (1 + TOL)]

    def of_ideal(self, system: str) -> float:
        return next(r.trained_tokens for r in self.rows if r.system == system) / self.ideal


def run_job(job: Job, trace: list[Event], params: Params, *, systems: dict[str, type[System]] | None = None) -> JobRun:
    """Every system on one job over the whole trace."""
    c = params.common
    events = with_notices(trace, share=c.notice_share, notice_s=c.notice_s, seed=c.seed)
    end = trace[-1].t
    max_nodes = max(n for _, n in availability(events))
    table = size_table(job, params.hardware, max_nodes)
    ideal = ideal_tokens(events, table, end)
    rows = [simulate(cls(job, table, params), events, end) for cls in (systems or SYSTEMS).values()]
    lo = max(table.min_nodes, 1)
    sizes = range(lo, max_nodes + 1) if params.fixed.nodes == 0 else [params.fixed.nodes]
    fixed = [simulate(Fixed(job, table, params, n), events, end) for n in sizes]
    rows.append(max(fixed, key=lambda r: r.trained_tokens))
    return JobRun(job, table, ideal, end - trace[0].t, tuple(rows),
                  {r.nodes: r.trained_tokens / ideal for r in fixed},
                  {k.value: sum(1 for e in events if e.kind is k) for k in Kind})


# -- sensitivity ------------------------------------------------------------------------------------
SWEEP: tuple[tuple[str, tuple], ...] = (
    ("common.kill_detect_s", (1.0, 55.0)),
    ("common.comm_init_s", (1.0, 30.0)),
    ("common.compile_warm_s", (0.0, 12.6)),
    ("common.ckpt_interval_s", (120.0, 1800.0)),
    ("common.notice_share", (0.0, 1.0)),
    ("elastron.settle_s", (0.0, 30.0)),
    ("elastron.joiner_start_s", (2.0, 60.0)),
    ("elastron.drain_margin", (0.0, 3.0)),
    ("hardware.network_gbit_s", (100.0, 3200.0)),
    ("hardware.object_store_gbit_s", (10.0, 100.0)),
    ("raytrain.monitor_interval_s", (1.0, 60.0)),
)
"""Each assumption's low and high alternative, one at a time."""


def one_at_a_time(jobs: list[Job], trace: list[Event], params: Params) -> list[dict]:
    """Every system's share of the ideal with each SWEEP parameter at its low and high value."""
    base = {j.name: run_job(j, trace, params) for j in jobs}
    rows = []
    for key, values in SWEEP:
        for v in values:
            p = params.set(f"{key}={v}")
            for j in jobs:
                run = run_job(j, trace, p)
                rows.append({"param": key, "value": v, "job": j.name,
                             **{r.system: run.of_ideal(r.system) for r in run.rows},
                             "elastron_delta": run.of_ideal("elastron") - base[j.name].of_ideal("elastron")})
    return rows


def top_two(rows: list[dict]) -> list[str]:
    """The two parameters that move Elastron's share of the ideal the most (largest swing, any job)."""
    swing: dict[str, float] = {}
    for r in rows:
        swing[r["param"]] = max(swing.get(r["param"], 0.0), abs(r["elastron_delta"]))
    return sorted(swing, key=lambda k: -swing[k])[:2]


def grid(jobs: list[Job], trace: list[Event], params: Params, keys: list[str]) -> list[dict]:
    """Elastron's, Ray Train's and the fixed job's share of the ideal over low / default / high of two parameters."""
    def values(key: str) -> list:
        group, name = key.split(".")
        return sorted({*dict(SWEEP)[key], getattr(getattr(params, group), name)})
    out = []
    for a in values(keys[0]):
        for b in values(keys[1]):
            p = params.set(f"{keys[0]}={a}").set(f"{keys[1]}={b}")
            for j in jobs:
                run = run_job(j, trace, p)
                out.append({keys[0]: a, keys[1]: b, "job": j.name, **{r.system: run.of_ideal(r.system) for r in run.rows}})
    return out


# -- the check against the emulated replay (benchmarks/spot_trace.py) --------------------------------
REPLAY_DEFAULTS = {"state_bytes": 0.29e9, "ckpt_every": 20}
"""What a replay JSON may not record: spot_trace.py's defaults (`--preset small`: 0.29 GB of weights and
AdamW state; `--ckpt-every 20`)."""


def _settle(replay: dict) -> float:
    """The replay's Elastron settle time: its clock's setting (spot_clock.Clock.record), else `settle`."""
    try:
        return float(replay["clock"]["elastron"]["settle_seconds"]["set_s"])
    except (KeyError, TypeError):
        return 10.0 if replay.get("settle") is None else float(replay["settle"])


def cpu_box_params(replay: dict) -> Params:
    """The same model at the 2-core box's scale: one worker per simulated node, the parts measured on this
    box (docs/benchmarks.md, elastic.py and live_reshard.py; FACTS.md), no communicator or compile costs
    (gloo, no compile), the replay's settle time. Real work is not compressed in a replay, so these stay
    in real seconds while the schedule's times are the replay's."""
    return Params(
        common=Common(notice_share=replay.get("notice_share", 0.75), kill_detect_s=0.28, ckpt_block_s=0.0,
                      build_s=2.3, compile_cold_s=0.0, compile_warm_s=0.0, comm_init_s=0.0),
        hardware=Hardware(gpus_per_node=1, network_gbit_s=0.53 * 8 / 0.28, transfer_efficiency=1.0,
                          object_store_gbit_s=0.99 * 8 / 0.49, d2h_gbyte_s=0.36 / 0.13),
        elastron=ElastronCosts(settle_s=_settle(replay), joiner_start_s=4.7),
    )


def replay_scenario(replay: dict) -> tuple[list[Event], SizeTable, Job, float]:
    """A spot_trace.py replay's schedule as events (slots as nodes), its per-size throughput as the size
    table, and a job of its batch, state size and layout kind.

    The throughput (samples/s per worker count) is Elastron's own steady rate in this replay at each size
    it trained at (`analysis.own_throughput_by_size`: warm-up steps left out), else the replay's ideal
    (`ideal_throughput_by_size`, or `calibration`): the model is checked on what events cost, not on the
    box's load during the replay against the calibration's.

    The schedule as Elastron's replay executed it where it recorded that (`systems.elastron.replay`): the
    harness starts one node after another, so an add is usable when its start ended (`at` + `took_s`),
    not at its planned time. A notice's deadline is its slot's next removal (a removal in a window's first
    `notice_s` gets a shorter notice). The layout kind is the one the product chose in the replay
    (`extra.reconfigurations`' layouts: replicated when every one is data-parallel replicas only)."""
    try:
        k0, end, gbs = int(replay["k0"]), float(replay["replay_s"]), int(replay["global_batch_size"])
        thr = replay.get("ideal_throughput_by_size") or replay["calibration"]
        calib = {int(n): float(v) for n, v in thr.items()}
        actions = replay["actions"]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"replay JSON lacks {e}: give one replay's JSON from benchmarks/spot_trace.py --out (it "
                         f"has k0, replay_s, global_batch_size, ideal_throughput_by_size and actions)") from None
    elastron = (replay.get("systems") or {}).get("elastron") or {}
    executed = elastron.get("replay") or []
    if len(executed) == len(actions) and all(x.get("kind") == a["kind"] and x.get("slot") == a["slot"]
                                             for x, a in zip(executed, actions)):
        actions = [a | {"at": float(x["at"]) + (float(x.get("took_s") or 0.0) if a["kind"] == "add" else 0.0)}
                   for a, x in zip(actions, executed)]
    first: dict[str, str] = {}
    for a in actions:
        first.setdefault(f"s{a['slot']}", a["kind"])
    present = [s for s, kind in first.items() if kind != "add"][:k0]
    present += [f"start{i}" for i in range(k0 - len(present))]
    # the replay starts training at k0 nodes; its events at 0 s come after that start, as events
    events = [Event(-1e-6, Kind.ADD, s) for s in present]
    def deadline(i: int, a: dict) -> float | None:
        if a["kind"] != "notice":
            return None
        return next((float(b["at"]) for b in actions[i + 1:] if b["slot"] == a["slot"] and b["kind"] == "remove"),
                    None)
    events += [Event(float(a["at"]), Kind(a["kind"]), f"s{a['slot']}", deadline=deadline(i, a))
               for i, a in enumerate(actions)]
    order = {Kind.ADD: 0, Kind.NOTICE: 1, Kind.REMOVE: 2}
    events.sort(key=lambda e: (e.t, order[e.kind]))
    own = ((elastron.get("analysis") or {}).get("own_throughput_by_size")) or {}
    calib |= {int(n): float(v) for n, v in own.items() if float(v) > 0}
    top = max(calib)
    table = SizeTable(tuple([Size(0, "-", 0, 0, 0.0, 0.0)] +
                            [Size(n, f"{n} workers", n, 1, 1.0, calib.get(n, 0.0)) for n in range(1, top + 1)]))
    state = float(replay.get("state_bytes", REPLAY_DEFAULTS["state_bytes"]))
    layouts = [r.get("new_layout") or {} for r in (elastron.get("extra") or {}).get("reconfigurations") or []]
    replicated = bool(layouts) and all(lay.get("dp_shard", 1) == 1 and lay.get("tp", 1) == 1 and lay.get("pp", 1) == 1
                                       for lay in layouts)
    job = Job(name="replay", model=model_config("tiny"), params=state / 12.0, seq_len=1, global_batch=gbs,
              micro_batch=1, tokens_per_gpu_s=0.0, ref_nodes=1, plan_s=0.03, replicated=replicated)
    return events, table, job, end


def step_in_flight(replay: dict) -> float:
    """The share of Elastron's step in flight at the window's end that was done by then (0 to 1): from its
    rows, the last step finished inside the window and the next one after it; 0 without them."""
    e = (replay.get("systems") or {}).get("elastron") or {}
    rows, t0, wall = e.get("rows") or [], e.get("t0"), (e.get("analysis") or {}).get("wall_s")
    if t0 is None or wall is None:
        return 0.0
    end = float(t0) + float(wall)
    done = [r for r in rows if r["time"] <= end]
    after = [r for r in rows if r["time"] > end]
    if not done or not after or after[0]["step"] != done[-1]["step"] + 1:
        return 0.0
    return (end - done[-1]["time"]) / (after[0]["time"] - done[-1]["time"])


def check_replay(replay: dict, *, tolerance: float = 0.10, overrides: tuple[str, ...] = ()) -> dict:
    """Elastron simulated on one replay's schedule at the box's scale against the goodput it measured;
    `overrides` (GROUP.FIELD=VALUE) change the box's parameters, e.g. to one the replay measured itself."""
    events, table, job, end = replay_scenario(replay)
    params = cpu_box_params(replay)
    for o in overrides:
        params = params.set(o)
    step = job.global_batch / table.rate(int(replay["k0"]))
    ckpt_every = float(replay.get("ckpt_every", REPLAY_DEFAULTS["ckpt_every"]))
    params = params.set(f"common.ckpt_interval_s={ckpt_every * step}")
    model = Elastron(job, table, params).record()
    sim = simulate(model, events, end)
    ideal = ideal_tokens(events, table, end)
    try:
        analysis = replay["systems"]["elastron"]["analysis"]
        measured = float(analysis["goodput_samples_per_s"])
    except (KeyError, TypeError):
        raise ValueError("replay JSON has no systems.elastron.analysis.goodput_samples_per_s: give a replay "
                         "in which elastron ran") from None
    # The model starts training at 0 s, as the whole-trace simulation does; the replay's stalls before its
    # first event (process start and first steps, which spot_trace.py charges to "start") are taken out of
    # its time: the trace caused none of them. The model counts what it trained until the end; the
    # replay's goodput counts whole steps, so the step in flight at the end is added pro rata.
    wall = float(analysis.get("wall_s", end))
    start_s = float((analysis.get("stall_s") or {}).get("start", 0.0))
    in_flight = step_in_flight(replay)
    measured_trained = (measured * wall + in_flight * job.global_batch) / (wall - start_s) if wall > start_s else 0.0
    simulated = sim.trained_tokens / end
    diff = simulated / measured_trained - 1 if measured_trained else math.inf
    return {"window": replay.get("window"), "mapping": replay.get("mapping"), "seed": replay.get("seed"),
            "simulated_samples_per_s": simulated, "measured_samples_per_s": measured,
            "measured_start_stall_s": start_s, "measured_step_in_flight_at_end": round(in_flight, 3),
            "measured_samples_per_s_after_start": measured_trained, "size_table": {
                s.nodes: s.tokens_s for s in table.sizes[1:]},
            "simulated_of_ideal": sim.trained_tokens / ideal, "relative_difference": diff,
            "within": abs(diff) <= tolerance, "tolerance": tolerance, "events": sim.events,
            "lost_of_ideal": {k: v / ideal for k, v in sim.lost.items() if v}, "replicated": job.replicated,
            "timeline": [{k: round(v, 3) if isinstance(v, float) else v for k, v in x.items()} for x in model.timeline],
            "params": params.to_dict()}


# -- output -----------------------------------------------------------------------------------------
SHORT = {Cause.JOIN: "join", Cause.NOTICE: "notice", Cause.LOSS: "loss", Cause.REDONE: "redone",
         Cause.LAYOUT: "layout", Cause.IDLE: "idle", Cause.STEADY: "steady"}


def table_md(run: JobRun) -> str:
    head = "| system | tokens/s | ÷ ideal | " + " | ".join(SHORT[c] for c in Cause) + " | events |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in run.rows:
        d = r.to_dict(run.ideal, run.duration_s)
        name = r.system + (f" ({r.nodes} nodes)" if r.nodes else "")
        lost = " | ".join(f"{100 * r.lost[str(c)] / run.ideal:.1f}%" for c in Cause)
        ev = ", ".join(f"{k} {v}" for k, v in sorted(r.events.items()))
        lines.append(f"| {name} | {d['tokens_per_s']:,.0f} | **{100 * d['of_ideal']:.1f}%** | {lost} | {ev} |")
    lines.append(f"| ideal | {run.ideal / run.duration_s:,.0f} | 100% | | | | | | | | |")
    return "\n".join(lines)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


JOBS = {"8b": job_8b, "70b": job_70b}


def main(argv: list[str] | None = None, *, systems: dict[str, type[System]] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    ap.add_argument("--set", action="append", default=[], metavar="GROUP.FIELD=VALUE",
                    help="change one parameter (repeatable), e.g. common.kill_detect_s=50")
    ap.add_argument("--no-sweep", action="store_true", help="skip the sensitivity runs")
    ap.add_argument("--check-replay", type=Path, nargs="+", default=[],
                    help="replay JSONs of benchmarks/spot_trace.py --out to check Elastron's model against")
    ap.add_argument("--replay-set", action="append", default=[], metavar="GROUP.FIELD=VALUE",
                    help="change one of the box's parameters for --check-replay (repeatable)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        params = Params()
        for s in args.set:
            params = params.set(s)
        trace = load_trace(args.trace)
        replays = {str(p): json.loads(p.read_text()) for p in args.check_replay}
    except (OSError, ValueError) as e:
        print(f"spot_sim: {e}", file=sys.stderr)
        return 2
    jobs = [JOBS[n]() for n in args.jobs]
    runs = [run_job(j, trace, params, systems=systems) for j in jobs]
    errors = [e for r in runs for e in r.errors]
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(), "argv": sys.argv[1:] if argv is None else argv,
                 "trace": args.trace.name, "params": params.to_dict(), "jobs": {}}
    for run in runs:
        print(f"\n{run.job.name}: {run.duration_s / 3600:.2f} h, events {run.event_counts}, "
              f"ideal {run.ideal / run.duration_s:,.0f} tokens/s")
        print(table_md(run))
        out["jobs"][run.job.name] = {
            "job": {k: v for k, v in dataclasses.asdict(run.job).items() if k != "model"} | {"model": dataclasses.asdict(run.job.model)},
            "sizes": [dataclasses.asdict(s) for s in run.table.sizes[1:]],
            "ideal_tokens_per_s": run.ideal / run.duration_s, "duration_s": run.duration_s, "events": run.event_counts,
            "systems": {r.system: r.to_dict(run.ideal, run.duration_s) for r in run.rows},
            "fixed_of_ideal_by_size": run.fixed_by_size}
    if not args.no_sweep and not errors:
        rows = one_at_a_time(jobs, trace, params)
        keys = top_two(rows)
        out["sensitivity"] = {"one_at_a_time": rows, "top_two": keys, "grid": grid(jobs, trace, params, keys)}
        print(f"\nsensitivity: the two that move Elastron most: {keys}")
        for g in out["sensitivity"]["grid"]:
            print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in g.items()))
    if replays:
        try:
            checks = [check_replay(r, overrides=tuple(args.replay_set)) | {"replay": p} for p, r in replays.items()]
        except ValueError as e:
            print(f"spot_sim: {e}", file=sys.stderr)
            return 2
        worst = max(abs(c["relative_difference"]) for c in checks)
        mean = sum(abs(c["relative_difference"]) for c in checks) / len(checks)
        # every replay on its own: a mean of signed differences would let a -20% and a +20% pass
        out["replay_check"] = {"replays": checks, "mean_abs_relative_difference": mean,
                               "worst_abs_relative_difference": worst, "within": all(c["within"] for c in checks)}
        for c in checks:
            print(f"replay {c['replay']}: simulated {c['simulated_samples_per_s']:.2f} samples/s, measured "
                  f"{c['measured_samples_per_s_after_start']:.2f} without its {c['measured_start_stall_s']:.1f} s "
                  f"start stall and with {c['measured_step_in_flight_at_end']:.2f} of the step in flight at the "
                  f"end ({c['measured_samples_per_s']:.2f} whole steps over the window): "
                  f"{100 * c['relative_difference']:+.1f}%")
        print(f"replay check: mean |difference| {100 * mean:.1f}%, worst {100 * worst:.1f}% "
              f"({'every replay within' if out['replay_check']['within'] else 'NOT every replay within'} 10%)")
    out["errors"] = errors
    out["run_s"] = round(time.perf_counter() - t0, 2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    for e in errors:
        print(f"spot_sim: ERROR {e}", file=sys.stderr)
    if errors:
        return 1
    if replays and not out["replay_check"]["within"]:
        print("spot_sim: the simulated Elastron is off a replay by more than the tolerance", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
