"""Which nodes a job may plan onto: the cluster watcher's view, minus nodes a placement probe found
unresponsive ("suspects").

After an unplanned failure the GCS can list a killed node as alive for many seconds; planning onto it
would hang a placement until a start-up timeout. So the coordinator probes the nodes of a failed group
(`probe`), leaves those that do not answer out of plans for `suspect_seconds` (or until Ray confirms
them dead), and probes them again every `reprobe_interval_s` while it waits or starts (`reprobe`), so
a node that was only slow is usable again at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from service.pool.cluster import ClusterSnapshot, NodeInfo

logger = logging.getLogger(__name__)

Probe = Callable[..., set[str]]
"""probe(node_ids, timeout_s=...) -> the nodes that still place work (service.pool.placement.probe_nodes)."""


class NodeHealth:
    def __init__(self, probe: Probe | None, *, probe_timeout_s: float, suspect_seconds: float,
                 reprobe_interval_s: float, include_head: bool = True, clock: Callable[[], float] = time.time,
                 refused: Callable[[list[str]], set[str]] | None = None):
        self.probe_fn = probe
        """None: trust the watcher (no probing)."""
        self.refused_fn = refused
        """refused(node_ids) -> those whose raylet refuses connections (service.pool.placement.raylets_refusing);
        None: no sweep."""
        self.probe_timeout_s, self.suspect_seconds = probe_timeout_s, suspect_seconds
        self.reprobe_interval_s, self.include_head, self.clock = reprobe_interval_s, include_head, clock
        self.suspects: dict[str, float] = {}
        """Node id -> when a probe found it unresponsive."""
        self._last_reprobe = 0.0

    def probe(self, nodes: list[str]) -> set[str]:
        """Mark the nodes among `nodes` that no longer place work as suspects; return them."""
        if not nodes or self.probe_fn is None:
            return set()
        dead = set(nodes) - self.probe_fn(nodes, timeout_s=self.probe_timeout_s)
        now = self._last_reprobe = self.clock()
        for nid in dead:
            self.suspects[nid] = now
        return dead

    def suspect(self, nodes: Iterable[str]) -> None:
        """Mark `nodes` as suspects: a probe elsewhere (a worker group's, while it waited) found them
        unresponsive."""
        now = self.clock()
        for nid in nodes:
            self.suspects[nid] = now

    def sweep(self, snap: ClusterSnapshot | None) -> set[str]:
        """Mark as suspects the nodes the watcher lists alive whose raylet refuses connections: dead,
        though the GCS may list them for seconds more, and free of our workers, so no probe of a failed
        group's nodes covers them (a coordinator restarted after a node died has no suspects of its own,
        and planned onto that node). Milliseconds; returns them."""
        if self.refused_fn is None or snap is None:
            return set()
        try:
            dead = self.refused_fn([n.node_id for n in snap.alive() if n.node_id not in self.suspects])
        except Exception:  # the GCS did not answer: the probes judge as before
            logger.debug("raylet sweep failed", exc_info=True)
            return set()
        self.suspect(dead)
        return dead

    def reprobe(self, snap: ClusterSnapshot) -> set[str]:
        """Probe the suspects again (at most every `reprobe_interval_s`); return those that answer now
        (they are no longer suspects)."""
        now = self.clock()
        self.usable_nodes(snap)  # drops suspects that expired or that Ray confirmed dead
        if not self.suspects or self.probe_fn is None or now - self._last_reprobe < self.reprobe_interval_s:
            return set()
        self._last_reprobe = now
        back = self.probe_fn(sorted(self.suspects), timeout_s=self.probe_timeout_s)
        for nid in back:
            del self.suspects[nid]
        return set(back)

    def slots(self, snap: ClusterSnapshot, cpus_per_worker: float, gpus_per_worker: float) -> dict[str, int]:
        """Workers that fit on each usable node."""
        return {n.node_id: n.workers_fit(cpus_per_worker, gpus_per_worker) for n in self.usable_nodes(snap)}

    @staticmethod
    def any_gone(snap: ClusterSnapshot | None, nodes: Iterable[str]) -> bool:
        """Whether the watcher lists any of `nodes` as dead or not at all (None: nothing known yet)."""
        return bool(NodeHealth.gone(snap, nodes))

    @staticmethod
    def gone(snap: ClusterSnapshot | None, nodes: Iterable[str]) -> set[str]:
        """The nodes among `nodes` the watcher lists as dead or not at all (none while nothing is known):
        nothing there answers, so nobody should wait for it or probe it."""
        if snap is None:
            return set()
        return {nid for nid in nodes if (n := snap.node(nid)) is None or not n.alive}

    def usable_nodes(self, snap: ClusterSnapshot) -> list[NodeInfo]:
        """Alive, not draining, not a suspect (and not the head unless include_head)."""
        now = self.clock()
        self.suspects = {n: t for n, t in self.suspects.items()
                         if now - t < self.suspect_seconds and (snap.node(n) is not None and snap.node(n).alive)}
        return [n for n in snap.usable_nodes(self.include_head) if n.node_id not in self.suspects]
