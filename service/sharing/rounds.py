"""The service's side of a shared cluster: from what every job holds to what each is told.

`plan_round(snap, jobs, quotas, in_use=)` is one scheduling round, pure: it reads each job as the
service last saw it (`JobView`: its request, service.sharing.decisions.JobRequest, beside its state, the
workers its group holds and the grant it was given), builds
the one capacity ledger (service.sharing.ledger), asks the policy (service.sharing.scheduler.schedule) and returns
what to tell the coordinators (`Round.actions`). service.server.scheduling carries the actions out, a round
each sync interval, so an API restart loses nothing: every input is read again from the coordinators'
statuses.

How a job reads to the policy:
  - terminal: not scheduled, holds nothing;
  - PAUSED by the user: not scheduled; its grant is taken back (a resume asks for capacity again);
  - PAUSED by the scheduler: wants capacity back (Phase.PAUSED);
  - UNKNOWN (coordinator not found): not scheduled, but what it held last stays held;
  - anything else holding nothing: Phase.QUEUED; holding workers: Phase.RUNNING.
What a job holds is, per node, the larger of what its group runs on and what it is granted: a job
shrinking still holds its old workers until its group has shrunk, a job just granted holds its grant
before its group forms.

The policy decides on the ledger as it should be; the round only *gives* capacity that is free now.
A start, a resume or a growth that needs workers another job still holds (it is being shrunk or
paused in this very round) waits for the next round, where the same decision is made again and the
workers are free. Shrinks and pauses are sent at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from service.pool.cluster import ClusterSnapshot
from service.sharing.ledger import Holding, Ledger, WorkerShape
from service.control.commands import Grant, Pause, Resume
from service.control.events import Cause
from service.control.state import TERMINAL
from service.sharing.scheduler import Grow, JobRequest, Phase, Preempt, Queued, Quota, Schedule, Start, schedule

UNKNOWN = "UNKNOWN"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobView:
    """One job as the service last saw it: what it asks of the scheduler (its `request`, from its spec and
    owner) and its status. The request's `phase` is not read here: the policy is given the phase this
    view derives from the status (`phase`)."""

    request: JobRequest
    state: str = "PENDING"
    cause: str | None = None
    held: Mapping[str, int] = field(default_factory=dict)
    """{node_id: workers} its group runs on now."""
    grant: Mapping[str, int] | None = None
    """What the scheduler granted it last; None: never granted (launched without a scheduler)."""
    queue_position: int | None = None
    reason: str = ""
    standby_per_node: int = 0
    """Its spec's resources.standby_per_node (0 for GPU workers, which keep none)."""
    standby_cap: int | None = None
    """The standby cap it was last sent with its grant (`standby_caps`); None: none sent, or no cap."""
    size_for: Callable[[int], int | None] | None = field(default=None, compare=False)
    """The most of n workers the job can use (its planner's answer, parallel.planner.size_for); None: all.
    A worker granted beyond it would sit idle: grants are trimmed to it, and max_workers capped."""

    @property
    def job_id(self) -> str:
        return self.request.job_id

    def holding(self) -> dict[str, int]:
        grant = self.grant or {}
        return {nid: max(self.held.get(nid, 0), grant.get(nid, 0)) for nid in sorted({*self.held, *grant})
                if max(self.held.get(nid, 0), grant.get(nid, 0)) > 0}

    @property
    def phase(self) -> Phase | None:
        """Its phase for the policy; None when it is not scheduled."""
        if self.state in TERMINAL or self.state == UNKNOWN:
            return None
        if self.state == "PAUSED":
            return Phase.PAUSED if self.cause == Cause.SCHEDULER else None
        return Phase.RUNNING if self.holding() else Phase.QUEUED


# -- what the coordinators are told ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Tell:
    """What one job's coordinator is told: a grant (plan onto these workers only; {}: none, and a queued
    job its place and why), a pause (checkpoint, release the workers, wait for capacity back), or a
    resume on the grant just sent."""
    job_id: str
    command: Grant | Pause | Resume


