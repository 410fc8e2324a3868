"""The capacity ledger: which workers every job holds, on which node, and what is free.

One ledger for the whole cluster, so that no coordinator plans onto another job's workers. It is built from a `ClusterSnapshot` (each node's *total* CPUs/GPUs, see
service/pool/cluster.py) minus what the service's jobs hold, minus what is used outside the service.

Jobs started outside the service (`elastron run`, `ray job submit`, anything else on the cluster) are
**counted as holders**, not refused: they never ask the service for a grant, so refusing them cannot be
enforced, but their workers occupy Ray resources all the same. `from_snapshot(in_use=...)` takes what
Ray reports in use per node (total minus available, `cluster.resources_in_use`); whatever of it the
service's holdings do not explain is held "outside the service" and is never granted. A worker that is
starting or stopping can be counted there for one poll: the error is on the safe side.

A worker is sized by its job (`WorkerShape`: CPUs and GPUs per worker), so capacity is kept in
resources per node and converted to workers of one shape where asked (`free_workers`, `grantable`).
Pure and immutable: updates return a new ledger.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from service.pool.cluster import ClusterSnapshot

_EPS = 1e-9  # as in service.pool.cluster: 2.0 / 1.0 must floor to 2


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _amount(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerShape:
    """What one worker of a job needs."""

    cpus: float = 1.0
    """CPUs per worker."""
    gpus: float = 0.0
    """GPUs per worker."""

    def __post_init__(self) -> None:
        for name in ("cpus", "gpus"):
            if not _amount(getattr(self, name)):
                raise ValueError(f"{name} per worker must be a number >= 0, got {getattr(self, name)!r}")
        if self.cpus == 0 and self.gpus == 0:
            raise ValueError("a worker must need some CPUs or GPUs (both are 0)")

    def fit(self, cpus: float, gpus: float) -> int:
        """How many workers of this shape fit in `cpus` CPUs and `gpus` GPUs."""
        return min(max(0, math.floor(have / need + _EPS)) for have, need in ((cpus, self.cpus), (gpus, self.gpus))
                   if need > 0)

    def __str__(self) -> str:
        return f"{self.cpus:g} CPU" + (f" + {self.gpus:g} GPU" if self.gpus else "")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeCapacity:
    """One alive node: its total resources and what is used on it outside the service."""

    node_id: str
    cpus: float = 0.0
    gpus: float = 0.0
    outside_cpus: float = 0.0
    """CPUs in use that no holding of the service explains (another job on the cluster)."""
    outside_gpus: float = 0.0
    usable: bool = True
    """False for a draining node (or a head kept free): its holdings stay, nothing new is granted there."""

    def __post_init__(self) -> None:
        for name in ("cpus", "gpus", "outside_cpus", "outside_gpus"):
            if not _amount(getattr(self, name)):
                raise ValueError(f"node {self.node_id}: {name} must be a number >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Holding:
    """The workers one job holds: `nodes` is ((node_id, workers), ...) sorted by node id, counts > 0."""

    job_id: str
    shape: WorkerShape = field(default_factory=WorkerShape)
    nodes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for node_id, n in self.nodes:
            if not _count(n) or n < 1:
                raise ValueError(f"job {self.job_id} holds {n!r} workers on node {node_id}; counts must be integers >= 1")
        ids = [node_id for node_id, _ in self.nodes]
        if ids != sorted(set(ids)):
            raise ValueError(f"job {self.job_id}: holding nodes must be unique and sorted, got {ids}")

    @classmethod
    def of(cls, job_id: str, shape: WorkerShape, nodes: Mapping[str, int]) -> Holding:
        """From {node_id: workers}; zero counts are dropped."""
        return cls(job_id=job_id, shape=shape, nodes=tuple(sorted((k, v) for k, v in nodes.items() if v)))

    @property
    def workers(self) -> int:
        return sum(n for _, n in self.nodes)

    def as_dict(self) -> dict[str, int]:
        return dict(self.nodes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Ledger:
    """The cluster's capacity and who holds it. `nodes` sorted by id, one holding per job."""

    nodes: tuple[NodeCapacity, ...] = ()
    holdings: tuple[Holding, ...] = ()

    def __post_init__(self) -> None:
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"ledger lists a node twice: {sorted(ids)}")
        jobs = [h.job_id for h in self.holdings]
        if len(set(jobs)) != len(jobs):
            raise ValueError(f"ledger lists a job's holding twice: {sorted(jobs)}")
        known = set(ids)
        for h in self.holdings:
            if missing := [nid for nid, _ in h.nodes if nid not in known]:
                raise ValueError(f"job {h.job_id} holds workers on node(s) {missing} that the ledger does not list")

    # -- reading ---------------------------------------------------------------------------------------
    def node(self, node_id: str) -> NodeCapacity | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def held(self, job_id: str) -> Holding | None:
        return next((h for h in self.holdings if h.job_id == job_id), None)

    def free(self, *, usable_only: bool = True) -> dict[str, tuple[float, float]]:
        """{node_id: (cpus, gpus)} that no one holds (negative where a node is over-committed)."""
        out = {}
        for n in self.nodes:
            if usable_only and not n.usable:
                continue
            cpus, gpus = n.cpus - n.outside_cpus, n.gpus - n.outside_gpus
            for h in self.holdings:
                k = h.as_dict().get(n.node_id, 0)
                cpus, gpus = cpus - k * h.shape.cpus, gpus - k * h.shape.gpus
            out[n.node_id] = (cpus, gpus)
        return out

    def free_workers(self, shape: WorkerShape) -> int:
        """Workers of `shape` that fit in the free resources of usable nodes."""
        return sum(shape.fit(c, g) for c, g in self.free().values())

    def grantable(self, job_id: str, shape: WorkerShape) -> dict[str, int]:
        """{node_id: workers} a job could run on: what it holds on usable nodes plus what fits in the free."""
        own = self.held(job_id)
        mine = own.as_dict() if own else {}
        extra = {nid: shape.fit(c, g) for nid, (c, g) in self.free().items()}
        return {nid: mine.get(nid, 0) + extra[nid] for nid in extra if mine.get(nid, 0) + extra[nid] > 0}

    def overcommitted(self) -> dict[str, tuple[float, float]]:
        """Nodes whose holdings exceed their resources (a node shrank, or outside use grew): {node: deficit}."""
        return {nid: (max(0.0, -c), max(0.0, -g)) for nid, (c, g) in self.free(usable_only=False).items()
                if c < -_EPS or g < -_EPS}

    # -- updating (pure) -------------------------------------------------------------------------------
    def with_holding(self, holding: Holding) -> Ledger:
        """This ledger with `holding` replacing the job's old one (a holding of 0 workers removes it)."""
        rest = tuple(h for h in self.holdings if h.job_id != holding.job_id)
        return replace(self, holdings=rest + ((holding,) if holding.workers else ()))

    def without(self, job_id: str) -> Ledger:
        return replace(self, holdings=tuple(h for h in self.holdings if h.job_id != job_id))

    @classmethod
    def from_snapshot(cls, snap: ClusterSnapshot, holdings: Iterable[Holding] = (), *,
                      in_use: Mapping[str, tuple[float, float]] | None = None,
                      include_head: bool = True) -> Ledger:
        """Alive nodes of `snap` with the service's `holdings`. Workers held on nodes that are gone are
        dropped (those jobs' coordinators see the loss themselves). `in_use`: {node_id: (cpus, gpus)}
        Ray reports in use; the part the holdings do not explain is counted as held outside the service."""
        alive = {n.node_id: n for n in snap.alive()}
        kept = []
        for h in holdings:
            on = {nid: k for nid, k in h.nodes if nid in alive}
            if on:
                kept.append(Holding.of(h.job_id, h.shape, on))
        nodes = []
        for nid, n in sorted(alive.items()):
            out_c = out_g = 0.0
            if in_use and nid in in_use:
                used_c, used_g = in_use[nid]
                held = [(dict(h.nodes).get(nid, 0), h.shape) for h in kept]
                out_c = max(0.0, used_c - sum(k * s.cpus for k, s in held))
                out_g = max(0.0, used_g - sum(k * s.gpus for k, s in held))
            nodes.append(NodeCapacity(node_id=nid, cpus=n.cpus, gpus=n.gpus, outside_cpus=out_c, outside_gpus=out_g,
                                      usable=not n.draining and (include_head or not n.is_head)))
        return cls(nodes=tuple(nodes), holdings=tuple(sorted(kept, key=lambda h: h.job_id)))
