"""Issue 15 item 4: tokens protect reads as well as changes; a read-only token for Prometheus; users see
and steer only their own jobs while the admin sees all; Host headers are checked; no framing; no CDN."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.deps import Settings
from tests.api.helpers import SPEC, make_app, make_launcher, stop_all

J = "/api/v1/jobs"
ADMIN, READ, ALICE, BOB = "adm1n", "r3ad", "al1ce", "b0b"


def bearer(tok: str) -> dict:
    return {"Authorization": f"Bearer {tok}"}


@pytest.fixture
def c(tmp_path):
    launcher, _ = make_launcher(nodes={})  # jobs wait for capacity: cheap
    app = make_app(tmp_path, launcher, token=ADMIN, read_token=READ, user_tokens={"alice": ALICE, "bob": BOB})
    with TestClient(app) as client:
        yield client
    stop_all(launcher)


def test_users_see_and_steer_only_their_own_jobs_and_the_admin_sees_all(c):
    a = c.post(J, json={"spec": SPEC}, headers=bearer(ALICE)).json()["id"]
    b = c.post(J, json={"spec": SPEC}, headers=bearer(BOB)).json()["id"]
    assert [j["id"] for j in c.get(J, headers=bearer(ALICE)).json()] == [a]
    assert c.get(f"{J}/{a}", headers=bearer(ALICE)).json()["owner"] == "alice"
    for method, path in [("GET", ""), ("GET", "/events"), ("GET", "/metrics"), ("GET", "/checkpoints"),
                         ("POST", "/pause"), ("POST", "/stop"), ("DELETE", "")]:
        r = c.request(method, f"{J}/{b}{path}", headers=bearer(ALICE))
        assert r.status_code == 404, (method, path, r.text)  # as if it did not exist
    assert sorted(j["id"] for j in c.get(J, headers=bearer(ADMIN)).json()) == sorted([a, b])
    assert sorted(j["id"] for j in c.get(J, headers=bearer(READ)).json()) == sorted([a, b])
    assert c.post(f"{J}/{b}/pause", headers=bearer(ADMIN)).status_code in (202, 409)


def test_the_read_only_token_reads_everything_and_changes_nothing(c):
    a = c.post(J, json={"spec": SPEC}, headers=bearer(ALICE)).json()["id"]
    assert c.get(f"{J}/{a}", headers=bearer(READ)).status_code == 200
    assert c.get("/metrics", headers=bearer(READ)).status_code == 200
    assert c.get("/metrics", headers=bearer(ALICE)).status_code == 403  # every job's data: not a user's
    assert c.post(J, json={"spec": SPEC}, headers=bearer(READ)).status_code == 403
    assert c.post(f"{J}/{a}/stop", headers=bearer(READ)).status_code == 403
    assert c.delete(f"{J}/{a}", headers=bearer(READ)).status_code == 403


def test_no_token_no_data(c):
    for path in (J, f"{J}/x", f"{J}/x/events", "/api/v1/cluster", "/metrics"):
        r = c.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        assert c.get(path, headers=bearer("nope")).status_code == 403, path


def test_responses_forbid_framing_and_docs_load_nothing_from_a_cdn(c):
    r = c.get("/")
    assert r.headers["content-security-policy"] == "frame-ancestors 'none'" and r.headers["x-frame-options"] == "DENY"
    assert c.get("/docs").status_code == 404 and c.get("/redoc").status_code == 404
    assert "cdn" not in r.text.lower() and "cdn" not in c.get("/static/app.js").text.lower()
    assert c.get("/openapi.json").status_code == 200


def test_unexpected_host_headers_are_refused(tmp_path):
    launcher, _ = make_launcher(nodes={})
    with TestClient(make_app(tmp_path, launcher, allowed_hosts=("127.0.0.1", "localhost")),
                    base_url="http://localhost") as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/healthz", headers={"host": "evil.example"}).status_code == 400  # DNS rebinding
    stop_all(launcher)


def test_tokens_come_from_the_environment_and_must_differ(monkeypatch):
    monkeypatch.setenv("ELASTRON_API_TOKEN", "a")
    monkeypatch.setenv("ELASTRON_READ_TOKEN", "r")
    monkeypatch.setenv("ELASTRON_USER_TOKENS", "alice=x, bob=y")
    s = Settings.from_env()
    assert s.auth and s.read_token == "r" and s.user_tokens == {"alice": "x", "bob": "y"}
    monkeypatch.setenv("ELASTRON_USER_TOKENS", "alice=a")
    with pytest.raises(ValueError, match="different"):
        Settings.from_env()
    monkeypatch.setenv("ELASTRON_USER_TOKENS", "alice")
    with pytest.raises(ValueError, match="NAME=TOKEN"):
        Settings.from_env()
