"""The job API over an in-process coordinator (fake worker group and cluster): endpoints, errors, auth."""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.api.helpers import SPEC, make_app, make_launcher, stop_all, wait_for
from tests.fakes import Gate

J = "/api/v1/jobs"


@pytest.fixture
def env(tmp_path):
    gate = Gate(limit=None)
    launcher, cluster = make_launcher(gate=gate)
    with TestClient(make_app(tmp_path, launcher)) as c:
        c.gate, c.launcher, c.cluster, c.tmp = gate, launcher, cluster, tmp_path
        yield c
    stop_all(launcher)


def spec(**sections) -> dict:
    s = copy.deepcopy(SPEC)
    for k, v in sections.items():
        s[k] = {**s.get(k, {}), **v} if isinstance(v, dict) else v
    return s


def submit(c, body=None, **kw) -> str:
    r = c.post(J, json={"spec": SPEC, **kw} if body is None else body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def state_is(c, job_id, *states):
    j = c.get(f"{J}/{job_id}").json()
    return j if j["state"] in states else None


def test_a_job_runs_to_success_and_reports_state_metrics_events_checkpoints(env):
    r = env.post(J, json={"spec": SPEC})
    assert r.status_code == 201 and r.headers["location"] == f"{J}/{r.json()['id']}"
    job_id = r.json()["id"]
    run_dir = r.json()["run_dir"]
    assert run_dir.startswith(str(env.tmp / "runs")) and job_id in run_dir
    j = wait_for(lambda: state_is(env, job_id, "SUCCEEDED"), what="SUCCEEDED")
    assert j["step"] == j["total_steps"] == 20 and j["committed_step"] == 20
    # parallel.dp_mode auto on CPU without a memory budget: replicas (DDP), not FSDP
    assert j["layout"] == {"dp_replicate": 4, "dp_shard": 1, "tp": 1, "pp": 1}
    assert j["degrees"] == {"dp": 4, "tp": 1, "pp": 1}
    assert j["loss"] == pytest.approx(10.0 / 20) and j["tokens_per_s"] == pytest.approx(1200.0)
    assert j["reconfigurations"] == {"planned": 1} and j["steps_lost"] == 0 and j["spec"] == SPEC
    assert [x["id"] for x in env.get(J).json()] == [job_id]

    rows = env.get(f"{J}/{job_id}/metrics").json()
    assert [m["step"] for m in rows] == list(range(1, 21))
    assert [m["step"] for m in env.get(f"{J}/{job_id}/metrics", params={"since": 15}).json()] == [16, 17, 18, 19, 20]
    events = env.get(f"{J}/{job_id}/events").json()
    assert [e["to_state"] for e in events if e["kind"] == "transition"] == ["STARTING", "RUNNING", "SUCCEEDED"]
    assert env.get(f"{J}/{job_id}/events", params={"since": len(events) - 1}).json() == events[-1:]

    ck = env.tmp / "runs" / os.path.basename(run_dir) / "checkpoints"
    (ck / "step-00000010").mkdir(parents=True)
    (ck / "step-00000010" / "manifest.json").write_text("{}")
    (ck / "step-00000020").mkdir()
    (ck / "latest").write_text("step-00000010\n")
    out = env.get(f"{J}/{job_id}/checkpoints").json()
    assert out["latest"] == "step-00000010"
    assert [(e["name"], e["step"], e["committed"]) for e in out["entries"]] == [
        ("step-00000010", 10, True), ("step-00000020", 20, False)]


INVALID = [
    ({"spec": {**SPEC, "bogus": 1}}, ["body", "spec", "bogus"]),
    ({"spec": spec(train={"bogus": 1})}, ["body", "spec", "train", "bogus"]),
    ({"spec": spec(train={"steps": "ten"})}, ["body", "spec", "train", "steps"]),
    ({"spec": spec(train={"steps": 0})}, ["body", "spec", "train", "steps"]),
    ({"spec": spec(parallel={"tp": 3})}, ["body", "spec", "parallel", "tp"]),
    ({"spec": spec(parallel={"layout": "dp=1,tp=3,pp=1"})}, ["body", "spec", "parallel", "layout"]),
    ({"spec": spec(parallel={"min_workers": 3, "max_workers": 2})}, ["body", "spec", "parallel", "min_workers"]),
    ({"spec": spec(model={"preset": "giant"})}, ["body", "spec", "model", "preset"]),
    ({"spec": spec(data={"source": "corpus", "path": "/nonexistent/corpus"})}, ["body", "spec", "data", "path"]),
    ({"spec": spec(data={"source": "tokens", "path": "/x" * 3000})}, ["body", "spec", "data", "path"]),
    ({"spec": SPEC, "steps": 0}, ["body", "steps"]),
    ({"spec": SPEC, "steps": -5}, ["body", "steps"]),
    ({"spec": SPEC, "workers": 0}, ["body", "workers"]),
    ({"spec": SPEC, "extra": 1}, ["body", "extra"]),
    ({"spec": SPEC, "run_dir": "../escape"}, ["body", "run_dir"]),
    ({"spec": SPEC, "run_dir": "a/../../escape"}, ["body", "run_dir"]),
    ({"spec": SPEC, "run_dir": "/etc"}, ["body", "run_dir"]),
    ({"spec": spec(checkpoint={"dir": "/tmp/elsewhere"})}, ["body", "spec", "checkpoint", "dir"]),
    ({"spec": spec(checkpoint={"dir": "relative/ckpt"})}, ["body", "spec", "checkpoint", "dir"]),
    ({"steps": 5}, ["body", "spec"]),
]


@pytest.mark.parametrize("body,loc", INVALID, ids=[str(i) for i in range(len(INVALID))])
def test_invalid_requests_are_422_naming_the_field(env, body, loc):
    r = env.post(J, json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, list) and detail[0]["loc"] == loc and detail[0]["msg"], detail
    assert env.get(J).json() == []  # nothing was recorded


def test_config_errors_carry_the_config_message(env):
    r = env.post(J, json={"spec": spec(parallel={"tp": 3})})
    assert "tp=3 does not divide n_heads=4" in r.json()["detail"][0]["msg"]
    r = env.post(J, json={"spec": spec(model={"preset": "giant"})})
    assert "unknown model preset 'giant'" in r.json()["detail"][0]["msg"]


def test_run_dir_inside_the_root_is_accepted_and_symlinks_out_are_not(env):
    root = env.tmp / "runs"
    job_id = submit(env, run_dir="team/exp1", steps=2)
    assert env.get(f"{J}/{job_id}").json()["run_dir"] == str((root / "team" / "exp1").resolve())
    outside = env.tmp / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    r = env.post(J, json={"spec": SPEC, "run_dir": "link/x"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "run_dir"]
    ok = env.post(J, json={"spec": spec(checkpoint={"dir": str(root / "ck")}), "steps": 2})
    assert ok.status_code == 201, ok.text


def test_a_run_dir_in_use_by_an_active_job_is_409(env):
    env.gate.allow(0)
    submit(env, run_dir="shared")
    r = env.post(J, json={"spec": SPEC, "run_dir": "shared"})
    assert r.status_code == 409 and "in use by job" in r.json()["detail"]


def test_unknown_jobs_are_404(env):
    for method, path, body in [("GET", "", None), ("GET", "/metrics", None), ("GET", "/events", None),
                               ("GET", "/checkpoints", None), ("POST", "/resize", {"workers": 2}),
                               ("POST", "/pause", None), ("POST", "/resume", None), ("POST", "/stop", None),
                               ("DELETE", "", None)]:
        r = env.request(method, f"{J}/nope{path}", json=body)
        assert r.status_code == 404 and r.json() == {"detail": "no job with id 'nope'"}, (method, path, r.text)


def test_actions_that_do_not_fit_the_state_are_409_with_why(env):
    env.gate.allow(3)
    job_id = submit(env)
    wait_for(lambda: env.get(f"{J}/{job_id}").json()["step"] == 3, what="step 3")
    r = env.post(f"{J}/{job_id}/resume")
    assert r.status_code == 409 and "RUNNING; only a PAUSED job can be resumed" in r.json()["detail"]
    r = env.post(f"{J}/{job_id}/pause")
    assert r.status_code == 202 and r.json()["accepted"] is True
    wait_for(lambda: state_is(env, job_id, "PAUSED"), what="PAUSED")
    r = env.post(f"{J}/{job_id}/pause")
    assert r.status_code == 409 and "already paused" in r.json()["detail"]
    assert env.post(f"{J}/{job_id}/resume").status_code == 202
    wait_for(lambda: state_is(env, job_id, "RUNNING"), what="RUNNING again")
    assert env.post(f"{J}/{job_id}/stop").status_code == 202
    j = wait_for(lambda: state_is(env, job_id, "STOPPED"), what="STOPPED")
    assert j["reason"] == "stop requested by user"
    for action, body in (("resize", {"workers": 2}), ("stop", None), ("pause", None), ("resume", None)):
        r = env.post(f"{J}/{job_id}/{action}", json=body)
        assert r.status_code == 409 and "STOPPED" in r.json()["detail"], (action, r.text)


def test_resize_changes_the_layout_and_is_recorded(env):
    env.gate.allow(4)
    job_id = submit(env, steps=40)
    wait_for(lambda: env.get(f"{J}/{job_id}").json()["step"] == 4, what="step 4")
    assert env.get(f"{J}/{job_id}").json()["world_size"] == 4
    r = env.post(f"{J}/{job_id}/resize", json={"workers": 2})
    assert r.status_code == 202, r.text
    # world size and layout change one after the other inside the coordinator: wait for the layout
    j = wait_for(lambda: (x := env.get(f"{J}/{job_id}").json())["degrees"]["dp"] == 2 and x, what="dp=2")
    assert j["world_size"] == 2 and j["max_workers"] == 2
    env.gate.allow(None)
    j = wait_for(lambda: state_is(env, job_id, "SUCCEEDED"), what="SUCCEEDED")
    assert j["reconfigurations"] == {"planned": 1, "user": 1} and j["steps_lost"] == 0
    resizes = [e for e in env.get(f"{J}/{job_id}/events").json() if e["kind"] == "resize"]
    assert [(e["cause"], e["details"]["world_size"]) for e in resizes] == [("planned", 4), ("user", 2)]
    assert [m["world_size"] for m in env.get(f"{J}/{job_id}/metrics", params={"since": 38}).json()] == [2, 2]


@pytest.mark.parametrize("body", [{}, {"workers": 0}, {"workers": 2, "max_workers": 3},
                                  {"min_workers": 3, "max_workers": 2}, {"workers": "two"}, {"nodes": 2}])
def test_bad_resize_requests_are_422(env, body):
    env.gate.allow(0)
    job_id = submit(env)
    r = env.post(f"{J}/{job_id}/resize", json=body)
    assert r.status_code == 422 and r.json()["detail"][0]["msg"], r.text


def test_a_waiting_job_says_why(env):
    env.cluster.nodes.clear()
    job_id = submit(env)
    j = wait_for(lambda: state_is(env, job_id, "WAITING_FOR_CAPACITY"), what="WAITING_FOR_CAPACITY")
    assert "worker" in j["reason"] and j["world_size"] == 0
    env.cluster.nodes["a"] = 2
    wait_for(lambda: state_is(env, job_id, "RUNNING", "SUCCEEDED"), what="running once a node is back")


def test_delete_stops_and_forgets_but_keeps_checkpoints(env):
    env.gate.allow(2)
    job_id = submit(env)
    wait_for(lambda: env.get(f"{J}/{job_id}").json()["step"] == 2, what="step 2")
    run_dir = env.get(f"{J}/{job_id}").json()["run_dir"]
    marker = os.path.join(run_dir, "checkpoints", "step-00000002", "manifest.json")
    os.makedirs(os.path.dirname(marker))
    open(marker, "w").write("{}")
    r = env.delete(f"{J}/{job_id}")
    assert r.status_code == 200 and r.json() == {"id": job_id, "state": "STOPPED", "deleted": True, "run_dir": run_dir}
    assert env.get(f"{J}/{job_id}").status_code == 404 and env.get(J).json() == []
    assert os.path.exists(marker) and os.path.exists(os.path.join(run_dir, "events.jsonl"))
    assert env.launcher.attach(job_id) is None


def test_body_over_the_limit_is_413(env):
    big = {"spec": {**SPEC, "name": "x" * (1 << 20)}}
    r = env.post(J, json=big)
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: the limit must hold while reading
        for _ in range(20):
            yield b" " * (100 * 1024)
    r = env.post(J, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert env.get(J).json() == []


def test_cluster_shows_nodes_draining_with_deadlines_and_dead(env):
    deadline = time.time() + 30
    env.cluster.nodes["c"] = 1
    env.cluster.draining["b"] = int(deadline * 1000)
    env.cluster.dead.add("c")
    out = env.get("/api/v1/cluster").json()
    nodes = {n["node_id"]: n for n in out["nodes"]}
    assert nodes["a"]["alive"] and not nodes["a"]["draining"] and nodes["a"]["cpus"] == 2
    assert nodes["b"]["draining"] and nodes["b"]["drain_deadline"] == pytest.approx(deadline, abs=0.01)
    assert 25 < nodes["b"]["seconds_left"] <= 30
    assert not nodes["c"]["alive"]
    assert out["usable_workers"] == 2


def test_prometheus_metrics_per_job(env):
    env.gate.allow(3)
    job_id = submit(env, steps=10)
    wait_for(lambda: env.get(f"{J}/{job_id}").json()["step"] == 3, what="step 3")
    env.post(f"{J}/{job_id}/resize", json={"workers": 2})
    wait_for(lambda: env.get(f"{J}/{job_id}").json()["degrees"]["dp"] == 2, what="dp=2")
    env.gate.allow(5)
    wait_for(lambda: env.get(f"{J}/{job_id}").json()["step"] == 5, what="step 5")
    r = env.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.labels.get("job", job_id) == job_id:
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("job", "name"))))
                samples[key] = s.value
    assert samples[("elastron_job_step", ())] == 5
    assert samples[("elastron_job_loss", ())] == pytest.approx(2.0)
    assert samples[("elastron_job_val_loss", ())] == pytest.approx(5.0)  # the last evaluation: step 4
    assert env.get(f"{J}/{job_id}").json()["val_loss"] == pytest.approx(5.0)
    rows = env.get(f"{J}/{job_id}/metrics").json()
    assert [(m["step"], m["val_loss"]) for m in rows if m["val_loss"] is not None] == [(2, 10.0), (4, 5.0)]
    assert samples[("elastron_job_tokens_per_second", ())] == pytest.approx(1050.0)
    assert samples[("elastron_job_world_size", ())] == 2
    assert samples[("elastron_job_parallel_degree", (("axis", "dp"),))] == 2
    assert samples[("elastron_job_parallel_degree", (("axis", "tp"),))] == 1
    assert samples[("elastron_job_parallel_degree", (("axis", "pp"),))] == 1
    assert samples[("elastron_job_reconfigurations_total", (("cause", "user"),))] == 1
    assert samples[("elastron_job_reconfigurations_total", (("cause", "planned"),))] == 1
    assert samples[("elastron_job_steps_lost_total", ())] == 0
    assert samples[("elastron_job_state", (("state", "RUNNING"),))] == 1
    assert samples[("elastron_jobs", (("state", "RUNNING"),))] == 1