@dataclass(frozen=True, kw_only=True, slots=True)
class Round:
    schedule: Schedule
    ledger: Ledger
    """The ledger the round decided on (what every job holds now)."""
    actions: tuple[Tell, ...]


def ledger_of(snap: ClusterSnapshot, jobs: Sequence[JobView], *,
              in_use: Mapping[str, tuple[float, float]] | None = None, include_head: bool = True) -> Ledger:
    """The cluster's capacity and what every job holds (UNKNOWN jobs included: their workers may run)."""
    holdings = [Holding.of(j.job_id, j.request.shape, j.holding()) for j in jobs
                if (j.phase is Phase.RUNNING or j.state == UNKNOWN) and j.holding()]
    return Ledger.from_snapshot(snap, holdings, in_use=in_use, include_head=include_head)


def plan_round(snap: ClusterSnapshot, jobs: Sequence[JobView], quotas: Mapping[str, Quota] | None = None, *,
               in_use: Mapping[str, tuple[float, float]] | None = None, include_head: bool = True) -> Round:
    ledger = ledger_of(snap, jobs, in_use=in_use, include_head=include_head)
    scheduled = [j for j in jobs if j.phase is not None]
    requests = [replace(j.request, max_workers=_cap(j, ledger), phase=j.phase) for j in scheduled]
    s = schedule(ledger, requests, quotas)
    free = {nid: list(v) for nid, v in ledger.free().items()}
    actions: list[Tell] = []
    by_rank = {r.job_id: i for i, r in enumerate(sorted(requests, key=lambda r: (-r.priority, r.submitted, r.job_id)))}
    ranked = sorted(scheduled, key=lambda j: by_rank[j.job_id])
    caps = standby_caps(ranked, {j.job_id: s.grant(j.job_id) for j in ranked}, quotas or {})
    for j in ranked:
        actions += _tell(j, s, free, caps[j.job_id])
    for j in jobs:  # not scheduled but still granted (paused by its user): take the grant back
        if j.phase is None and j.state == "PAUSED" and j.grant:
            actions.append(_grant(j, {}, "paused by its user: its workers go to other jobs until it is resumed"))
    # What frees workers goes first: a coordinator slow to answer (one just launched) must not hold up
    # the shrinks and pauses the jobs waiting for their workers depend on.
    held = {j.job_id: sum(j.holding().values()) for j in jobs}
    actions.sort(key=lambda a: not (isinstance(a.command, Pause) or (
        isinstance(a.command, Grant) and sum(a.command.nodes.values()) < held[a.job_id])))
    return Round(schedule=s, ledger=ledger, actions=tuple(actions))


def standby_caps(jobs: Sequence[JobView], grants: Mapping[str, Mapping[str, int]],
                 quotas: Mapping[str, Quota]) -> dict[str, int | None]:
    """{job_id: the most standby workers the job may keep}. A standby is a worker process its owner pays
    for (it reserves no CPU, but holds memory), so it counts against the owner's worker quota: per owner
    with one, what the quota leaves after the workers `grants` give all of the owner's jobs ({job_id:
    {node: workers}}), handed out in the order of `jobs`, each job up to the most its placement keeps
    (`service.pool.reserve.standby_targets`: standby_per_node on each of its nodes, and its busiest
    node's count on one node more). None for an owner without a worker quota."""
    room = {}
    for j in jobs:
        q = quotas.get(j.request.owner, Quota())
        if q.max_workers is not None:
            room[j.request.owner] = room.get(j.request.owner, q.max_workers) - sum(grants.get(j.job_id, {}).values())
    out: dict[str, int | None] = {}
    for j in jobs:
        if j.request.owner not in room:
            out[j.job_id] = None
            continue
        nodes = {nid: k for nid, k in grants.get(j.job_id, {}).items() if k > 0}
        most = j.standby_per_node * len(nodes) + max(nodes.values()) if nodes and j.standby_per_node > 0 else 0
        out[j.job_id] = max(0, min(most, room[j.request.owner]))
        room[j.request.owner] -= out[j.job_id]
    return out


