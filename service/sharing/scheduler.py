"""Who gets which workers on a shared cluster: the scheduling policy, a pure function.

`schedule(ledger, jobs, quotas)` takes the capacity ledger (service.sharing.ledger), the jobs that want capacity
and the per-owner quotas, and returns a `Schedule`: starts, shrinks, pauses, grows and the queue, each
with a reason, plus the ledger after them. No clock, no Ray, no state: the same inputs (in any order)
give the same schedule. A job paused by its user holds nothing and wants nothing: leave it out.

How many workers each job gets is decided in two passes, so that every running job is shrunk toward its
minimum before any job is paused ("shrink first, pause last"); where they run, in a third:
  1. Minimums, in admission order: priority (high first); within a priority running jobs, then jobs
     paused by the scheduler, then queued ones; then submission time, then id. A job is kept or admitted
     when its `min_workers` fit in what the jobs before it left (and its owner's quota allows). No job
     may take what a *higher*-priority job holds now above its minimum: a job is never shrunk to admit
     or keep a lower-priority one. A queued or paused job may take what equal or lower-priority jobs hold
     above their minimums (they shrink), then the minimums of lower-priority jobs, which come later in
     this order and so are paused when nothing is left for them (the lowest first).
  2. The rest, by priority (high first): within one priority, one worker at a time to the job with the
     fewest extra workers per unit of weight ("each gets at least its minimum, the rest by weight"), up
     to its max_workers and its owner's quota. Extras never displace a minimum.
  3. Placement: every running job keeps the workers it holds, up to its new count (a shrink gives up
     the nodes where it has fewest first); the workers jobs gain go to their own nodes first, then to
     the nodes free now, then to what the shrinks gave up. A resize then only removes workers where
     they are or adds some: it moves no one, unless its nodes lost capacity (draining, used outside).

Placement is per node: a worker of a job's shape (CPUs, GPUs) must fit on one node. Passes 1 and 2
place workers too, to know that they fit; where pass 3's packing does not (workers of different shapes
can fragment the nodes), theirs stands. Workers on draining nodes are not granted again. Quotas: per
owner, at most `max_jobs` jobs holding workers and at most `max_workers` workers held, both checked on
the schedule's result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from service.sharing.ledger import Holding, Ledger, WorkerShape
from service.sharing.decisions import Grow, JobRequest, Phase, Preempt, Queued, Quota, Schedule, Shrink, Start

__all__ = ["Grow", "JobRequest", "Phase", "Preempt", "Queued", "Quota", "Schedule", "Shrink", "Start", "schedule"]

_ADMIT_RANK = {Phase.RUNNING: 0, Phase.PAUSED: 1, Phase.QUEUED: 2}
"""Within one priority: jobs running keep their place, then jobs the scheduler paused, then the queue."""


# -- placement ----------------------------------------------------------------------------------------------
class _Pool:
    """Free resources per node during one schedule() call (mutable, private)."""

    def __init__(self, free: Mapping[str, tuple[float, float]]):
        self.free = {nid: [c, g] for nid, (c, g) in sorted(free.items())}

    def copy(self) -> _Pool:
        return _Pool({nid: (c, g) for nid, (c, g) in self.free.items()})

    def fit(self, shape: WorkerShape, nid: str) -> int:
        return shape.fit(*self.free[nid])

    def count(self, shape: WorkerShape) -> int:
        return sum(self.fit(shape, nid) for nid in self.free)

    def remove(self, shape: WorkerShape, nodes: Mapping[str, int]) -> None:
        for nid, k in nodes.items():
            if nid in self.free:
                self.free[nid][0] -= k * shape.cpus
                self.free[nid][1] -= k * shape.gpus

    def keep(self, shape: WorkerShape, held: Mapping[str, int], n: int) -> dict[str, int]:
        """Up to n of the workers `held` ({node: workers}), where they still fit (a node that shrank or
        filled up outside the service keeps fewer)."""
        got = self._kept(shape, held, n)
        self.remove(shape, got)
        return got

    def take(self, shape: WorkerShape, n: int, order: list[str], held: Mapping[str, int] | None = None
             ) -> dict[str, int] | None:
        """Place n workers: first where `held` has them (as `keep`), then filling nodes in `order`, then
        the rest by id; None, taking nothing, if they do not all fit."""
        got = self._kept(shape, held or {}, n)
        for nid in order + [x for x in self.free if x not in order]:
            if sum(got.values()) >= n:
                break
            # one shape: k workers placed on a node leave exactly k fewer that fit there
            k = min(n - sum(got.values()), self.fit(shape, nid) - got.get(nid, 0))
            if k > 0:
                got[nid] = got.get(nid, 0) + k
        if sum(got.values()) < n:
            return None
        self.remove(shape, got)
        return got

    def _kept(self, shape: WorkerShape, held: Mapping[str, int], n: int) -> dict[str, int]:
        """The nodes with the most workers first, so that a shrink empties the nodes it leaves."""
        got: dict[str, int] = {}
        for nid in sorted((x for x in held if x in self.free), key=lambda x: (-held[x], x)):
            k = min(held[nid], n - sum(got.values()), self.fit(shape, nid))
            if k > 0:
                got[nid] = k
        return got


def _order(job: JobRequest, held: Mapping[str, int], free_now: Mapping[str, tuple[float, float]],
           pool: _Pool) -> list[str]:
    """Nodes to fill first: where the job is (most workers first), then the nodes free now (most room first)."""
    mine = sorted((nid for nid in held if nid in pool.free), key=lambda nid: (-held[nid], nid))
    rest = sorted((nid for nid in pool.free if nid not in held),
                  key=lambda nid: (-job.shape.fit(*free_now.get(nid, (0.0, 0.0))), -pool.fit(job.shape, nid), nid))
    return mine + rest


# -- the policy ---------------------------------------------------------------------------------------------
def schedule(ledger: Ledger, jobs: Iterable[JobRequest], quotas: Mapping[str, Quota] | None = None) -> Schedule:
    """The decisions that carry the cluster from `ledger` to the next fair allocation (module docstring)."""
    jobs = sorted(jobs, key=lambda j: (-j.priority, _ADMIT_RANK[j.phase], j.submitted, j.job_id))
    if len({j.job_id for j in jobs}) != len(jobs):
        raise ValueError(f"a job is listed twice: {sorted(j.job_id for j in jobs)}")
    quotas = dict(quotas or {})
    usable = {n.node_id for n in ledger.nodes if n.usable}
    holding = {j.job_id: ledger.held(j.job_id) or Holding(job_id=j.job_id, shape=j.shape) for j in jobs}
    held = {jid: {nid: k for nid, k in h.nodes if nid in usable} for jid, h in holding.items()}
    before = {jid: h.workers for jid, h in holding.items()}
    for j in jobs:
        if before[j.job_id] and holding[j.job_id].shape != j.shape:
            raise ValueError(f"job {j.job_id} asks for workers of {j.shape} but holds workers of "
                             f"{holding[j.job_id].shape}")
        if j.phase is not Phase.RUNNING and before[j.job_id]:
            raise ValueError(f"job {j.job_id} is {j.phase.value} but the ledger has it holding {before[j.job_id]} "
                             "workers: only a running job holds workers")
    unknown = sorted({h.job_id for h in ledger.holdings} - {j.job_id for j in jobs})
    free_now = ledger.free()
    # What the scheduled jobs hold is theirs to redistribute; other holdings (jobs not listed) stay put.
    pool = _Pool(Ledger(nodes=ledger.nodes, holdings=tuple(h for h in ledger.holdings if h.job_id in unknown)).free())
    start = pool.copy()

    alloc: dict[str, dict[str, int]] = {}
    protected: dict[str, dict[str, int]] = {}  # what a running job holds above its minimum, per node
    owner_jobs: dict[str, int] = {}
    owner_workers: dict[str, int] = {}
    why_not: dict[str, str] = {}

    # Pass 1: minimums, in admission order.
    for j in jobs:
        q = quotas.get(j.owner, Quota())
        if q.max_jobs is not None and owner_jobs.get(j.owner, 0) >= q.max_jobs:
            why_not[j.job_id] = f"owner {j.owner or '(none)'} already runs {owner_jobs.get(j.owner, 0)} of the " \
                                f"{q.max_jobs} jobs its quota allows"
            continue
        if q.max_workers is not None and owner_workers.get(j.owner, 0) + j.min_workers > q.max_workers:
            who = f"owner {j.owner or '(none)'}"
            held_now = sum(before[o.job_id] for o in jobs if o.owner == j.owner)
            why_not[j.job_id] = (
                f"needs {j.min_workers} workers but {who}'s quota allows {q.max_workers}: it cannot start "
                "until the quota grows" if j.min_workers > q.max_workers else
                f"needs {j.min_workers} workers but {who}'s jobs ahead of it keep {owner_workers.get(j.owner, 0)} "
                f"of the {q.max_workers} its quota allows (they hold {held_now} now)")
            continue
        mine = held[j.job_id]
        # What jobs of higher priority hold above their minimum is not to be taken, not even by a
        # running job whose own nodes were taken by a job before it (it is paused instead).
        view = pool.copy()
        for other in jobs:
            if other.priority > j.priority and other.job_id in protected:
                view.remove(other.shape, protected[other.job_id])
        if j.phase is Phase.RUNNING:
            got = view.take(j.shape, j.min_workers, _order(j, mine, free_now, view), held=mine)
        else:
            # Leave running jobs still to come their minimum where it is, if that is enough: then a
            # shrink moves none of their workers. Otherwise take it (they are paused, or move).
            spare = view.copy()
            for other in jobs[jobs.index(j) + 1:]:
                if other.phase is Phase.RUNNING:
                    spare.remove(other.shape, _trim(held[other.job_id], other.min_workers))
            got = spare.take(j.shape, j.min_workers, _order(j, mine, free_now, spare))
            if got is None:
                got = view.take(j.shape, j.min_workers, _order(j, mine, free_now, view))
        if got is None:
            whole = sum(j.shape.fit(n.cpus - n.outside_cpus, n.gpus - n.outside_gpus) for n in ledger.nodes if n.usable)
            why_not[j.job_id] = (f"needs {j.min_workers} workers of {j.shape}; the whole cluster fits {whole}"
                                 if j.min_workers > whole else
                                 f"needs {j.min_workers} workers of {j.shape}; {view.count(j.shape)} can be granted "
                                 f"without taking them from jobs of priority >= {j.priority}")
            continue
        pool.remove(j.shape, got)
        alloc[j.job_id] = got
        owner_jobs[j.owner] = owner_jobs.get(j.owner, 0) + 1
        owner_workers[j.owner] = owner_workers.get(j.owner, 0) + j.min_workers
        if j.phase is Phase.RUNNING:
            extra = {nid: k - got.get(nid, 0) for nid, k in mine.items() if k > got.get(nid, 0)}
            room = int(min(j.cap, before[j.job_id])) - j.min_workers
            protected[j.job_id] = _trim(extra, room)

    # Pass 2: the rest, by priority; within one priority by weight.
    quota_bound: set[str] = set()
    for prio in sorted({j.priority for j in jobs}, reverse=True):
        active = [j for j in jobs if j.priority == prio and j.job_id in alloc]
        while True:
            best = None
            for j in active:
                n = sum(alloc[j.job_id].values())
                q = quotas.get(j.owner, Quota())
                if n >= j.cap:
                    continue
                if q.max_workers is not None and owner_workers[j.owner] >= q.max_workers:
                    quota_bound.add(j.job_id)
                    continue
                key = ((n - j.min_workers) / j.weight, j.submitted, j.job_id)
                if pool.count(j.shape) and (best is None or key < best[0]):
                    best = (key, j)
            if best is None:
                break
            j = best[1]
            mine, have = held[j.job_id], alloc[j.job_id]
            back = {nid: k - have.get(nid, 0) for nid, k in mine.items() if k > have.get(nid, 0)}
            got = pool.take(j.shape, 1, _order(j, have, free_now, pool), held=back)
            alloc[j.job_id][next(iter(got))] = alloc[j.job_id].get(next(iter(got)), 0) + 1
            owner_workers[j.owner] += 1

    alloc = _place(jobs, {jid: sum(a.values()) for jid, a in alloc.items()}, held, start, free_now) or alloc
    return _explain(ledger, jobs, alloc, before, why_not, quota_bound, quotas, unknown)


def _place(jobs: list[JobRequest], counts: dict[str, int], held: dict[str, dict[str, int]], pool: _Pool,
           free_now: Mapping[str, tuple[float, float]]) -> dict[str, dict[str, int]] | None:
    """Pass 3, where: every running job keeps the workers it holds, up to its new count (a shrink keeps
    its nodes with the most workers); then, in admission order, the workers jobs gain go to their own
    nodes first, then to the nodes free now. None when that does not fit (workers of different shapes
    can fragment the nodes): then the packing of passes 1 and 2 stands."""
    out = {j.job_id: pool.keep(j.shape, held[j.job_id], counts[j.job_id]) for j in jobs if j.job_id in counts}
    for j in jobs:
        if j.job_id in counts and (n := counts[j.job_id] - sum(out[j.job_id].values())):
            got = pool.take(j.shape, n, _order(j, out[j.job_id], free_now, pool))
            if got is None:
                return None
            for nid, k in got.items():
                out[j.job_id][nid] = out[j.job_id].get(nid, 0) + k
    return out


def _trim(nodes: dict[str, int], room: int) -> dict[str, int]:
    """At most `room` workers of `nodes`, keeping the nodes with most workers."""
    out = {}
    for nid in sorted(nodes, key=lambda x: (-nodes[x], x)):
        k = min(nodes[nid], room - sum(out.values()))
        if k > 0:
            out[nid] = k
    return out


def _explain(ledger: Ledger, jobs: list[JobRequest], alloc: dict[str, dict[str, int]], before: dict[str, int],
             why_not: dict[str, str], quota_bound: set[str], quotas: Mapping[str, Quota],
             unknown: list[str]) -> Schedule:
    """Turn the allocation into decisions with reasons."""
    after = {j.job_id: sum(alloc.get(j.job_id, {}).values()) for j in jobs}
    rank = {j.job_id: i for i, j in enumerate(jobs)}
    by_id = {j.job_id: j for j in jobs}
    admitted = [j for j in jobs if after[j.job_id] and not before[j.job_id]]
    grown = [j for j in jobs if before[j.job_id] and after[j.job_id] > before[j.job_id]]

    def beneficiary(j: JobRequest, strict: bool) -> str | None:
        """The job this one gives way to: strictly higher for a pause (only an admission pauses a job)."""
        for who, verb in ((admitted, "admit"),) + ((() if strict else ((grown, "give"),))):
            for b in who:
                if b.priority > j.priority or (not strict and b.priority == j.priority and b is not j):
                    what = f"job {b.job_id} (priority {b.priority})"
                    return f"to admit {what}" if verb == "admit" else f"to give {what} its share"
        return None

    def limit(j: JobRequest) -> str | None:
        """The job's own limit, when that is what holds it back."""
        if "quota" in why_not.get(j.job_id, "") or j.job_id in quota_bound:
            q = quotas[j.owner]
            return f"owner {j.owner or '(none)'}'s quota ({q.max_workers} workers, {q.max_jobs} jobs)"
        if after[j.job_id] and after[j.job_id] >= j.cap:
            return f"max_workers={j.max_workers}"
        return None

    lost = "the cluster has less capacity (a node left, is draining, or is used outside the service)"
    grants, shrinks, pauses, grows, queued = [], [], [], [], []
    for j in jobs:
        a, b = before[j.job_id], after[j.job_id]
        nodes = tuple(sorted((nid, k) for nid, k in alloc.get(j.job_id, {}).items() if k))
        if j.phase is Phase.QUEUED and b:
            grants.append(Start(job_id=j.job_id, workers=b, nodes=nodes,
                                reason=f"admitted on {b} workers (min {j.min_workers}, priority {j.priority})"))
        elif j.phase is Phase.PAUSED and b:
            grows.append(Grow(job_id=j.job_id, before=0, after=b, nodes=nodes,
                              reason=f"resumed on {b} workers: capacity given back in priority order (priority {j.priority})"))
        elif j.phase is Phase.RUNNING and not b:
            why = (f"because of {lim}" if (lim := limit(j)) else beneficiary(j, strict=True)) or f"because {lost}"
            pauses.append(Preempt(job_id=j.job_id, before=a, reason=f"paused (checkpoint first, was {a} workers) {why}"))
        elif j.phase is Phase.RUNNING and b < a:
            why = (f"because of {lim}" if (lim := limit(j)) else beneficiary(j, strict=False)) or f"because {lost}"
            shrinks.append(Shrink(job_id=j.job_id, before=a, after=b, nodes=nodes, reason=f"shrunk {a}→{b} {why}"))
        elif j.phase is Phase.RUNNING and b > a:
            grows.append(Grow(job_id=j.job_id, before=a, after=b, nodes=nodes,
                              reason=f"grown {a}→{b}: capacity given back in priority order (priority {j.priority})"))
        elif not b:
            queued.append(j)
    positions = tuple(Queued(job_id=j.job_id, position=i + 1, reason=why_not.get(j.job_id, "waiting"))
                      for i, j in enumerate(sorted(queued, key=lambda j: rank[j.job_id])))
    holdings = [h for h in ledger.holdings if h.job_id in unknown]
    holdings += [Holding.of(jid, by_id[jid].shape, nodes) for jid, nodes in alloc.items() if sum(nodes.values())]
    out = Ledger(nodes=ledger.nodes, holdings=tuple(sorted(holdings, key=lambda h: h.job_id)))
    low_first = sorted(pauses, key=lambda p: -rank[p.job_id])
    return Schedule(grants=tuple(grants), resizes=tuple(shrinks), pauses=tuple(low_first), returns=tuple(grows),
                    queued=positions, ledger=out)
