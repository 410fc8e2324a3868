"""MFU of the last step in the job status, the metrics rows, Prometheus and the dashboard page: the fake
group's rows carry mfu = 0.001 * step (or null, as on CPUs, where no peak is known)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.store import JobStore
from service.server.job_manager import JobManager
from tests.api.helpers import SPEC, make_app, make_launcher, stop_all, wait_for
from tests.fakes import Gate

J = "/api/v1/jobs"


def prometheus(c, job_id: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(c.get("/metrics").text)
            for s in fam.samples if s.labels.get("job") == job_id and len(s.labels) == 1}


def test_status_metrics_and_prometheus_show_the_mfu_of_the_last_step(tmp_path):
    gate = Gate(limit=5)
    launcher, _ = make_launcher(gate=gate)
    with TestClient(make_app(tmp_path, launcher)) as c:
        job_id = c.post(J, json={"spec": SPEC, "steps": 8}).json()["id"]
        j = wait_for(lambda: (x := c.get(f"{J}/{job_id}").json())["step"] == 5 and x, what="step 5")
        assert j["mfu"] == pytest.approx(0.005) and j["tokens_per_s"] == pytest.approx(1050.0)
        rows = c.get(f"{J}/{job_id}/metrics").json()
        assert [(m["step"], m["mfu"]) for m in rows] == [(s, pytest.approx(0.001 * s)) for s in range(1, 6)]
        assert prometheus(c, job_id)["elastron_job_mfu"] == pytest.approx(0.005)
        assert next(x for x in c.get(J).json() if x["id"] == job_id)["mfu"] == pytest.approx(0.005)

        gate.allow(None)
        wait_for(lambda: c.get(f"{J}/{job_id}").json()["state"] == "SUCCEEDED", what="SUCCEEDED")
        assert c.get(f"{J}/{job_id}").json()["mfu"] == pytest.approx(0.008)
        assert prometheus(c, job_id)["elastron_job_mfu"] == pytest.approx(0.008)
        doc = c.get("/openapi.json").json()["components"]["schemas"]
        assert "mfu" in doc["JobDetail"]["properties"] and "mfu" in doc["MetricRow"]["properties"]
    stop_all(launcher)


def test_mfu_is_null_where_no_peak_is_known_and_has_no_prometheus_sample(tmp_path):
    launcher, _ = make_launcher(mfu_per_step=None)
    with TestClient(make_app(tmp_path, launcher)) as c:
        job_id = c.post(J, json={"spec": SPEC, "steps": 3}).json()["id"]
        j = wait_for(lambda: (x := c.get(f"{J}/{job_id}").json())["state"] == "SUCCEEDED" and x, what="SUCCEEDED")
        assert j["step"] == 3 and "mfu" in j and j["mfu"] is None
        assert [m["mfu"] for m in c.get(f"{J}/{job_id}/metrics").json()] == [None, None, None]
        samples = prometheus(c, job_id)
        assert samples["elastron_job_step"] == 3 and "elastron_job_mfu" not in samples
    stop_all(launcher)


def test_a_job_read_from_its_run_dir_shows_the_mfu_of_its_last_step(tmp_path):
    launcher, _ = make_launcher()
    mgr = JobManager(JobStore(tmp_path / "jobs.db"), launcher, runs_root=tmp_path / "runs")
    job_id = mgr.submit(SPEC, steps=4)  # not started: nothing syncs until the coordinator is gone
    assert launcher.attach(job_id).join(20)
    launcher._runners.clear()
    mgr.sync(job_id)  # not started: no background sync
    j = mgr.get(job_id).status  # from events.jsonl and metrics.jsonl
    assert j.state == "SUCCEEDED" and j.step == 4 and j.mfu == pytest.approx(0.004)


def test_the_dashboard_shows_mfu_next_to_tokens_per_second(tmp_path):
    launcher, _ = make_launcher()
    with TestClient(make_app(tmp_path, launcher)) as c:
        page = c.get("/").text
        assert page.index('id="tps"') < page.index('id="mfu"') < page.index('id="committed"')
        assert '$("mfu").textContent = pct(j.mfu)' in c.get("/static/app.js").text
