"""tools/spot_watcher.py against fake metadata services on 127.0.0.1 and a fake drain call.

The fakes speak the calls the watcher makes, as each cloud documents them: EC2's PUT /latest/api/token
(IMDSv2 session token) and GETs of /latest/meta-data/spot/instance-action and
/latest/meta-data/events/recommendations/rebalance (404 until "issued"); GCE's
/computeMetadata/v1/instance/preempted (403 without `Metadata-Flavor: Google`, an ETag, and
`wait_for_change`/`last_etag`/`timeout_sec` long polls); Azure's /metadata/scheduledevents and
/metadata/instance/compute/name (400 without `Metadata: true` or `api-version`). No real address is used.
The last test drains a real node of a `ray.cluster_utils.Cluster` and reads it back the way the
coordinator does (service.pool.cluster.ClusterWatcher).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.spot_watcher import (Azure, Gce, Imds, Kind, Notice, SpotWatcher, gcs_nodes, main, parse_notice,
                                parse_rebalance, parse_scheduled_events, pick_node_id)

NOW = 1_800_000_000.0  # the fake clock


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeImds:
    """State of the fake endpoint; the handler reads it. `mode`: "v2" (tokens required), "v1" (the token
    call answers 405, plain GETs work), "expire" (the first token is rejected with 401 once)."""

    def __init__(self, mode: str = "v2"):
        self.mode = mode
        self.notice: str | None = None
        self.rebalance: str | None = None
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, token header)
        self.tokens_issued = 0
        self.expired: set[str] = set()
        self.lock = threading.Lock()

    def issue(self, action: str = "terminate", at: float = NOW + 120) -> None:
        self.notice = json.dumps({"action": action, "time": _iso(at)})

    def recommend(self, at: float = NOW - 5) -> None:
        self.rebalance = json.dumps({"noticeTime": _iso(at)})


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, *a):  # keep pytest output clean
        pass

    def _send(self, code: int, body: str = "", headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _handler(state: FakeImds):
    class H(_Quiet):
        def do_PUT(self):
            with state.lock:
                state.requests.append(("PUT", self.path, None))
                if self.path != "/latest/api/token":
                    return self._send(404)
                if state.mode == "v1":
                    return self._send(405)
                if "X-aws-ec2-metadata-token-ttl-seconds" not in self.headers:
                    return self._send(400)
                state.tokens_issued += 1
                token = f"tok-{state.tokens_issued}"
                if state.mode == "expire" and state.tokens_issued == 1:
                    state.expired.add(token)
            self._send(200, token)

        def do_GET(self):
            token = self.headers.get("X-aws-ec2-metadata-token")
            with state.lock:
                state.requests.append(("GET", self.path, token))
                if state.mode != "v1" and (token is None or token in state.expired):
                    return self._send(401)
                body = {"/latest/meta-data/spot/instance-action": state.notice,
                        "/latest/meta-data/events/recommendations/rebalance": state.rebalance}.get(self.path)
                if body is None:
                    return self._send(404)
            self._send(200, body)

    return H


class FakeGce:
    """Compute Engine's metadata server, as far as `instance/preempted` goes: "FALSE" until `preempt()`,
    an ETag per value, and long polls that return when the value differs from `last_etag` or after
    `timeout_sec` with the current value."""

    def __init__(self):
        self.value = "FALSE"
        self.requests: list[tuple[str, str | None]] = []  # (path with query, Metadata-Flavor header)
        self.cond = threading.Condition()

    def etag(self) -> str:
        return hashlib.sha1(self.value.encode()).hexdigest()[:16]

    def preempt(self) -> None:
        with self.cond:
            self.value = "TRUE"
            self.cond.notify_all()

    def waiting(self) -> int:
        return sum(1 for p, _ in self.requests if "wait_for_change=true" in p)


def _gce_handler(state: FakeGce):
    class H(_Quiet):
        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            q = dict(urllib.parse.parse_qsl(url.query))
            with state.cond:
                state.requests.append((self.path, self.headers.get("Metadata-Flavor")))
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "Missing Metadata-Flavor:Google header.")
            if url.path != "/computeMetadata/v1/instance/preempted":
                return self._send(404)
            with state.cond:
                if q.get("wait_for_change") == "true" and q.get("last_etag") == state.etag():
                    state.cond.wait_for(lambda: q["last_etag"] != state.etag(), timeout=float(q["timeout_sec"]))
                value, etag = state.value, state.etag()
            self._send(200, value, {"ETag": etag, "Metadata-Flavor": "Google"})

    return H


class FakeAzure:
    """Azure's IMDS, as far as Scheduled Events go: `events` is the document's Events list."""

    def __init__(self, vm_name: str = "spot-vm-3"):
        self.vm_name = vm_name
        self.events: list[dict] = []
        self.incarnation = 1
        self.requests: list[tuple[str, str | None]] = []  # (path with query, Metadata header)

    def post(self, event_type: str, resources: list[str], not_before: float | None) -> None:
        when = "" if not_before is None else format_datetime(datetime.fromtimestamp(not_before, timezone.utc),
                                                             usegmt=True)
        self.incarnation += 1
        self.events.append({"EventId": f"E{self.incarnation}", "EventStatus": "Scheduled", "EventType": event_type,
                            "ResourceType": "VirtualMachine", "Resources": resources, "NotBefore": when,
                            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1})


def _azure_handler(state: FakeAzure):
    class H(_Quiet):
        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            q = dict(urllib.parse.parse_qsl(url.query))
            state.requests.append((self.path, self.headers.get("Metadata")))
            if self.headers.get("Metadata") != "true" or "api-version" not in q:
                return self._send(400, '{"error": "Bad request. Required metadata header not specified"}')
            if url.path == "/metadata/instance/compute/name" and q.get("format") == "text":
                return self._send(200, state.vm_name)
            if url.path == "/metadata/scheduledevents":
                return self._send(200, json.dumps({"DocumentIncarnation": state.incarnation, "Events": state.events}))
            self._send(404)

    return H


def _serve(handler, servers: list) -> str:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    servers.append(srv)
    return f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def servers():
    running: list[ThreadingHTTPServer] = []
    yield running
    for srv in running:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def imds(servers):
    def start(mode: str = "v2") -> tuple[FakeImds, str]:
        state = FakeImds(mode)
        return state, _serve(_handler(state), servers)

    return start


@pytest.fixture
def gce(servers):
    state = FakeGce()
    return state, _serve(_gce_handler(state), servers)


@pytest.fixture
def azure(servers):
    state = FakeAzure()
    return state, _serve(_azure_handler(state), servers)


class Drains:
    """A fake drain call that records its arguments (and can fail the first `fail` times)."""

    def __init__(self, fail: int = 0):
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail

    def __call__(self, node_id: str, **kw) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("GCS unavailable")
        self.calls.append((node_id, kw))


def test_parse_notice_reads_action_and_utc_time():
    n = parse_notice(b'{"action": "terminate", "time": "2027-01-15T08:22:00Z"}')
    assert n == Notice(action="terminate", time=datetime(2027, 1, 15, 8, 22, tzinfo=timezone.utc).timestamp())


@pytest.mark.parametrize("body, words", [
    (b"<html>", "not JSON"),
    (b'{"action": "terminate"}', "'action' and 'time'"),
    (b'{"action": "reboot", "time": "2027-01-15T08:22:00Z"}', "unknown action 'reboot'"),
    (b'{"action": "stop", "time": "soon"}', "not an ISO 8601"),
])
def test_parse_notice_rejects_malformed_documents(body, words):
    with pytest.raises(ValueError, match=words):
        parse_notice(body)


def test_no_notice_means_no_drain_and_uses_an_imdsv2_token(imds):
    state, url = imds("v2")
    drains = Drains()
    w = SpotWatcher(source=Imds(url), drain_fn=drains, node_id="n1", clock=lambda: NOW)
    assert w.check_once() is None
    assert w.check_once() is None
    assert drains.calls == []
    # one token for both polls (each reads the notice, then the rebalance recommendation), sent with every GET
    assert [(m, p.rsplit("/", 1)[-1]) for m, p, _ in state.requests] == [
        ("PUT", "token"), ("GET", "instance-action"), ("GET", "rebalance"), ("GET", "instance-action"),
        ("GET", "rebalance")]
    assert all(tok == "tok-1" for m, _, tok in state.requests if m == "GET")


def test_notice_drains_this_node_once_with_the_time_left(imds):
    state, url = imds("v2")
    drains = Drains()
    w = SpotWatcher(source=Imds(url), drain_fn=drains, node_id=lambda: "abc123", clock=lambda: NOW)
    assert w.check_once() is None
    state.issue("terminate", at=NOW + 118)
    notice = w.check_once()
    assert notice == Notice(action="terminate", time=NOW + 118)
    assert w.check_once() == notice  # a later poll does not drain again
    assert len(drains.calls) == 1
    node_id, kw = drains.calls[0]
    assert node_id == "abc123"
    assert kw["deadline_remaining_s"] == pytest.approx(118.0)
    assert "terminate" in kw["message"] and _iso(NOW + 118) in kw["message"]


def test_margin_is_taken_off_and_a_past_deadline_becomes_zero(imds):
    state, url = imds("v2")
    state.issue("stop", at=NOW + 100)
    drains = Drains()
    SpotWatcher(source=Imds(url), drain_fn=drains, node_id="n", margin_s=15, clock=lambda: NOW).check_once()
    assert drains.calls[0][1]["deadline_remaining_s"] == pytest.approx(85.0)
    late = Drains()
    SpotWatcher(source=Imds(url), drain_fn=late, node_id="n", clock=lambda: NOW + 200).check_once()
    assert late.calls[0][1]["deadline_remaining_s"] == 0.0


def test_falls_back_to_imdsv1_when_the_token_call_is_refused(imds):
    state, url = imds("v1")
    state.issue()
    drains = Drains()
    assert SpotWatcher(source=Imds(url), drain_fn=drains, node_id="n", clock=lambda: NOW).check_once() is not None
    assert len(drains.calls) == 1
    assert ("GET", "/latest/meta-data/spot/instance-action", None) in state.requests


def test_an_expired_token_is_renewed(imds):
    state, url = imds("expire")
    state.issue()
    drains = Drains()
    assert SpotWatcher(source=Imds(url), drain_fn=drains, node_id="n", clock=lambda: NOW).check_once() is not None
    assert state.tokens_issued == 2
    assert [tok for m, _, tok in state.requests if m == "GET"] == ["tok-1", "tok-2"]


def test_unexpected_imds_errors_propagate_from_check_once(imds):
    state, url = imds("v2")
    state.notice = "not json"
    with pytest.raises(ValueError):
        SpotWatcher(source=Imds(url), drain_fn=Drains(), node_id="n").check_once()
    with pytest.raises(urllib.error.URLError):  # nothing listens there
        Imds("http://127.0.0.1:9", timeout_s=0.5).instance_action()


def test_run_polls_until_a_notice_and_retries_a_failed_drain(imds):
    state, url = imds("v2")
    drains = Drains(fail=2)
    w = SpotWatcher(source=Imds(url), drain_fn=drains, node_id="n", interval_s=0.01, clock=lambda: NOW)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", w.run()), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while sum(1 for r in state.requests if r[0] == "GET") < 6:  # a few empty polls first
        assert time.monotonic() < deadline, "the watcher is not polling"
        time.sleep(0.01)
    assert drains.calls == [] and t.is_alive()
    state.issue()
    t.join(10)
    assert result.get("rc") == 0
    assert len(drains.calls) == 1  # two failed attempts, then exactly one drain


def test_run_returns_1_when_stopped_without_a_notice(imds):
    _, url = imds("v2")
    stop = threading.Event()
    stop.set()
    assert SpotWatcher(source=Imds(url), drain_fn=Drains(), node_id="n").run(stop) == 1


def test_pick_node_id_needs_exactly_one_alive_node_at_the_ip():
    rows = [("a1", "10.0.0.5", False), ("b2", "10.0.0.5", True), ("c3", "10.0.0.6", True)]
    assert pick_node_id(rows, "10.0.0.5") == "b2"
    with pytest.raises(LookupError, match="no alive Ray node at 10.0.0.7"):
        pick_node_id(rows, "10.0.0.7")
    with pytest.raises(LookupError, match="pass --node-id"):
        pick_node_id(rows + [("d4", "10.0.0.6", True)], "10.0.0.6")


def test_rejects_bad_intervals():
    with pytest.raises(ValueError, match="interval_s"):
        SpotWatcher(source=Imds(), drain_fn=Drains(), node_id="n", interval_s=0)
    with pytest.raises(ValueError, match="margin_s"):
        SpotWatcher(source=Imds(), drain_fn=Drains(), node_id="n", margin_s=-1)


def test_cli_once_without_a_notice_exits_0(imds, tmp_path):
    _, url = imds("v2")
    pidfile = tmp_path / "w.pid"
    assert main(["--address", "127.0.0.1:1", "--node-id", "n", "--imds-url", url, "--once",
                 "--pidfile", str(pidfile)]) == 0
    assert pidfile.read_text().strip().isdigit()


# -- EC2's rebalance recommendation -------------------------------------------------------------------
def test_parse_rebalance_is_a_signal_without_a_deadline():
    assert parse_rebalance(b'{"noticeTime": "2027-01-15T08:20:00Z"}') == Notice(action="rebalance", time=None,
                                                                                kind=Kind.REBALANCE)
    with pytest.raises(ValueError, match="'noticeTime'"):
        parse_rebalance(b'{"time": "2027-01-15T08:20:00Z"}')
    with pytest.raises(ValueError, match="not an ISO 8601"):
        parse_rebalance(b'{"noticeTime": "soon"}')


def test_a_rebalance_recommendation_is_logged_and_the_interruption_still_drains(imds):
    state, url = imds("v2")
    drains = Drains()
    w = SpotWatcher(source=Imds(url), drain_fn=drains, node_id="n", clock=lambda: NOW)
    state.recommend()
    assert w.check_once() == Notice(action="rebalance", time=None, kind=Kind.REBALANCE)
    assert w.check_once() is None  # acted on once
    assert drains.calls == [] and w.drained is None
    paths = [p for m, p, _ in state.requests if m == "GET"]
    assert "/latest/meta-data/events/recommendations/rebalance" in paths
    state.issue("terminate", at=NOW + 110)
    assert w.check_once().kind is Kind.INTERRUPTION
    assert [kw["deadline_remaining_s"] for _, kw in drains.calls] == [pytest.approx(110.0)]


def test_on_rebalance_drain_moves_off_at_once_then_the_notice_sets_the_deadline(imds):
    state, url = imds("v2")
    drains = Drains()
    w = SpotWatcher(source=Imds(url), drain_fn=drains, node_id="n", on_rebalance="drain", clock=lambda: NOW)
    state.recommend()
    w.check_once()
    assert w.check_once() is None
    assert [kw["deadline_remaining_s"] for _, kw in drains.calls] == [None]
    assert "rebalance" in drains.calls[0][1]["message"]
    state.issue("terminate", at=NOW + 100)
    w.check_once()
    assert [kw["deadline_remaining_s"] for _, kw in drains.calls] == [None, pytest.approx(100.0)]


def test_the_interruption_wins_when_both_are_posted(imds):
    state, url = imds("v2")
    state.recommend()
    state.issue("stop", at=NOW + 90)
    drains = Drains()
    n = SpotWatcher(source=Imds(url), drain_fn=drains, node_id="n", clock=lambda: NOW).check_once()
    assert n.kind is Kind.INTERRUPTION and n.action == "stop"
    assert len(drains.calls) == 1


def test_cli_once_on_a_rebalance_recommendation_exits_4_without_draining(imds):
    state, url = imds("v2")
    state.recommend()
    # the address is unreachable: a drain would fail, so exit 4 proves none was attempted
    assert main(["--address", "127.0.0.1:1", "--node-id", "n", "--imds-url", url, "--once"]) == 4


# -- GCE: the preempted flag ----------------------------------------------------------------------------
def test_gce_reads_the_flag_with_its_header_then_long_polls_on_the_etag(gce):
    state, url = gce
    src = Gce(url, wait_s=1, clock=lambda: NOW)
    assert src.poll() is None
    assert src.poll() is None  # waited ~1 s on the server for a change that did not come
    (first, h1), (second, h2) = state.requests
    assert first == "/computeMetadata/v1/instance/preempted" and h1 == h2 == "Google"
    assert f"wait_for_change=true&last_etag={state.etag()}&timeout_sec=1" in second
    state.preempt()
    assert src.poll() == Notice(action="preempt", time=NOW + 30, cloud="gce")


def test_gce_preemption_reaches_a_waiting_watcher_without_waiting_out_the_poll(gce):
    """run() sits in a 20 s long poll; the flag turning must end it at once (the server answers the
    change), and the drain's deadline is the 30 s GCE gives."""
    state, url = gce
    drains = Drains()
    w = SpotWatcher(source=Gce(url, wait_s=20, clock=lambda: NOW), drain_fn=drains, node_id="g1",
                    interval_s=20, clock=lambda: NOW)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", w.run()), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while state.waiting() < 1:
        assert time.monotonic() < deadline, "the watcher is not long-polling"
        time.sleep(0.01)
    time.sleep(0.1)
    t0 = time.monotonic()
    state.preempt()
    t.join(10)
    assert result.get("rc") == 0 and time.monotonic() - t0 < 5
    assert drains.calls == [("g1", {"message": drains.calls[0][1]["message"], "deadline_remaining_s": 30.0})]
    assert drains.calls[0][1]["message"].startswith("gce spot interruption notice: preempt")


