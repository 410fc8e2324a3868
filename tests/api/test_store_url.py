"""The API on a store given by URL: a job's life and an API restart over a real PostgreSQL, and
`elastron serve` with a bad store URL failing in one line, before any Ray start, without the password."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.helpers import SPEC, make_app, make_launcher, stop_all, wait_for
from tests.fakes import Gate

J = "/api/v1/jobs"


def test_a_job_and_an_api_restart_over_postgresql(tmp_path, pg_url):
    gate = Gate(limit=3)
    launcher, _ = make_launcher(gate=gate)
    with TestClient(make_app(tmp_path, launcher, db=pg_url)) as c:
        job_id = c.post(J, json={"spec": SPEC, "steps": 6}).json()["id"]
        wait_for(lambda: c.get(f"{J}/{job_id}").json()["step"] == 3, what="step 3")
    gate.allow(None)
    with TestClient(make_app(tmp_path, launcher, db=pg_url)) as c:  # a new app and store on the same database
        j = wait_for(lambda: (x := c.get(f"{J}/{job_id}").json())["state"] == "SUCCEEDED" and x, what="SUCCEEDED")
        assert j["step"] == 6 and j["mfu"] == pytest.approx(0.006)
        assert [m["step"] for m in c.get(f"{J}/{job_id}/metrics").json()] == [1, 2, 3, 4, 5, 6]
        assert [e["to_state"] for e in c.get(f"{J}/{job_id}/events").json() if e["kind"] == "transition"] == [
            "STARTING", "RUNNING", "SUCCEEDED"]
        assert c.delete(f"{J}/{job_id}").status_code == 200 and c.get(J).json() == []
    stop_all(launcher)


@pytest.mark.parametrize("store,says", [
    ("mysql://u:sekrit@db/elastron", "unsupported store URL 'mysql://u:***@db/elastron'"),
    ("postgresql://u:sekrit@/elastron?host=/nonexistent-socket-dir",
     "cannot open the job store postgresql+psycopg://u:***@/elastron"),
])
def test_serve_with_a_bad_store_fails_in_one_line_before_ray(tmp_path, monkeypatch, caplog, store, says):
    import uvicorn

    import api.app as app_module
    import api.run

    monkeypatch.setenv("ELASTRON_RUNS_ROOT", str(tmp_path / "runs"))
    monkeypatch.setattr(api.run, "connect_ray", lambda *a, **k: pytest.fail("Ray was started for a bad store"))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("served with a bad store"))
    caplog.set_level("INFO", logger="elastron.api")
    assert app_module.serve(None, store=store) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith("cannot start: ") and says in errors[0], errors
    assert "\n" not in errors[0] and "sekrit" not in caplog.text