def test_openapi_lists_every_endpoint_with_the_job_spec_documented(env):
    doc = env.get("/openapi.json").json()
    paths = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    for p, m in [(J, "post"), (J, "get"), (J + "/{job_id}", "get"), (J + "/{job_id}", "delete"),
                 (J + "/{job_id}/resize", "post"), (J + "/{job_id}/pause", "post"), (J + "/{job_id}/resume", "post"),
                 (J + "/{job_id}/stop", "post"), (J + "/{job_id}/metrics", "get"), (J + "/{job_id}/events", "get"),
                 (J + "/{job_id}/checkpoints", "get"), ("/api/v1/cluster", "get"), ("/healthz", "get"),
                 ("/metrics", "get")]:
        assert (p, m) in paths, (p, m)
    schemas = doc["components"]["schemas"]
    train = schemas["TrainConfig"]["properties"]
    assert train["steps"]["default"] == 100 and "Optimizer steps" in train["steps"]["description"]
    assert schemas["JobConfig"]["additionalProperties"] is False  # the job YAML's one schema
    assert schemas["JobSubmit"]["properties"]["spec"]["$ref"] == "#/components/schemas/JobConfig"
    assert doc["paths"][J]["post"]["responses"].keys() >= {"201", "422", "401", "403"}


def test_healthz_and_dashboard(env):
    assert env.get("/healthz").json() == {"status": "ok", "jobs": 0}
    page = env.get("/")
    assert page.status_code == 200 and 'id="loss-chart"' in page.text and "/static/app.js" in page.text
    js = env.get("/static/app.js")
    assert js.status_code == 200 and "drawChart" in js.text