def test_gce_unexpected_values_and_a_missing_header_are_errors(gce):
    state, url = gce
    state.value = "MAYBE"
    with pytest.raises(ValueError, match="expected TRUE or FALSE"):
        Gce(url).poll()
    with pytest.raises(urllib.error.HTTPError):  # the fake answers 403 like the real server
        urllib.request.urlopen(url + "/computeMetadata/v1/instance/preempted", timeout=2)


# -- Azure: Scheduled Events -----------------------------------------------------------------------------
def _events(*evs) -> str:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(evs)})


@pytest.mark.parametrize("events, expected", [
    ([], None),
    ([{"EventType": "Reboot", "Resources": ["vm1"], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}], None),
    ([{"EventType": "Preempt", "Resources": ["vm2"], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}], None),
    ([{"EventType": "Preempt", "Resources": ["vm1"], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}],
     Notice(action="Preempt", time=1474309787.0, cloud="azure")),
    ([{"EventType": "Freeze", "Resources": ["vm1"], "NotBefore": "Mon, 19 Sep 2016 18:20:00 GMT"},
      {"EventType": "Terminate", "Resources": ["vm0", "vm1"], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}],
     Notice(action="Terminate", time=1474309787.0, cloud="azure")),
    ([{"EventType": "Preempt", "Resources": ["vm1"], "NotBefore": ""}],  # already started: no time left
     Notice(action="Preempt", time=NOW, cloud="azure")),
])
def test_parse_scheduled_events_picks_this_vms_eviction(events, expected):
    assert parse_scheduled_events(_events(*events), "vm1", now=NOW) == expected


