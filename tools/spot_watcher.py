"""Turn a cloud's spot/preemption notice into a Ray drain of this node, so Elastron checkpoints in time.

Each major cloud posts its notice in the instance metadata service, each in its own shape:

| `--cloud` | where | notice | deadline |
| --- | --- | --- | --- |
| `ec2` | `GET /latest/meta-data/spot/instance-action` (IMDSv2 token from `PUT /latest/api/token`) | `{"action": "terminate"\\|"stop"\\|"hibernate", "time": "...Z"}`, 404 until then | the document's `time` (2 min ahead) |
| `ec2` (early) | `GET /latest/meta-data/events/recommendations/rebalance` | `{"noticeTime": "...Z"}`, 404 until then | none: elevated risk, maybe hours ahead |
| `gce` | `GET /computeMetadata/v1/instance/preempted` (`Metadata-Flavor: Google`), long-polled with `?wait_for_change=true&last_etag=...&timeout_sec=...` | `TRUE` once preemption has begun (`FALSE` before) | 30 s after the flag turns (`--gce-notice-s`) |
| `azure` | `GET /metadata/scheduledevents?api-version=2020-07-01` (`Metadata: true`) | an event with `EventType` `Preempt` (or `Terminate`) naming this VM in `Resources` | the event's `NotBefore` (>= 30 s ahead) |

Whatever the cloud, the watcher hands Ray one thing: on an interruption notice it asks the GCS to drain
its own node with reason PREEMPTION and the notice's deadline (the same call as `ray drain-node`,
`service.pool.cluster.drain_node`). The coordinator's cluster watcher reads drains from the GCS
(`get_draining_nodes`), so it takes a just-in-time checkpoint and shrinks off the node before the cloud
takes it. EC2's rebalance recommendation is an early signal: by default it is logged
(`--on-rebalance log`); `--on-rebalance drain` drains the node at once without a deadline, so the job
moves off it while nothing is in a hurry, and a later interruption notice re-drains it with its deadline.
Azure's Preempt events are not acknowledged: the VM is evicted at `NotBefore` anyway, and an
acknowledgement would only start the eviction sooner, cutting into the checkpoint's time.

    python tools/spot_watcher.py --address HEAD_IP:6379                     # EC2, on each spot worker
    python tools/spot_watcher.py --cloud gce --address HEAD_IP:6379         # GCE / GKE
    python tools/spot_watcher.py --cloud azure --address HEAD_IP:6379       # Azure / AKS
    python tools/spot_watcher.py --address HEAD_IP:6379 --once              # check once (exit 0: no notice)

deploy/cluster-launcher/aws-spot.yaml starts it on every worker; deploy/kuberay/raycluster.yaml runs it as a
sidecar of every spot worker pod. Nothing is done at import; the metadata endpoint, the drain call, the
clock and the node id are parameters, so tests fake them all.
"""

from __future__ import annotations

import argparse
import enum
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
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Protocol

logger = logging.getLogger("elastron.spot_watcher")

IMDS_URL = "http://169.254.169.254"  # EC2 and Azure
GCE_URL = "http://metadata.google.internal"
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TOKEN_TTL_S = 21600  # the longest IMDSv2 allows (6 h); refreshed on a 401 anyway
ACTIONS = ("terminate", "stop", "hibernate")
GCE_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCE_NOTICE_S = 30.0  # Compute Engine stops a preempted VM about 30 s after the flag turns
AZURE_EVENTS_PATH = "/metadata/scheduledevents"
AZURE_EVENTS_API = "2020-07-01"
AZURE_NAME_PATH = "/metadata/instance/compute/name"
AZURE_INSTANCE_API = "2021-02-01"
AZURE_INTERRUPTIONS = ("Preempt", "Terminate")  # the VM goes away (Reboot/Redeploy/Freeze: it comes back)
AZURE_FIRST_CALL_S = 120.0  # Azure enables Scheduled Events on the first call, which may take up to 2 min


