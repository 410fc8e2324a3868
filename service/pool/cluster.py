"""What the cluster offers right now: alive nodes, their CPUs/GPUs, and which are being drained.

`ClusterWatcher.poll()` reads two GCS tables and returns an immutable `ClusterSnapshot`:
  - membership and resources: `ray.nodes()` ("Alive", "Resources", "DeathReason" per node). Nothing is
    cached between polls, so a node Ray marks dead leaves usable capacity on the very next poll.
  - drain notices: `ray._private.state.state.get_draining_nodes()` -> {node_id_hex: deadline_ms}, with
    0 meaning "no deadline". It lists alive nodes that accepted a drain request (`ray drain-node`,
    autoscaler v2, KubeRay); the same call Ray Train v2's preemption watcher polls. A drained node
    that goes idle exits by itself with death reason AUTOSCALER_DRAIN_PREEMPTED (kept in NodeInfo).

Capacity is counted from each node's *total* resources, not what is free, because our own workers
occupy the free ones; this assumes the cluster (or at least these resources) is dedicated to the job.

The head node counts by default: Ray schedules actors wherever resources are advertised, and in the
local simulated cluster the head holds CPUs. A production head is usually started with num-cpus=0 (so
it adds nothing anyway); pass `include_head=False` to reserve it regardless.

The watcher has no side effects at construction; `start()` runs `poll()` in a daemon thread and
`stop()` ends it. Tests call `poll()` directly, or inject fake `nodes_fn`/`draining_fn`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_HEAD_RESOURCE = "node:__internal_head__"
_EPS = 1e-9  # resources are floats (Ray allows fractional CPUs); 2.0 / 1.0 must floor to 2, not 1


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    node_id: str
    """Hex node id."""
    alive: bool
    cpus: float = 0.0
    """Total CPUs the node advertises (0 once it is dead)."""
    gpus: float = 0.0
    """Total GPUs the node advertises."""
    draining: bool = False
    """A drain request was accepted: the node will go away; do not place new work there."""
    drain_deadline: float | None = None
    """Unix seconds by which the node will be force-killed, None when draining without a deadline."""
    is_head: bool = False
    death_reason: str | None = None
    """For a dead node, Ray's reason, e.g. "AUTOSCALER_DRAIN_PREEMPTED" or "UNEXPECTED_TERMINATION"."""

    def workers_fit(self, cpus_per_worker: float, gpus_per_worker: float) -> int:
        """How many workers of that size fit on this node's total resources."""
        fits = []
        for have, need in ((self.cpus, cpus_per_worker), (self.gpus, gpus_per_worker)):
            if need > 0:
                fits.append(math.floor(have / need + _EPS))
        return min(fits)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSnapshot:
    """The cluster at one poll. Immutable: `nodes` is a tuple sorted by node id, indexed by id for `node`."""

    time: float
    """Unix seconds when it was read."""
    nodes: tuple[NodeInfo, ...] = field(default_factory=tuple)
    _by_id: dict[str, NodeInfo] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # a group's nodes are looked up one by one (which are gone, which are suspects): one dict lookup
        # each, not a scan of the whole cluster each
        by_id: dict[str, NodeInfo] = {}
        for n in self.nodes:
            by_id.setdefault(n.node_id, n)
        object.__setattr__(self, "_by_id", by_id)

    def usable_workers(self, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0, *,
                       include_head: bool = True) -> int:
        """Sum over alive, non-draining nodes of floor(resources / per-worker need)."""
        for name, v in (("cpus_per_worker", cpus_per_worker), ("gpus_per_worker", gpus_per_worker)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if cpus_per_worker == 0 and gpus_per_worker == 0:
            raise ValueError("a worker must need some CPUs or GPUs (both per-worker needs are 0)")
        return sum(n.workers_fit(cpus_per_worker, gpus_per_worker) for n in self.usable_nodes(include_head))

    def usable_nodes(self, include_head: bool = True) -> list[NodeInfo]:
        return [n for n in self.nodes if n.alive and not n.draining and (include_head or not n.is_head)]

    def alive(self) -> list[NodeInfo]:
        return [n for n in self.nodes if n.alive]

    def draining(self) -> dict[str, float | None]:
        """{node_id: drain deadline (unix s) or None} for alive nodes being drained."""
        return {n.node_id: n.drain_deadline for n in self.nodes if n.alive and n.draining}

    def node(self, node_id: str) -> NodeInfo | None:
        return self._by_id.get(node_id)

    def membership(self) -> tuple:
        """What counts as a change: node set, liveness, drain state and resources (not the time)."""
        return tuple((n.node_id, n.alive, n.draining, n.drain_deadline, n.cpus, n.gpus) for n in self.nodes)


def _death_reason(code: object) -> str | None:
    if not code:
        return None
    try:
        from ray.core.generated.common_pb2 import NodeDeathInfo

        return NodeDeathInfo.Reason.Name(int(code))
    except (ImportError, ValueError, TypeError):
        return str(code)


def snapshot_from(nodes: list[dict], draining_ms: Mapping[str, int], now: float) -> ClusterSnapshot:
    """Build a snapshot from `ray.nodes()` rows and `get_draining_nodes()` output (pure; tested directly)."""
    infos = []
    for row in nodes:
        node_id = row["NodeID"]
        alive = bool(row.get("Alive", row.get("alive", False)))
        res = row.get("Resources") or {}
        drain = alive and node_id in draining_ms
        deadline_ms = draining_ms.get(node_id) if drain else None
        infos.append(NodeInfo(
            node_id=node_id, alive=alive,
            cpus=float(res.get("CPU", 0.0)) if alive else 0.0, gpus=float(res.get("GPU", 0.0)) if alive else 0.0,
            draining=drain, drain_deadline=deadline_ms / 1000.0 if deadline_ms else None,
            is_head=_HEAD_RESOURCE in res, death_reason=None if alive else _death_reason(row.get("DeathReason")),
        ))
    # A node can appear twice if it re-registered; the alive row wins.
    by_id: dict[str, NodeInfo] = {}
    for info in infos:
        if info.node_id not in by_id or info.alive:
            by_id[info.node_id] = info
    return ClusterSnapshot(time=now, nodes=tuple(by_id[k] for k in sorted(by_id)))


def _ray_nodes() -> list[dict]:
    import ray

    return ray.nodes()


def ray_draining() -> dict[str, int]:
    """{node_id_hex: drain deadline in ms (0: none)} of the nodes Ray is draining."""
    import ray._private.state

    return ray._private.state.state.get_draining_nodes()


def in_use_from(snap: ClusterSnapshot, available: Mapping[str, Mapping[str, float]]) -> dict[str, tuple[float, float]]:
    """{node_id: (cpus, gpus) in use} = each alive node's total minus what Ray reports available (pure).
    Ray leaves a resource out of a node's report when none of it is available, so a missing CPU or GPU
    is fully in use, and so is a node missing from the report: never offer what may be taken."""
    out = {}
    for n in snap.alive():
        avail = available.get(n.node_id, {})
        out[n.node_id] = (max(0.0, n.cpus - float(avail.get("CPU", 0.0))),
                          max(0.0, n.gpus - float(avail.get("GPU", 0.0))))
    return out


def resources_in_use(snap: ClusterSnapshot) -> dict[str, tuple[float, float]]:
    """What is in use on each alive node now, by anyone (needs `ray.init`): for service.sharing.ledger, which
    counts what its holdings do not explain as held outside the service."""
    import ray._private.state

    return in_use_from(snap, ray._private.state.state.available_resources_per_node())


Callback = Callable[[ClusterSnapshot | None, ClusterSnapshot], object]


class ClusterWatcher:
    """Polls Ray for membership and drain notices. Needs `ray.init(...)` done by the caller (unless
    fake sources are injected). `on_change(old, new)` callbacks run on the polling thread."""

    def __init__(self, *, interval_s: float = 0.5, nodes_fn: Callable[[], list[dict]] = _ray_nodes,
                 draining_fn: Callable[[], Mapping[str, int]] = ray_draining,
                 clock: Callable[[], float] = time.time, on_change: list[Callback] | None = None):
        if not isinstance(interval_s, (int, float)) or not 0 < interval_s <= 60:
            raise ValueError(f"interval_s must be in (0, 60], got {interval_s!r}")
        self.interval_s = float(interval_s)
        self._nodes_fn, self._draining_fn, self._clock = nodes_fn, draining_fn, clock
        self._callbacks: list[Callback] = list(on_change or [])
        self._lock = threading.Lock()
        self._latest: ClusterSnapshot | None = None
        self._changed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_callback(self, fn: Callback) -> None:
        self._callbacks.append(fn)

    @property
    def latest(self) -> ClusterSnapshot | None:
        with self._lock:
            return self._latest

    @property
    def changed(self) -> bool:
        """Whether the last poll saw a different membership than the one before (the first poll counts)."""
        with self._lock:
            return self._changed

    def poll(self) -> ClusterSnapshot:
        """Read the cluster once, update `latest`/`changed`, and run the callbacks on a change."""
        rows = self._nodes_fn()
        drains = self._draining_fn() or {}
        snap = snapshot_from(rows, drains, self._clock())
        with self._lock:
            old = self._latest
            self._latest = snap
            self._changed = old is None or old.membership() != snap.membership()
            changed = self._changed
        if changed:
            for fn in list(self._callbacks):
                try:
                    fn(old, snap)
                except Exception:
                    logger.warning("cluster watcher callback %r failed; it will be called again on the next "
                                   "change", fn, exc_info=True)
        return snap

    def start(self) -> None:
        """Poll every interval_s in a daemon thread until stop()."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("ClusterWatcher is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="ClusterWatcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("ClusterWatcher thread did not stop within %.1f s (a GCS call is hanging?)", timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:
                # GCS can be briefly unreachable (head restart); keep the last snapshot and retry.
                logger.warning("cluster poll failed; keeping the last snapshot and retrying in %.1f s",
                               self.interval_s, exc_info=True)
            self._stop.wait(self.interval_s)


def drain_node(node_id: str, *, message: str, deadline_remaining_s: float | None = None,
               reason: str = "DRAIN_NODE_REASON_PREEMPTION", address: str | None = None) -> None:
    """Ask GCS to drain a node, as `ray drain-node` and autoscaler v2 do (`GcsClient.drain_node`).
    For simulating preemption notices in tests and for operator tooling. Ray does not kill the node at
    the deadline; the caller (cloud, autoscaler) does. Raises RuntimeError if the drain is rejected."""
    import ray
    from ray.core.generated import autoscaler_pb2

    if address is None:
        address = ray.get_runtime_context().gcs_address
    deadline_ms = 0 if deadline_remaining_s is None else int(time.time() * 1000 + deadline_remaining_s * 1000)
    accepted, why = ray._raylet.GcsClient(address=address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value(reason), message, deadline_ms)
    if not accepted:
        raise RuntimeError(f"drain of node {node_id} was rejected: {why}")


def kill_node(cluster, node, *, timeout_s: float = 10.0) -> None:
    """Kill a node of a simulated `ray.cluster_utils.Cluster` as a machine dies: its raylet and
    everything the raylet started (its agents, its workers) in one instant, then Ray's bookkeeping of it.
    For the demo, benchmarks and tests. `Cluster.remove_node` alone kills the raylet first and waits:
    the node's workers outlive it for a moment (and may train on), and its agents publish the raylet's
    log tail to every driver as an error (a 20-line state dump), neither of which a dead machine does."""
    import contextlib

    import psutil  # a dependency of Elastron (and vendored by Ray)

    watchers, raylets = [], []
    for info in (i for infos in node.all_processes.values() for i in infos):
        with contextlib.suppress(psutil.Error):  # already gone
            r = psutil.Process(info.process.pid)
            watchers += r.children(recursive=True)
            raylets.append(r)
    doomed = watchers + raylets
    for p in doomed:
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + timeout_s  # SIGKILL is delivered at once but takes a moment to land
    while any(process_running(p) for p in doomed) and time.monotonic() < deadline:
        time.sleep(0.01)
    cluster.remove_node(node, allow_graceful=False)  # its processes are gone; Ray forgets the node


def process_running(p) -> bool:
    """Whether psutil process `p` still runs (a zombie waiting to be reaped has ended)."""
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
