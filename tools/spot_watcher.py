"""Turn an EC2 spot interruption notice into a Ray drain of this node, so Elastron checkpoints in time.

EC2 announces a spot interruption two minutes ahead, as the instance metadata item
`spot/instance-action` ({"action": "terminate"|"stop"|"hibernate", "time": "...Z"}; 404 until then).
On Kubernetes the AWS Node Termination Handler turns it into a pod eviction, and `ray start --block`
turns the SIGTERM into a drain. On a Ray cluster-launcher VM nothing reads it: Ray learns of the
interruption only when the instance dies. This daemon closes that gap. It polls the metadata service
(IMDSv2 with a session token, IMDSv1 where the token call is refused) every `--interval-s` seconds and,
on a notice, asks the GCS to drain its own node with reason PREEMPTION and the notice's deadline (the
same call as `ray drain-node`, `service.pool.cluster.drain_node`). The coordinator's cluster watcher reads
drains from the GCS (`get_draining_nodes`), so it takes a just-in-time checkpoint and shrinks off the
node before EC2 takes it.

    python tools/spot_watcher.py --address HEAD_IP:6379                 # on each spot worker, after `ray start`
    python tools/spot_watcher.py --address HEAD_IP:6379 --once           # check once (exit 0: no notice)

deploy/cluster-launcher/aws-spot.yaml starts it on every worker. Nothing is done at import; the
metadata endpoint, the drain call, the clock and the node id are parameters, so tests fake them all.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

logger = logging.getLogger("elastron.spot_watcher")

IMDS_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_S = 21600  # the longest IMDSv2 allows (6 h); refreshed on a 401 anyway
ACTIONS = ("terminate", "stop", "hibernate")


@dataclass(frozen=True, kw_only=True, slots=True)
class Notice:
    action: str
    """What EC2 will do: terminate, stop or hibernate (hibernation starts at once, without the 2 min)."""
    time: float
    """Unix seconds at which EC2 will act (the notice's approximate UTC time)."""


def parse_notice(body: bytes | str) -> Notice:
    """The `spot/instance-action` document. Raises ValueError naming what is wrong with it."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"spot/instance-action is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("action"), str) or not isinstance(doc.get("time"), str):
        raise ValueError(f"spot/instance-action needs string fields 'action' and 'time', got {doc!r}")
    if doc["action"] not in ACTIONS:
        raise ValueError(f"spot/instance-action: unknown action {doc['action']!r} (expected one of {ACTIONS})")
    try:
        when = datetime.fromisoformat(doc["time"])
    except ValueError:
        raise ValueError(f"spot/instance-action: time {doc['time']!r} is not an ISO 8601 timestamp") from None
    if when.tzinfo is None:  # EC2 writes UTC with a trailing Z; be explicit about naive ones too
        when = when.replace(tzinfo=timezone.utc)
    return Notice(action=doc["action"], time=when.timestamp())


class Imds:
    """A small IMDS client: one session token (IMDSv2), renewed when the service says it expired."""

    def __init__(self, base_url: str = IMDS_URL, *, timeout_s: float = 2.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._v1 = False  # the token call was refused: IMDSv1 only

    def _fetch_token(self) -> str | None:
        req = urllib.request.Request(self.base_url + TOKEN_PATH, method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.read().decode().strip()
        except urllib.error.HTTPError as e:
            if e.code in (403, 404, 405):  # IMDSv2 disabled or not offered: fall back to plain GETs
                logger.warning("IMDS token request answered %d; using IMDSv1", e.code)
                self._v1 = True
                return None
            raise

    def instance_action(self) -> Notice | None:
        """The pending interruption notice, or None while there is none (404)."""
        for attempt in (0, 1):
            if self._token is None and not self._v1:
                self._token = self._fetch_token()
            headers = {"X-aws-ec2-metadata-token": self._token} if self._token else {}
            req = urllib.request.Request(self.base_url + ACTION_PATH, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    return parse_notice(r.read())
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 0:  # the session token expired: get a new one, once
                    self._token = None
                    continue
                raise
        raise RuntimeError("IMDS kept answering 401 with a fresh token")


def pick_node_id(nodes: Iterable[tuple[str, str, bool]], ip: str) -> str:
    """The id of the one alive Ray node at `ip`, from (node_id_hex, node_ip, alive) rows. Raises
    LookupError when there is none (Ray not started here yet) or several (ambiguous: pass --node-id)."""
    hits = sorted({nid for nid, nip, alive in nodes if alive and nip == ip})
    if not hits:
        raise LookupError(f"no alive Ray node at {ip} (has `ray start` run on this machine?)")
    if len(hits) > 1:
        raise LookupError(f"{len(hits)} alive Ray nodes at {ip}: {hits}; pass --node-id")
    return hits[0]


def gcs_nodes(gcs_address: str) -> list[tuple[str, str, bool]]:
    """(node_id_hex, node_ip, alive) for every node the GCS knows."""
    from ray._raylet import GcsClient
    from ray.core.generated import gcs_pb2

    alive = gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE")
    infos = GcsClient(address=gcs_address).get_all_node_info(timeout=10)
    return [(info.node_id.hex(), info.node_manager_address, info.state == alive) for info in infos.values()]


DrainFn = Callable[..., object]


class SpotWatcher:
    """Polls for a notice; on one, drains `node_id` once with the time left. `check_once()` is one poll."""

    def __init__(self, *, imds: Imds, drain_fn: DrainFn, node_id: str | Callable[[], str],
                 interval_s: float = 5.0, margin_s: float = 0.0, clock: Callable[[], float] = time.time):
        if not 0 < interval_s <= 60:
            raise ValueError(f"interval_s must be in (0, 60], got {interval_s!r}")
        if margin_s < 0:
            raise ValueError(f"margin_s must be >= 0, got {margin_s!r}")
        self.imds, self.drain_fn, self.clock = imds, drain_fn, clock
        self.interval_s, self.margin_s = interval_s, margin_s
        self._node_id = node_id
        self.drained: Notice | None = None

    @property
    def node_id(self) -> str:
        if callable(self._node_id):
            self._node_id = self._node_id()  # resolved once, when first needed
        return self._node_id

    def check_once(self) -> Notice | None:
        """Poll once. Returns the notice after draining for it (every later call returns it again without
        draining twice); None while there is no notice. Errors propagate (run() logs and retries)."""
        if self.drained is not None:
            return self.drained
        notice = self.imds.instance_action()
        if notice is None:
            return None
        left = max(0.0, notice.time - self.clock() - self.margin_s)
        when = datetime.fromtimestamp(notice.time, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.drain_fn(self.node_id, message=f"EC2 spot interruption notice: {notice.action} at {when}",
                      deadline_remaining_s=left)
        logger.warning("spot interruption notice (%s at %s): drained Ray node %s with %.0f s left",
                       notice.action, when, self.node_id, left)
        self.drained = notice
        return notice

    def run(self, stop: threading.Event | None = None) -> int:
        """Poll until a notice has been turned into a drain (returns 0) or `stop` is set (returns 1)."""
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                if self.check_once() is not None:
                    return 0
            except Exception as e:  # IMDS hiccup, GCS briefly unreachable, node not registered yet: retry
                expected = isinstance(e, (OSError, LookupError))  # no traceback every 5 s for those
                logger.warning("spot watcher: %s: %s; retrying in %.1f s", type(e).__name__, e, self.interval_s,
                               exc_info=not expected)
            stop.wait(self.interval_s)
        return 1


def _already_running(pidfile: Path) -> bool:
    """Whether the pid in `pidfile` is another live spot watcher (a re-run of the start commands)."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return pid != os.getpid() and b"spot_watcher" in cmdline


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spot_watcher", description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                    help="GCS address host:port (default: RAY_ADDRESS, else this machine's current Ray cluster)")
    ap.add_argument("--node-id", help="Ray node id (hex) to drain (default: the alive node at --node-ip)")
    ap.add_argument("--node-ip", help="this machine's Ray node IP (default: as Ray detects it)")
    ap.add_argument("--imds-url", default=IMDS_URL, help=argparse.SUPPRESS)  # tests point it at a fake
    ap.add_argument("--interval-s", type=float, default=5.0, help="poll interval (AWS recommends 5 s)")
    ap.add_argument("--margin-s", type=float, default=0.0, help="announce a deadline this much before EC2's")
    ap.add_argument("--once", action="store_true", help="check once: exit 0 without a notice, 3 after draining")
    ap.add_argument("--pidfile", help="exit at once if the watcher recorded here is still running")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.pidfile:
        pidfile = Path(args.pidfile)
        if _already_running(pidfile):
            logger.info("a spot watcher is already running (%s); exiting", pidfile)
            return 0
        pidfile.write_text(f"{os.getpid()}\n")

    address = args.address
    if not address:
        from ray._private.services import canonicalize_bootstrap_address

        try:  # /tmp/ray/ray_current_cluster, written by `ray start` on this machine
            address = canonicalize_bootstrap_address("auto")
        except ConnectionError:
            address = None
    if not address:
        print("spot_watcher: error: no Ray cluster address (pass --address HEAD_IP:6379)", file=sys.stderr)
        return 2
    from service.pool.cluster import drain_node

    def resolve_node_id() -> str:
        from ray._private.services import get_node_ip_address

        return pick_node_id(gcs_nodes(address), args.node_ip or get_node_ip_address())

    watcher = SpotWatcher(imds=Imds(args.imds_url), node_id=args.node_id or resolve_node_id,
                          drain_fn=lambda nid, **kw: drain_node(nid, address=address, **kw),
                          interval_s=args.interval_s, margin_s=args.margin_s)
    if args.once:
        return 3 if watcher.check_once() is not None else 0
    logger.info("watching %s for spot interruption notices every %.1f s (GCS %s)", args.imds_url,
                args.interval_s, address)
    return watcher.run()


if __name__ == "__main__":
    # Run as a file (`python tools/spot_watcher.py`), the repository root is not on sys.path; the
    # installed `service` package is. Inside a checkout, prefer the checkout's.
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