class Kind(enum.Enum):
    INTERRUPTION = "interruption"
    """The instance will be taken at `Notice.time`: drain with that deadline."""
    REBALANCE = "rebalance"
    """Elevated risk of an interruption, no deadline (EC2's rebalance recommendation)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Notice:
    action: str
    """What the cloud will do: EC2's terminate/stop/hibernate, "preempt" (GCE), the Azure EventType,
    or "rebalance"."""
    time: float | None
    """Unix seconds at which the cloud will act; None for a signal without a deadline."""
    kind: Kind = Kind.INTERRUPTION
    cloud: str = "ec2"


def _utc(stamp: str, what: str) -> float:
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        raise ValueError(f"{what}: time {stamp!r} is not an ISO 8601 timestamp") from None
    if when.tzinfo is None:  # EC2 writes UTC with a trailing Z; be explicit about naive ones too
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def _json(body: bytes | str, what: str) -> object:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} is not JSON: {e}") from None


def parse_notice(body: bytes | str) -> Notice:
    """EC2's `spot/instance-action` document. Raises ValueError naming what is wrong with it."""
    doc = _json(body, "spot/instance-action")
    if not isinstance(doc, dict) or not isinstance(doc.get("action"), str) or not isinstance(doc.get("time"), str):
        raise ValueError(f"spot/instance-action needs string fields 'action' and 'time', got {doc!r}")
    if doc["action"] not in ACTIONS:
        raise ValueError(f"spot/instance-action: unknown action {doc['action']!r} (expected one of {ACTIONS})")
    return Notice(action=doc["action"], time=_utc(doc["time"], "spot/instance-action"))


def parse_rebalance(body: bytes | str) -> Notice:
    """EC2's `events/recommendations/rebalance` document ({"noticeTime": "...Z"}): a signal without a
    deadline; `noticeTime` is when it was issued, so it is checked but not kept."""
    doc = _json(body, "events/recommendations/rebalance")
    if not isinstance(doc, dict) or not isinstance(doc.get("noticeTime"), str):
        raise ValueError(f"events/recommendations/rebalance needs a string field 'noticeTime', got {doc!r}")
    _utc(doc["noticeTime"], "events/recommendations/rebalance")
    return Notice(action="rebalance", time=None, kind=Kind.REBALANCE)


def parse_scheduled_events(body: bytes | str, vm_name: str, *, now: float) -> Notice | None:
    """The first Azure Scheduled Event that takes this VM away (`AZURE_INTERRUPTIONS`, with `vm_name` in
    its `Resources`: events of an availability set or scale set reach every VM of it), or None.
    `NotBefore` is RFC 1123 ("Mon, 19 Sep 2016 18:29:47 GMT"), empty once the event has started."""
    doc = _json(body, "scheduledevents")
    if not isinstance(doc, dict) or not isinstance(doc.get("Events"), list):
        raise ValueError(f"scheduledevents needs a list field 'Events', got {doc!r}")
    for ev in doc["Events"]:
        if not isinstance(ev, dict) or ev.get("EventType") not in AZURE_INTERRUPTIONS:
            continue
        if vm_name not in (ev.get("Resources") or []):
            continue
        not_before = ev.get("NotBefore") or ""
        if not not_before:
            return Notice(action=ev["EventType"], time=now, cloud="azure")
        try:
            when = parsedate_to_datetime(not_before).timestamp()
        except (TypeError, ValueError):
            raise ValueError(f"scheduledevents: NotBefore {not_before!r} is not an RFC 1123 date") from None
        return Notice(action=ev["EventType"], time=when, cloud="azure")
    return None


class NoticeSource(Protocol):
    """One cloud's metadata client. `poll()` returns the most urgent pending notice or None; a
    `long_poll` source waits inside `poll()` for a change (up to the watcher's interval)."""

    cloud: str
    long_poll: bool

    def poll(self) -> Notice | None: ...