@pytest.mark.parametrize("body, words", [
    ("[]", "'Events'"),
    ("nope", "not JSON"),
    (_events({"EventType": "Preempt", "Resources": ["vm1"], "NotBefore": "tomorrow"}), "not an RFC 1123"),
])
def test_parse_scheduled_events_rejects_malformed_documents(body, words):
    with pytest.raises(ValueError, match=words):
        parse_scheduled_events(body, "vm1", now=NOW)


def test_azure_preempt_for_this_vm_drains_with_not_before_and_others_do_not(azure):
    state, url = azure
    drains = Drains()
    w = SpotWatcher(source=Azure(url, clock=lambda: NOW), drain_fn=drains, node_id="a1", clock=lambda: NOW)
    assert w.check_once() is None
    state.post("Preempt", ["spot-vm-7"], NOW + 30)  # a neighbour in the scale set
    state.post("Reboot", ["spot-vm-3"], NOW + 600)
    assert w.check_once() is None
    state.post("Preempt", ["spot-vm-3"], NOW + 31)
    assert w.check_once() == Notice(action="Preempt", time=NOW + 31, cloud="azure")
    assert [kw["deadline_remaining_s"] for _, kw in drains.calls] == [pytest.approx(31.0)]
    # every call carried the header and an api-version; the VM's name was read once, as text
    assert all(h == "true" and "api-version=" in p for p, h in state.requests)
    names = [p for p, _ in state.requests if p.startswith("/metadata/instance/compute/name")]
    assert names == ["/metadata/instance/compute/name?api-version=2021-02-01&format=text"]
    assert sum(p.startswith("/metadata/scheduledevents?api-version=2020-07-01") for p, _ in state.requests) == 3