def test_token_guards_mutations_and_reads(tmp_path):
    launcher, _ = make_launcher()
    with TestClient(make_app(tmp_path, launcher, token="s3cret")) as c:
        r = c.post(J, json={"spec": SPEC})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in r.json()["detail"]
        r = c.post(J, json={"spec": SPEC}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 403 and r.json() == {"detail": "wrong API token"}
        r = c.post(J, json={"spec": SPEC}, headers={"Authorization": "Basic czNjcmV0"})
        assert r.status_code == 401
        r = c.post(J, json={"spec": SPEC, "steps": 3}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 201
        job_id = r.json()["id"]
        auth = {"Authorization": "Bearer s3cret"}
        assert c.get(J, headers=auth).status_code == 200 and c.get(f"{J}/{job_id}", headers=auth).status_code == 200
        for path in ("", f"/{job_id}", f"/{job_id}/events", f"/{job_id}/metrics", f"/{job_id}/checkpoints"):
            assert c.get(J + path).status_code == 401, path  # issue 15 item 4: reads need the token too
        assert c.get("/api/v1/cluster").status_code == 401 and c.get("/metrics").status_code == 401
        assert c.get("/healthz").json() == {"status": "ok", "jobs": None}  # open to probes, no data
        for method, path in [("POST", "/pause"), ("POST", "/resume"), ("POST", "/stop"), ("DELETE", "")]:
            assert c.request(method, f"{J}/{job_id}{path}").status_code == 401, (method, path)
        assert c.post(f"{J}/{job_id}/resize", json={"workers": 1}).status_code == 401
        assert c.delete(f"{J}/{job_id}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    stop_all(launcher)


def test_a_diverged_loss_is_served_as_null(env):
    env.gate.allow(0)
    job_id = submit(env)
    row = {"step": 1, "loss": float("nan"), "tokens_per_s": float("inf"), "time": 1.0}
    env.app.state.jobs.store.add_metrics(job_id, [row])
    r = env.get(f"{J}/{job_id}/metrics")
    assert r.status_code == 200 and json.loads(r.text)[0]["loss"] is None


def test_serve_binds_loopback_by_default_and_says_so(tmp_path, monkeypatch, caplog):
    import uvicorn

    import api.app as app_module
    from api.store import JobStore
    from service.server.job_actor import LocalLauncher
    from service.server.job_manager import JobManager

    runs: list[dict] = []
    monkeypatch.setenv("ELASTRON_RUNS_ROOT", str(tmp_path / "runs"))
    monkeypatch.delenv("ELASTRON_API_TOKEN", raising=False)
    monkeypatch.setattr(app_module, "default_manager", lambda s: JobManager(
        JobStore(":memory:"), LocalLauncher(), runs_root=s.runs_root))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    caplog.set_level("INFO", logger="elastron.api")
    assert app_module.serve(None) == 0
    assert runs[-1]["host"] == "127.0.0.1" and runs[-1]["port"] == 8000
    assert "loopback only" in caplog.text
    caplog.clear()
    assert app_module.serve(None, "0.0.0.0", 9000) == 2
    assert len(runs) == 1 and "refusing to bind 0.0.0.0:9000 with no token" in caplog.text
    assert app_module.serve(None, "0.0.0.0", 9000, insecure=True) == 0  # the explicit override
    assert runs[-1]["host"] == "0.0.0.0" and "--insecure" in caplog.text
    monkeypatch.setenv("ELASTRON_API_TOKEN", "t0ken")
    assert app_module.serve(None, "0.0.0.0", 9000, tls_cert="c.pem", tls_key="k.pem") == 0
    assert (runs[-1]["ssl_certfile"], runs[-1]["ssl_keyfile"]) == ("c.pem", "k.pem")
    assert app_module.serve(None, "0.0.0.0", 9000, tls_cert="c.pem") == 2  # a cert needs its key
    monkeypatch.delenv("ELASTRON_API_TOKEN")

    def broken(settings):
        raise RuntimeError("cannot connect to Ray at 10.9.9.9:6379: timed out")
    monkeypatch.setattr(app_module, "default_manager", broken)
    assert app_module.serve("10.9.9.9:6379") == 1 and len(runs) == 3
    assert "cannot start: cannot connect to Ray at 10.9.9.9:6379" in caplog.text


def test_job_detail_wraps_every_field_of_the_job_status():
    import dataclasses

    from api.schemas import JobDetail
    from service.control.status import JobStatus

    fields = {f.name for f in dataclasses.fields(JobStatus)} | {"degrees"}
    assert fields <= set(JobDetail.model_fields), fields - set(JobDetail.model_fields)