class Imds:
    """EC2's instance metadata service: one session token (IMDSv2), renewed when the service says it
    expired; IMDSv1 when the token call is refused. Polls the interruption notice and, unless it is
    there, the rebalance recommendation."""

    cloud = "ec2"
    long_poll = False

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

    def _get(self, path: str) -> bytes | None:
        """The item at `path`, or None while it is absent (404)."""
        for attempt in (0, 1):
            if self._token is None and not self._v1:
                self._token = self._fetch_token()
            headers = {"X-aws-ec2-metadata-token": self._token} if self._token else {}
            req = urllib.request.Request(self.base_url + path, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    return r.read()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 0:  # the session token expired: get a new one, once
                    self._token = None
                    continue
                raise
        raise RuntimeError("IMDS kept answering 401 with a fresh token")

    def instance_action(self) -> Notice | None:
        """The pending interruption notice, or None while there is none."""
        body = self._get(ACTION_PATH)
        return None if body is None else parse_notice(body)

    def rebalance(self) -> Notice | None:
        """The rebalance recommendation, or None while there is none."""
        body = self._get(REBALANCE_PATH)
        return None if body is None else parse_rebalance(body)

    def poll(self) -> Notice | None:
        return self.instance_action() or self.rebalance()


class Gce:
    """Compute Engine's metadata server: the `instance/preempted` flag, long-polled as the API intends
    (the first call reads the value and its ETag; each later call waits with `wait_for_change=true` and
    `last_etag` until the value changes or `timeout_sec` passes, then returns the current value).
    The server sends no deadline: the notice's time is when the flag was seen plus `notice_s`."""

    cloud = "gce"
    long_poll = True

    def __init__(self, base_url: str = GCE_URL, *, wait_s: float = 5.0, notice_s: float = GCE_NOTICE_S,
                 timeout_s: float = 2.0, clock: Callable[[], float] = time.time):
        self.base_url = base_url.rstrip("/")
        self.wait_s = max(1, int(wait_s))  # timeout_sec is whole seconds
        self.notice_s, self.timeout_s, self.clock = notice_s, timeout_s, clock
        self._etag: str | None = None

    def poll(self) -> Notice | None:
        url = self.base_url + GCE_PREEMPTED_PATH
        timeout = self.timeout_s
        if self._etag is not None:
            url += f"?wait_for_change=true&last_etag={self._etag}&timeout_sec={self.wait_s}"
            timeout += self.wait_s
        req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            value = r.read().decode().strip()
            self._etag = r.headers.get("ETag") or self._etag
        if value == "FALSE":
            return None
        if value != "TRUE":
            raise ValueError(f"instance/preempted: expected TRUE or FALSE, got {value!r}")
        return Notice(action="preempt", time=self.clock() + self.notice_s, cloud="gce")


class Azure:
    """Azure's Instance Metadata Service: Scheduled Events that take this VM away. The VM's own name
    (`compute/name`) is read once, to pick its events out of those of its availability or scale set."""

    cloud = "azure"
    long_poll = False

    def __init__(self, base_url: str = IMDS_URL, *, timeout_s: float = 2.0, vm_name: str | None = None,
                 first_call_s: float = AZURE_FIRST_CALL_S, clock: Callable[[], float] = time.time):
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.first_call_s, self.clock = timeout_s, first_call_s, clock
        self.vm_name = vm_name
        self._enabled = False  # the first events call succeeded

    def _get(self, path: str, query: str, timeout: float) -> bytes:
        req = urllib.request.Request(f"{self.base_url}{path}?{query}", headers={"Metadata": "true"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def poll(self) -> Notice | None:
        if self.vm_name is None:
            self.vm_name = self._get(AZURE_NAME_PATH, f"api-version={AZURE_INSTANCE_API}&format=text",
                                     self.timeout_s).decode().strip()
        body = self._get(AZURE_EVENTS_PATH, f"api-version={AZURE_EVENTS_API}",
                         self.timeout_s if self._enabled else self.first_call_s)
        self._enabled = True
        return parse_scheduled_events(body, self.vm_name, now=self.clock())


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
ON_REBALANCE = ("log", "drain")


class SpotWatcher:
    """Polls a cloud's `NoticeSource`; on an interruption notice, drains `node_id` once with the time
    left. A rebalance recommendation is logged once, or (`on_rebalance="drain"`) drains the node without
    a deadline. `check_once()` is one poll."""

    def __init__(self, *, source: NoticeSource, drain_fn: DrainFn, node_id: str | Callable[[], str],
                 interval_s: float = 5.0, margin_s: float = 0.0, on_rebalance: str = "log",
                 clock: Callable[[], float] = time.time):
        if not 0 < interval_s <= 60:
            raise ValueError(f"interval_s must be in (0, 60], got {interval_s!r}")
        if margin_s < 0:
            raise ValueError(f"margin_s must be >= 0, got {margin_s!r}")
        if on_rebalance not in ON_REBALANCE:
            raise ValueError(f"on_rebalance must be one of {ON_REBALANCE}, got {on_rebalance!r}")
        self.source, self.drain_fn, self.clock = source, drain_fn, clock
        self.interval_s, self.margin_s, self.on_rebalance = interval_s, margin_s, on_rebalance
        self._node_id = node_id
        self.drained: Notice | None = None
        """The interruption notice this node was drained for (then the watcher's work is done)."""
        self.rebalance: Notice | None = None
        """The rebalance recommendation seen (and acted on), if any."""

    @property
    def node_id(self) -> str:
        if callable(self._node_id):
            self._node_id = self._node_id()  # resolved once, when first needed
        return self._node_id

    def check_once(self) -> Notice | None:
        """Poll once. Returns the notice acted on: an interruption after draining for it (every later
        call returns it again without draining twice), a rebalance recommendation after logging or
        draining for it (once; later polls go on looking for the interruption); None while there is
        nothing new. Errors propagate (run() logs and retries)."""
        if self.drained is not None:
            return self.drained
        notice = self.source.poll()
        if notice is None:
            return None
        if notice.kind is Kind.REBALANCE:
            return self._rebalance(notice)
        left = max(0.0, notice.time - self.clock() - self.margin_s)
        when = datetime.fromtimestamp(notice.time, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.drain_fn(self.node_id, message=f"{notice.cloud} spot interruption notice: {notice.action} at {when}",
                      deadline_remaining_s=left)
        logger.warning("%s spot interruption notice (%s at %s): drained Ray node %s with %.0f s left",
                       notice.cloud, notice.action, when, self.node_id, left)
        self.drained = notice
        return notice

    def _rebalance(self, notice: Notice) -> Notice | None:
        if self.rebalance is not None:
            return None  # acted on already; keep watching for the interruption itself
        if self.on_rebalance == "drain":
            self.drain_fn(self.node_id, message=f"{notice.cloud} rebalance recommendation: elevated risk of "
                          "a spot interruption", deadline_remaining_s=None)
        logger.warning("%s rebalance recommendation (elevated interruption risk): %s", notice.cloud,
                       f"drained Ray node {self.node_id} without a deadline" if self.on_rebalance == "drain"
                       else "logged only (--on-rebalance drain moves the job off this node now)")
        self.rebalance = notice
        return notice

    def run(self, stop: threading.Event | None = None) -> int:
        """Poll until an interruption notice has been turned into a drain (returns 0) or `stop` is set
        (returns 1). A long-polling source waits inside its poll; others are polled every interval."""
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                notice = self.check_once()
                if notice is not None and notice.kind is Kind.INTERRUPTION:
                    return 0
                if self.source.long_poll:
                    continue
            except Exception as e:  # metadata hiccup, GCS briefly unreachable, node not registered yet: retry
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


CLOUDS = ("ec2", "gce", "azure")


def make_source(cloud: str, *, url: str | None, interval_s: float, gce_notice_s: float) -> NoticeSource:
    """The metadata client for `cloud`, at `url` (default: the cloud's own address)."""
    if cloud == "ec2":
        return Imds(url or IMDS_URL)
    if cloud == "gce":
        return Gce(url or GCE_URL, wait_s=interval_s, notice_s=gce_notice_s)
    if cloud == "azure":
        return Azure(url or IMDS_URL)
    raise ValueError(f"unknown cloud {cloud!r}; expected one of {CLOUDS}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spot_watcher", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cloud", choices=CLOUDS, default=os.environ.get("SPOT_WATCHER_CLOUD", "ec2"),
                    help="whose metadata service to watch (default: SPOT_WATCHER_CLOUD, else ec2)")
    ap.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                    help="GCS address host:port (default: RAY_ADDRESS, else this machine's current Ray cluster)")
    ap.add_argument("--node-id", help="Ray node id (hex) to drain (default: the alive node at --node-ip)")
    ap.add_argument("--node-ip", help="this machine's Ray node IP (default: as Ray detects it)")
    ap.add_argument("--imds-url", help=argparse.SUPPRESS)  # tests point it at a fake
    ap.add_argument("--interval-s", type=float, default=5.0,
                    help="poll interval; on GCE the long poll's timeout (AWS recommends 5 s)")
    ap.add_argument("--margin-s", type=float, default=0.0, help="announce a deadline this much before the cloud's")
    ap.add_argument("--gce-notice-s", type=float, default=GCE_NOTICE_S,
                    help="GCE: seconds from the preempted flag to the stop (30; GKE node pools may set up to 120)")
    ap.add_argument("--on-rebalance", choices=ON_REBALANCE, default="log",
                    help="EC2 rebalance recommendation: log it, or drain the node now without a deadline")
    ap.add_argument("--once", action="store_true",
                    help="check once: exit 0 without a notice, 3 after draining, 4 on a rebalance recommendation")
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

    source = make_source(args.cloud, url=args.imds_url, interval_s=args.interval_s, gce_notice_s=args.gce_notice_s)
    watcher = SpotWatcher(source=source, node_id=args.node_id or resolve_node_id,
                          drain_fn=lambda nid, **kw: drain_node(nid, address=address, **kw),
                          interval_s=args.interval_s, margin_s=args.margin_s, on_rebalance=args.on_rebalance)
    if args.once:
        notice = watcher.check_once()
        return 0 if notice is None else 4 if notice.kind is Kind.REBALANCE else 3
    logger.info("watching %s (%s) for spot interruption notices every %.1f s (GCS %s)", args.cloud,
                args.imds_url or "its metadata service", args.interval_s, address)
    return watcher.run()


if __name__ == "__main__":
    # Run as a file (`python tools/spot_watcher.py`), the repository root is not on sys.path; the
    # installed `service` package is. Inside a checkout, prefer the checkout's.
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