def _grant(j: JobView, nodes: dict[str, int], reason: str, queue_position: int | None = None,
           standby: int | None = None) -> Tell:
    return Tell(job_id=j.job_id, command=Grant(nodes=nodes, reason=reason, queue_position=queue_position,
                                               standby=standby))


def _resume(j: JobView) -> Tell:
    return Tell(job_id=j.job_id, command=Resume(by="scheduler"))


def _tell(j: JobView, s: Schedule, free: dict[str, list[float]], standby: int | None = None) -> list[Tell]:
    """What job `j` is told this round; `free` ({node: [cpus, gpus]} free now) loses what is given.
    `standby`: the most standby workers it may keep (`standby_caps`), sent with its grant."""
    d = s.decision(j.job_id)
    want = s.grant(j.job_id)
    now = j.holding()
    if isinstance(d, Preempt):
        return [Tell(job_id=j.job_id, command=Pause(by="scheduler", reason=d.reason))]
    if isinstance(d, Queued):
        if j.grant == {} and (j.queue_position, j.reason) == (d.position, d.reason):
            return []
        return [_grant(j, {}, d.reason, d.position)]
    if j.phase is Phase.PAUSED and not want:
        return [_grant(j, {}, "paused by the scheduler")] if j.grant else []
    want = _usable(j, want, now)
    more = {nid: k - now.get(nid, 0) for nid, k in want.items() if k > now.get(nid, 0)}
    if not _fits(more, j.request.shape, free):
        if isinstance(d, (Start, Grow)) and j.phase is not Phase.RUNNING:
            why = f"{d.reason}; waiting for the workers it is given to be released by the jobs that held them"
            return [] if j.reason == why else [_grant(j, {}, why, 1)]
        want = {nid: min(k, now.get(nid, 0)) for nid, k in want.items() if min(k, now.get(nid, 0))}  # shrink parts only
        if want == dict(j.grant or {}) or not want:
            return []
    else:
        _take(more, j.request.shape, free)
    if want == dict(j.grant or {}) and standby == j.standby_cap:
        return [_resume(j)] if j.phase is Phase.PAUSED and want else []
    reason = d.reason if d is not None and not isinstance(d, Queued) else \
        f"granted {sum(want.values())} workers by the shared-cluster scheduler"
    out = [_grant(j, want, reason, standby=standby)]
    if j.phase is Phase.PAUSED:
        out.append(_resume(j))
    return out


def _cap(j: JobView, ledger: Ledger) -> int | None:
    """The job's max_workers, lowered to what it can use of the whole cluster."""
    whole = sum(j.request.shape.fit(n.cpus - n.outside_cpus, n.gpus - n.outside_gpus) for n in ledger.nodes if n.usable)
    top = whole if j.request.max_workers is None else min(j.request.max_workers, whole)
    use = j.size_for(top) if j.size_for is not None and top >= 1 else None
    return use if use is not None and use >= j.request.min_workers else j.request.max_workers


def _usable(j: JobView, want: dict[str, int], now: Mapping[str, int]) -> dict[str, int]:
    """`want` trimmed to the most workers the job can use, keeping the nodes it holds most on."""
    n = sum(want.values())
    use = j.size_for(n) if j.size_for is not None and n else None
    if use is None or use >= n or use < j.request.min_workers:
        return want
    out: dict[str, int] = {}
    for nid in sorted(want, key=lambda x: (-now.get(x, 0), -want[x], x)):
        if k := min(want[nid], use - sum(out.values())):
            out[nid] = k
    return dict(sorted(out.items()))


def _fits(more: Mapping[str, int], shape: WorkerShape, free: Mapping[str, list[float]]) -> bool:
    return all(nid in free and shape.fit(*free[nid]) >= k for nid, k in more.items())


def _take(more: Mapping[str, int], shape: WorkerShape, free: dict[str, list[float]]) -> None:
    for nid, k in more.items():
        free[nid][0] -= k * shape.cpus
        free[nid][1] -= k * shape.gpus
