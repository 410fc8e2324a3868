"""The model behind benchmarks/shared_cluster.py: a seeded workload and two discrete-event simulations of
one shared cluster, no Ray and no sleeping (the clock jumps from event to event).

Workload (`workload()`, seeded): Poisson arrivals over `--hours`, three classes (`CLASSES`): batch jobs
(priority 0, long), team jobs (priority 5) and urgent jobs (priority 10, short, the "high-priority" rows).
A job needs `work` worker-seconds and progresses at one unit per worker held per second (linear scaling,
neither side gets an efficiency bonus); it may hold min_workers..max_workers.

Elastron (`run_elastron`): on every arrival and completion the real policy `service.sharing.scheduler.schedule`
is called with the ledger of grants and every unfinished job; its ledger is the new set of grants. Then
  - a job whose grant drops below what it holds (Shrink, Pause) keeps its workers for `--resize-s`,
    making no progress (the planned resize; for a Pause, the checkpoint first), then lets them go;
    0 work is lost;
  - a job whose grant is above what it holds (Start, Grow, a resume: Grow from 0) takes its workers as
    soon as they are free on the granted nodes (after the releases in flight), then makes no progress
    for `--resize-s` (a running job's grow) or `--restart-s` (a start or a resume from its checkpoint);
  - a grant on other nodes than the job holds (a move: the policy avoids them, counted as "moving
    resize" when the job's size changes too, "same-size move" when not) is carried out as the release,
    then the growth: two planned resizes; below its minimum, mid-move, a job makes no progress.
    Releases and moves in flight land on the newest grant.
Other events (a release, the end of a resize) do not call the policy: it is idempotent (calling it again
on its own result changes nothing), so such a call would decide nothing.
Baselines (`run_baseline`), modelled on Kueue's BestEffortFIFO queue with priority preemption (or none,
`preempt=False`):
  - gang (`partial=False`): a job is admitted at its max_workers (what its user would request) or not
    at all;
  - partial admission (`partial=True`, Kueue's PartialAdmission with the job's min_workers as the
    podset's minCount): a job is admitted at max_workers if that fits, freely or by preemption; if not,
    at the largest count down to min_workers that does (`admission_size`: Kueue's binary search over
    the reduction). The size is chosen once per admission and never changes while the job runs; an
    evicted job is queued again at its full size and sized anew when readmitted;
  - pending jobs are admitted by priority, then arrival; one that does not fit lets later ones try;
  - a job that does not fit evicts running jobs of strictly lower priority (lowest priority first, the
    most recently started first), then keeps running those not needed (Kueue's minimal preemption);
  - an evicted job goes back to the queue and restarts from its last periodic checkpoint (every
    `--checkpoint-interval-s` of running time): the work since then is lost; every start costs
    `--restart-s`.
  Preemption is of whole jobs in both. Assumptions that favour the baselines: eviction is instant (no
  termination grace period), checkpoints cost nothing, placement counts workers only (no node
  fragmentation; with one-CPU workers Elastron's per-node placement never fragments either), and a
  partially admitted job resumes its checkpoint at whatever size it is readmitted with.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from service.sharing.ledger import Ledger, NodeCapacity
from service.sharing.scheduler import JobRequest, Phase, schedule

URGENT = 10
CLASSES = (  # name, share of arrivals, priority, max_workers choices, min = max // div, hours at max (log-uniform)
    ("batch", 0.45, 0, (16, 32, 64), 4, (0.25, 3.0)),
    ("team", 0.35, 5, (8, 16, 32), 4, (0.1, 1.5)),
    ("urgent", 0.20, URGENT, (8, 16, 32), 2, (0.05, 1.0)),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    seed: int = 0
    hours: float = 24.0
    """Arrivals come for this long; the run ends when the last job is done."""
    nodes: int = 16
    workers_per_node: int = 8
    jobs_per_hour: float = 7.0
    """About 110% of the capacity offered over the day (a busy cluster that drains overnight)."""
    resize_s: float = 30.0
    """Elastron's planned resize (and checkpoint-before-pause): no progress, no work lost."""
    restart_s: float = 120.0
    """A start or restart from a checkpoint (both systems): no progress."""
    checkpoint_interval_s: float = 1800.0
    """Baseline: periodic checkpoints; an eviction loses the work since the last one."""

    def __post_init__(self) -> None:
        for name in ("hours", "jobs_per_hour", "checkpoint_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("resize_s", "restart_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError(f"need at least one node and one worker per node, got {self.nodes} x "
                             f"{self.workers_per_node}")
        if self.capacity < max(m for c in CLASSES for m in c[3]):
            raise ValueError(f"capacity {self.capacity} is below the largest job's max_workers")

    @property
    def capacity(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def day_s(self) -> float:
        return self.hours * 3600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    job_id: str
    kind: str
    arrival: float
    priority: int
    min_workers: int
    max_workers: int
    work: float
    """Worker-seconds to finish."""


def workload(cfg: SimConfig) -> list[JobSpec]:
    rng = random.Random(cfg.seed)
    out, t = [], rng.expovariate(cfg.jobs_per_hour / 3600.0)
    while t < cfg.day_s:
        kind, _, prio, maxes, div, (lo, hi) = rng.choices(CLASSES, weights=[c[1] for c in CLASSES])[0]
        mx = rng.choice(maxes)
        hours = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        out.append(JobSpec(job_id=f"j{len(out):03d}-{kind}", kind=kind, arrival=t, priority=prio,
                           min_workers=mx // div, max_workers=mx, work=round(mx * hours * 3600.0)))
        t += rng.expovariate(cfg.jobs_per_hour / 3600.0)
    return out


@dataclass(slots=True)
class _Run:
    """One job's state in a simulation (mutable, private)."""
    spec: JobSpec
    phys: dict[str, int] = field(default_factory=dict)
    """Workers it occupies now, per node."""
    target: dict[str, int] = field(default_factory=dict)
    """Elastron: its grant in the scheduler's ledger."""
    done: float = 0.0
    busy_until: float = 0.0
    """No progress before this (a resize, a restart)."""
    release_at: float | None = None
    granted_at: float | None = None
    """First time it held workers."""
    started_at: float = 0.0
    """Latest time it took workers from none (a start or restart)."""
    finished_at: float | None = None
    ever_granted: bool = False
    resuming: bool = True
    """Elastron: it starts, or resumes from its checkpoint, when it next takes workers from none."""
    shrink_could_admit: bool = False

    @property
    def workers(self) -> int:
        return sum(self.phys.values())

    @property
    def remaining(self) -> float:
        return self.spec.work - self.done


@dataclass(kw_only=True, slots=True)
class SimResult:
    system: str
    capacity: dict[str, int]
    runs: list[_Run]
    trace: list[tuple[float, str, tuple[tuple[str, int], ...]]] = field(default_factory=list)
    """(time, job, workers per node after the change): every change of what a job occupies."""
    useful_day: float = 0.0
    held_day: float = 0.0
    idle_held: float = 0.0
    lost: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    sched_s: list[float] = field(default_factory=list)
    end: float = 0.0


def _overlap(a: float, b: float, day: float) -> float:
    return max(0.0, min(b, day) - max(a, 0.0))


def _advance(res: SimResult, live: list[_Run], a: float, b: float, day: float) -> None:
    for r in live:
        if not r.phys:
            continue
        w = r.workers
        # Below its minimum (mid-move across nodes) a job cannot train.
        start = min(max(a, r.busy_until), b) if w >= r.spec.min_workers else b
        r.done += w * (b - start)
        res.useful_day += w * _overlap(start, b, day)
        res.held_day += w * _overlap(a, b, day)
        res.idle_held += w * (start - a)


def _next_time(t: float, live: list[_Run], arrivals: list[JobSpec]) -> float:
    times = [arrivals[0].arrival] if arrivals else []
    for r in live:
        if r.release_at is not None:
            times.append(r.release_at)
        if r.workers >= r.spec.min_workers:
            times.append(r.busy_until if r.busy_until > t else t + r.remaining / r.workers)
    if not times:
        raise RuntimeError(f"t={t:.0f}: {len(live)} jobs wait and nothing will change")
    return max(t, min(times))


def _finish(res: SimResult, live: list[_Run], t: float) -> list[_Run]:
    gone = [r for r in live if r.phys and r.remaining <= 1e-6 * r.spec.work]
    for r in gone:
        r.done, r.finished_at, r.phys, r.target = r.spec.work, t, {}, {}
        live.remove(r)
        res.trace.append((t, r.spec.job_id, ()))
    return gone


def _set(res: SimResult, r: _Run, t: float, phys: dict[str, int]) -> None:
    r.phys = {n: k for n, k in sorted(phys.items()) if k}
    res.trace.append((t, r.spec.job_id, tuple(r.phys.items())))


def run_elastron(cfg: SimConfig, specs: list[JobSpec]) -> SimResult:
    nodes = tuple(NodeCapacity(node_id=f"n{i:02d}", cpus=float(cfg.workers_per_node)) for i in range(cfg.nodes))
    res = SimResult(system="elastron", capacity={n.node_id: cfg.workers_per_node for n in nodes},
                    runs=[_Run(s) for s in specs],
                    counts=dict.fromkeys(("shrink", "pause", "grow", "resume", "moving resize", "same-size move"),
                                         0))
    ledger, arrivals, live, t = Ledger(nodes=nodes), sorted(specs, key=lambda s: s.arrival), [], 0.0
    by_id = {r.spec.job_id: r for r in res.runs}
    while arrivals or live:
        nt = _next_time(t, live, arrivals)
        _advance(res, live, t, nt, cfg.day_s)
        t = nt
        changed = False
        for r in _finish(res, live, t):
            ledger, changed = ledger.without(r.spec.job_id), True
        for r in live:
            if r.release_at is not None and r.release_at <= t:
                r.release_at = None
                _set(res, r, t, {n: min(k, r.target.get(n, 0)) for n, k in r.phys.items()})
        while arrivals and arrivals[0].arrival <= t:
            r = by_id[arrivals.pop(0).job_id]
            r.shrink_could_admit = _shrinkable(ledger, live, r.spec) >= r.spec.min_workers
            live.append(r)
            changed = True
        if changed:
            ledger = _reschedule(res, ledger, live, t, cfg)
        _acquire(res, live, t, cfg)
    res.end = t
    return res


def _shrinkable(ledger: Ledger, live: list[_Run], spec: JobSpec) -> int:
    """Free workers plus what running jobs of priority <= spec's hold above their minimum."""
    extra = sum(max(0, sum(r.target.values()) - r.spec.min_workers) for r in live
                if r.target and r.spec.priority <= spec.priority)
    return sum(int(c) for c, _ in ledger.free().values()) + extra


def _reschedule(res: SimResult, ledger: Ledger, live: list[_Run], t: float, cfg: SimConfig) -> Ledger:
    def phase(r: _Run) -> Phase:
        return Phase.RUNNING if r.target else Phase.PAUSED if r.ever_granted else Phase.QUEUED

    jobs = [JobRequest(job_id=r.spec.job_id, priority=r.spec.priority, min_workers=r.spec.min_workers,
                       max_workers=r.spec.max_workers, submitted=r.spec.arrival, phase=phase(r)) for r in live]
    t0 = time.perf_counter()
    s = schedule(ledger, jobs)
    res.sched_s.append(time.perf_counter() - t0)
    res.counts["shrink"] += len(s.resizes)
    res.counts["pause"] += len(s.pauses)
    res.counts["grow"] += sum(1 for g in s.returns if g.before)
    res.counts["resume"] += sum(1 for g in s.returns if not g.before)
    for h in ledger.holdings:  # a running job that gains a worker on one node and loses one on another
        old, new = h.as_dict(), s.grant(h.job_id)
        gains, loses = (any(k > b.get(n, 0) for n, k in a.items()) for a, b in ((new, old), (old, new)))
        if gains and loses:
            res.counts["moving resize" if sum(new.values()) != h.workers else "same-size move"] += 1
    for r in live:
        new = s.grant(r.spec.job_id)
        if new == r.target:
            continue
        if any(new.get(n, 0) < k for n, k in r.phys.items()) and r.release_at is None:
            r.release_at = t + cfg.resize_s  # a release in flight lands on the newest grant
            r.busy_until = max(r.busy_until, r.release_at)
        r.target, r.ever_granted = new, r.ever_granted or bool(new)
        r.resuming = r.resuming or not new
    return s.ledger


def _acquire(res: SimResult, live: list[_Run], t: float, cfg: SimConfig) -> None:
    """Jobs granted more than they hold take it once it is free on their nodes."""
    used = dict.fromkeys(res.capacity, 0)
    for r in live:
        for n, k in r.phys.items():
            used[n] += k
    for r in sorted(live, key=lambda r: (-r.spec.priority, r.spec.arrival)):
        if r.release_at is not None or all(r.target.get(n, 0) <= r.phys.get(n, 0) for n in r.target):
            continue
        if any(used[n] - r.phys.get(n, 0) + k > res.capacity[n] for n, k in r.target.items()):
            continue
        for n, k in r.target.items():
            used[n] += k - r.phys.get(n, 0)
        cost = cfg.restart_s if r.resuming and not r.phys else cfg.resize_s  # a move across nodes: a resize
        _set(res, r, t, r.target)
        r.busy_until, r.resuming = max(r.busy_until, t + cost), False
        if r.granted_at is None:
            r.granted_at = t


def run_baseline(cfg: SimConfig, specs: list[JobSpec], *, partial: bool = False, preempt: bool = True) -> SimResult:
    """Kueue-style queue; `partial` turns on partial admission, `preempt=False` turns off priority
    preemption (Kueue's `withinClusterQueue: Never`); see the module docstring."""
    res = SimResult(system="partial" if partial else "baseline", capacity={"cluster": cfg.capacity},
                    runs=[_Run(s) for s in specs], counts={"eviction": 0, "partial admission": 0})
    arrivals, live, pending, t = sorted(specs, key=lambda s: s.arrival), [], [], 0.0
    by_id = {r.spec.job_id: r for r in res.runs}
    while arrivals or live:
        nt = _next_time(t, live, arrivals)
        _advance(res, live, t, nt, cfg.day_s)
        t = nt
        changed = bool(_finish(res, live, t))
        while arrivals and arrivals[0].arrival <= t:
            r = by_id[arrivals.pop(0).job_id]
            live.append(r)
            pending.append(r)
            changed = True
        while changed and _admit(res, live, pending, t, cfg, partial, preempt):
            pass  # an eviction may leave room for a job skipped earlier in the pass
    res.end = t
    return res


def admission_size(spec: JobSpec, reclaimable: int, *, partial: bool) -> int | None:
    """Workers a Kueue-style queue admits `spec` with when `reclaimable` workers are free or held by jobs
    it may preempt, or None if it waits. Full size first; with partial admission, Kueue's binary search
    for the smallest reduction (max_workers - min_workers at most) whose count still fits."""
    if spec.max_workers <= reclaimable:
        return spec.max_workers
    if not partial:
        return None
    lo, hi = 0, spec.max_workers - spec.min_workers + 1  # hi: "not even the minimum fits"
    while lo < hi:
        mid = (lo + hi) // 2
        if spec.max_workers - mid <= reclaimable:
            hi = mid
        else:
            lo = mid + 1
    return spec.max_workers - lo if lo <= spec.max_workers - spec.min_workers else None


def _admit(res: SimResult, live: list[_Run], pending: list[_Run], t: float, cfg: SimConfig, partial: bool,
           preempt: bool) -> bool:
    """One admission pass over the queue; True if it admitted a job."""
    pending.sort(key=lambda r: (-r.spec.priority, r.spec.arrival, r.spec.job_id))
    admitted = False
    for r in list(pending):
        free = cfg.capacity - sum(x.workers for x in live)
        victims = sorted((x for x in live if preempt and x.phys and x.spec.priority < r.spec.priority),
                         key=lambda x: (x.spec.priority, -x.started_at))
        size = admission_size(r.spec, free + sum(v.workers for v in victims), partial=partial)
        if size is None:
            continue  # BestEffortFIFO: later jobs may still fit
        chosen = []
        for v in victims:
            if free >= size:
                break
            chosen.append(v)
            free += v.workers
        for v in reversed(list(chosen)):  # minimal preemption: keep those not needed after all
            if free - v.workers >= size:
                chosen.remove(v)
                free -= v.workers
        for v in chosen:
            _evict(res, v, t, cfg)
            pending.append(v)
        pending.remove(r)
        _set(res, r, t, {"cluster": size})
        res.counts["partial admission"] += size < r.spec.max_workers
        r.busy_until, r.started_at = t + cfg.restart_s, t
        r.granted_at = t if r.granted_at is None else r.granted_at
        admitted = True
    return admitted


def _evict(res: SimResult, v: _Run, t: float, cfg: SimConfig) -> None:
    ran = max(0.0, t - v.busy_until)  # checkpoints every interval of running time since the restart
    since = ran % cfg.checkpoint_interval_s
    lost = v.workers * since
    v.done -= lost
    res.lost += lost
    res.useful_day -= v.workers * _overlap(t - since, t, cfg.day_s)
    res.counts["eviction"] += 1
    _set(res, v, t, {})
