"""tools/spot_watcher.py against a fake instance metadata service on 127.0.0.1 and a fake drain call.

The fake speaks the two IMDS calls the watcher makes: PUT /latest/api/token (IMDSv2 session token) and
GET /latest/meta-data/spot/instance-action (404 until a notice is "issued"). No real address is used.
The last test drains a real node of a `ray.cluster_utils.Cluster` and reads it back the way the
coordinator does (service.pool.cluster.ClusterWatcher).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.spot_watcher import Imds, Notice, SpotWatcher, gcs_nodes, main, parse_notice, pick_node_id

NOW = 1_800_000_000.0  # the fake clock


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeImds:
    """State of the fake endpoint; the handler reads it. `mode`: "v2" (tokens required), "v1" (the token
    call answers 405, plain GETs work), "expire" (the first token is rejected with 401 once)."""

    def __init__(self, mode: str = "v2"):
        self.mode = mode
        self.notice: str | None = None
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, token header)
        self.tokens_issued = 0
        self.expired: set[str] = set()
        self.lock = threading.Lock()

    def issue(self, action: str = "terminate", at: float = NOW + 120) -> None:
        self.notice = json.dumps({"action": action, "time": _iso(at)})


def _handler(state: FakeImds):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # keep pytest output clean
            pass

        def _send(self, code: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

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
                if self.path != "/latest/meta-data/spot/instance-action" or state.notice is None:
                    return self._send(404)
                body = state.notice
            self._send(200, body)

    return H


@pytest.fixture
def imds():
    servers = []

    def start(mode: str = "v2") -> tuple[FakeImds, str]:
        state = FakeImds(mode)
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return state, f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


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
    w = SpotWatcher(imds=Imds(url), drain_fn=drains, node_id="n1", clock=lambda: NOW)
    assert w.check_once() is None
    assert w.check_once() is None
    assert drains.calls == []
    # one token for both polls, sent with every GET
    assert [r[0] for r in state.requests] == ["PUT", "GET", "GET"]
    assert all(tok == "tok-1" for m, _, tok in state.requests if m == "GET")


def test_notice_drains_this_node_once_with_the_time_left(imds):
    state, url = imds("v2")
    drains = Drains()
    w = SpotWatcher(imds=Imds(url), drain_fn=drains, node_id=lambda: "abc123", clock=lambda: NOW)
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
    SpotWatcher(imds=Imds(url), drain_fn=drains, node_id="n", margin_s=15, clock=lambda: NOW).check_once()
    assert drains.calls[0][1]["deadline_remaining_s"] == pytest.approx(85.0)
    late = Drains()
    SpotWatcher(imds=Imds(url), drain_fn=late, node_id="n", clock=lambda: NOW + 200).check_once()
    assert late.calls[0][1]["deadline_remaining_s"] == 0.0


def test_falls_back_to_imdsv1_when_the_token_call_is_refused(imds):
    state, url = imds("v1")
    state.issue()
    drains = Drains()
    assert SpotWatcher(imds=Imds(url), drain_fn=drains, node_id="n", clock=lambda: NOW).check_once() is not None
    assert len(drains.calls) == 1
    assert ("GET", "/latest/meta-data/spot/instance-action", None) in state.requests


def test_an_expired_token_is_renewed(imds):
    state, url = imds("expire")
    state.issue()
    drains = Drains()
    assert SpotWatcher(imds=Imds(url), drain_fn=drains, node_id="n", clock=lambda: NOW).check_once() is not None
    assert state.tokens_issued == 2
    assert [tok for m, _, tok in state.requests if m == "GET"] == ["tok-1", "tok-2"]


def test_unexpected_imds_errors_propagate_from_check_once(imds):
    state, url = imds("v2")
    state.notice = "not json"
    with pytest.raises(ValueError):
        SpotWatcher(imds=Imds(url), drain_fn=Drains(), node_id="n").check_once()
    with pytest.raises(urllib.error.URLError):  # nothing listens there
        Imds("http://127.0.0.1:9", timeout_s=0.5).instance_action()


def test_run_polls_until_a_notice_and_retries_a_failed_drain(imds):
    state, url = imds("v2")
    drains = Drains(fail=2)
    w = SpotWatcher(imds=Imds(url), drain_fn=drains, node_id="n", interval_s=0.01, clock=lambda: NOW)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", w.run()), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while sum(1 for r in state.requests if r[0] == "GET") < 3:  # a few empty polls first
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
    assert SpotWatcher(imds=Imds(url), drain_fn=Drains(), node_id="n").run(stop) == 1


def test_pick_node_id_needs_exactly_one_alive_node_at_the_ip():
    rows = [("a1", "10.0.0.5", False), ("b2", "10.0.0.5", True), ("c3", "10.0.0.6", True)]
    assert pick_node_id(rows, "10.0.0.5") == "b2"
    with pytest.raises(LookupError, match="no alive Ray node at 10.0.0.7"):
        pick_node_id(rows, "10.0.0.7")
    with pytest.raises(LookupError, match="pass --node-id"):
        pick_node_id(rows + [("d4", "10.0.0.6", True)], "10.0.0.6")


def test_rejects_bad_intervals():
    with pytest.raises(ValueError, match="interval_s"):
        SpotWatcher(imds=Imds(), drain_fn=Drains(), node_id="n", interval_s=0)
    with pytest.raises(ValueError, match="margin_s"):
        SpotWatcher(imds=Imds(), drain_fn=Drains(), node_id="n", margin_s=-1)


def test_cli_once_without_a_notice_exits_0(imds, tmp_path):
    _, url = imds("v2")
    pidfile = tmp_path / "w.pid"
    assert main(["--address", "127.0.0.1:1", "--node-id", "n", "--imds-url", url, "--once",
                 "--pidfile", str(pidfile)]) == 0
    assert pidfile.read_text().strip().isdigit()


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
        w = SpotWatcher(imds=Imds(url), node_id=node_id,
                        drain_fn=lambda nid, **kw: drain_node(nid, address=c.gcs_address, **kw))
        assert w.check_once() is not None
        snap = ClusterWatcher().poll()
        assert set(snap.draining()) == {node_id}
        assert snap.draining()[node_id] == pytest.approx(at, abs=2.0)
        assert snap.usable_workers(1.0) == 0  # the head has no CPUs, the spot node is draining
    finally:
        ray.shutdown()
        c.shutdown()
