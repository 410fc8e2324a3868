"""Where a job's workers go: how many on which node (`assign_nodes`, pure), and which nodes still place
work right now (`probe_nodes`: a raylet that refuses connections is dead; else a tiny placement group
per node)."""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import time
from collections import Counter
from collections.abc import Mapping

import ray
from ray.util.placement_group import placement_group, remove_placement_group

logger = logging.getLogger(__name__)


def assign_nodes(n: int, slots: dict[str, int], *, prefer: Counter | None = None, tp: int = 1) -> list[str]:
    """Node of each of `n` ranks: whole TP groups per node, nodes already hosting our workers first (so
    survivors are reused), then the roomiest. Raises ValueError when `n` ranks do not fit."""
    prefer = prefer or Counter()
    order = sorted(slots, key=lambda nid: (-min(prefer[nid], slots[nid]), -slots[nid], nid))
    out: list[str] = []
    for nid in order:
        take = min(slots[nid] // tp * tp, n - len(out))
        out += [nid] * take
        if len(out) == n:
            return out
    raise ValueError(f"{n} workers in TP groups of {tp} do not fit on nodes with slots {dict(slots)}")


def probe_nodes(node_ids: list[str], *, timeout_s: float = 2.0) -> set[str]:
    """The nodes among `node_ids` whose raylet still places work, by placing a tiny bundle on each.

    After an unplanned failure the GCS can list a killed node as alive for many seconds (until its
    health checks time out). Planning onto it would hang a placement until a start-up timeout, which is
    how Ray Train's elastic mode loses a minute. A healthy raylet places a tiny bundle in milliseconds;
    one that does not answer within `timeout_s` is left out of the next plan. One whose raylet refuses
    connections (`refusing`) is dead at once, without waiting out that timeout.

    A node Ray is draining places nothing new by design, so it is not probed: it counts as answering
    unless its raylet refuses connections (its drain deadline, and Ray's health checks, bound how long
    it can stay listed). Probed, it would look dead, and a live transfer off it, whose wait probes its
    members' nodes, would fail."""
    from ray.util import placement_group_table

    from service.pool.cluster import ray_draining

    try:
        draining = set(ray_draining()) & set(node_ids)
    except Exception:  # the GCS did not answer: probe them all, as before drains were known
        logger.debug("draining nodes unknown; probing every node", exc_info=True)
        draining = set()
    info = {n["NodeID"]: n for n in ray.nodes()}
    # a raylet that refuses connections is dead, draining or not: no need to wait out a placement there
    refused = raylets_refusing(node_ids, info=info)
    draining -= refused
    node_ids = [n for n in node_ids if n not in draining and n not in refused]
    # The bundle asks for a sliver of the node's own `node:IP` resource, not CPU: right after a failure
    # the node's CPUs can still be held by the placement groups being removed, and a CPU bundle would
    # then land elsewhere (the target is soft) and make a healthy node look dead.
    pgs = {nid: placement_group([on_node(info.get(nid)) or {"CPU": 0.001}],
                                strategy="STRICT_PACK", _soft_target_node_id=nid)
           for nid in node_ids}
    alive: set[str] = set(draining)
    deadline = time.monotonic() + timeout_s
    pending = dict(pgs)
    while pending and time.monotonic() < deadline:
        ready, _ = ray.wait([pg.ready() for pg in pending.values()], num_returns=len(pending), timeout=0.05)
        for nid, pg in list(pending.items()):
            table = placement_group_table(pg)
            if table.get("state") == "CREATED":
                if nid in (table.get("bundles_to_node_id") or {}).values():  # soft target: check where it landed
                    alive.add(nid)
                del pending[nid]
    for pg in pgs.values():
        try:
            remove_placement_group(pg)
        except Exception:
            logger.debug("probe placement group removal failed", exc_info=True)
    return alive


def on_node(node: dict | None) -> dict[str, float]:
    """A sliver of the node's own `node:IP` resource (a `ray.nodes()` row; {} if unknown), for a bundle
    that must go to that node: where IPs are unique, it waits there rather than land elsewhere."""
    ip = (node or {}).get("NodeManagerAddress")
    return {f"node:{ip}": 0.001} if ip else {}


def raylets_refusing(node_ids: list[str], *, info: dict[str, dict] | None = None) -> set[str]:
    """The nodes among `node_ids` whose raylet refuses connections (`refusing`): dead, whatever the GCS
    lists. `info`: `ray.nodes()` by node id, if already at hand."""
    info = info if info is not None else {n["NodeID"]: n for n in ray.nodes()}
    return refusing({nid: (info[nid].get("NodeManagerAddress"), info[nid].get("NodeManagerPort"))
                     for nid in node_ids if nid in info})


def refusing(addrs: dict[str, tuple[str | None, int | None]], *, timeout_s: float = 0.25) -> set[str]:
    """The keys of `addrs` whose (host, port) refuses a TCP connection. For a raylet's port that means
    its process is gone (killed, crashed, its node removed), while the GCS may list the node alive until
    its health checks time out: a placement probe there waits out its whole timeout (2 s); a refused
    connect takes well under a millisecond. A host that does not answer at all (a machine that vanished,
    a network partition) is not counted: only a timeout tells that, and the placement probe has one.
    Every address is tried at once (non-blocking connects), for at most `timeout_s` in all."""
    refused: set[str] = set()
    sel = selectors.DefaultSelector()
    try:
        for key, (host, port) in addrs.items():
            if not host or not port:
                continue
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex((host, int(port)))
            if err in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                sel.register(s, selectors.EVENT_WRITE, key)
                continue
            if err == errno.ECONNREFUSED:
                refused.add(key)
            s.close()
        deadline = time.monotonic() + timeout_s
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for k, _ in sel.select(timeout=left):
                if k.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED:
                    refused.add(k.data)
                sel.unregister(k.fileobj)
                k.fileobj.close()
    finally:
        for k in list(sel.get_map().values()):
            k.fileobj.close()
        sel.close()
    return refused


def cap_slots(slots: Mapping[str, int], grant: Mapping[str, int] | None) -> dict[str, int]:
    """The per-node slots a job may plan onto, capped by its grant ({node: workers},
    None when the job runs without a scheduler). A node outside the grant offers nothing."""
    if grant is None:
        return dict(slots)
    return {nid: min(n, grant.get(nid, 0)) for nid, n in slots.items() if min(n, grant.get(nid, 0)) > 0}