def test_cli_once_watches_the_cloud_it_is_told(gce, azure):
    _, gurl = gce
    _, aurl = azure
    for cloud, url in (("gce", gurl), ("azure", aurl)):
        assert main(["--cloud", cloud, "--address", "127.0.0.1:1", "--node-id", "n", "--imds-url", url,
                     "--once"]) == 0
    assert len(gce[0].requests) == 1 and len(azure[0].requests) == 2


@pytest.mark.e2e
def test_a_notice_becomes_a_drain_the_coordinator_sees(imds):
    """Real GCS: the watcher's drain shows up in ClusterWatcher's snapshot as a draining node with the
    notice's deadline, which is what makes the coordinator take its just-in-time checkpoint."""
    import ray
    from ray.cluster_utils import Cluster

    from service.pool.cluster import ClusterWatcher, drain_node

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        c.add_node(num_cpus=1, resources={"spot": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)

        @ray.remote(num_cpus=1, resources={"spot": 1})
        class Busy:  # keeps the node busy, so the drain stays pending until its deadline
            def node(self):
                return ray.get_runtime_context().get_node_id()

        busy = Busy.remote()
        node_id = ray.get(busy.node.remote(), timeout=60)
        # the lookup the CLI does by IP: here head and worker share one IP, so it must refuse to guess
        rows = gcs_nodes(c.gcs_address)
        ip = ray.util.get_node_ip_address()
        assert (node_id, ip, True) in rows
        with pytest.raises(LookupError, match="pass --node-id"):
            pick_node_id(rows, ip)
        state, url = imds("v2")
        at = time.time() + 120
        state.issue("terminate", at=at)
        w = SpotWatcher(source=Imds(url), node_id=node_id,
                        drain_fn=lambda nid, **kw: drain_node(nid, address=c.gcs_address, **kw))
        assert w.check_once() is not None
        snap = ClusterWatcher().poll()
        assert set(snap.draining()) == {node_id}
        assert snap.draining()[node_id] == pytest.approx(at, abs=2.0)
        assert snap.usable_workers(1.0) == 0  # the head has no CPUs, the spot node is draining
    finally:
        ray.shutdown()
        c.shutdown()
