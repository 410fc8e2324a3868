"""Issues 42 and 52, shown by attack: every input of the third and fourth security reviews, and the earlier
reviews' inputs, replayed over HTTP against one live server (uvicorn) with two user tokens. The store lies where
`elastron serve` puts it by default (RUNS_ROOT/elastron.db). After each input: no 5xx, no reply that shows
the other user's job, and the store still answers."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.deps import Settings
from api.store import JobStore
from service.control.commands import Stop
from service.control.status import JobStatus
from service.server.job_manager import JobManager, JobUnavailable
from service.sharing.scheduler import Quota
from tests.api.helpers import HandleLauncher, SPEC, live_server, wait_for
from tests.api.test_request_limits import bad_paths
from tests.api.test_submit_fuzz import bodies

J = "/api/v1/jobs"
ADMIN, ALICE, BOB = "adm1n-t0ken", "al1ce-t0ken", "b0b-t0ken"


def h(tok: str) -> dict:
    return {"Authorization": f"Bearer {tok}"}


class Handle:
    """A coordinator that runs until stopped; a stuck one answers no command: each gives up after 1 s,
    as a Ray call's timeout does (JobUnavailable)."""

    def __init__(self, stuck: threading.Event | None, job_id: str = ""):
        self.stuck, self.state, self.job_id = stuck, "RUNNING", job_id

    def status(self):
        return JobStatus(state=self.state, reason="", step=1, total_steps=10, world_size=1)

    def events_since(self, index=0):
        return [{"kind": "note", "time": 1.0, "job_id": self.job_id, "reason": "started"}][index:]

    def metrics_since(self, step=0):
        return []

    def send(self, cmd):
        if self.stuck is not None and not self.stuck.wait(1.0):
            raise JobUnavailable("no answer within 1 s")
        if isinstance(cmd, Stop):
            self.state = "STOPPED"


def stuck_launcher(stuck: threading.Event) -> HandleLauncher:
    """Coordinators that are stuck (answer nothing until `stuck` is set) for jobs named "stuck"."""
    return HandleLauncher(lambda job: Handle(stuck if job.cfg.name == "stuck" else None, job.id))


class Server:
    def __init__(self, url: str, root: Path, stuck: threading.Event):
        self.c = httpx.Client(base_url=url, timeout=20)
        self.root, self.runs, self.stuck = root, root / "runs", stuck
        self.db = self.runs / "elastron.db"

    def submit(self, tok: str, spec: dict | None = None, **kw) -> httpx.Response:
        r = self.c.post(J, json={"spec": SPEC if spec is None else spec, **kw}, headers=h(tok))
        self.check(r)
        return r

    def check(self, r: httpx.Response) -> None:
        """No 5xx (but the 503 with Retry-After that a bounded wait answers); the store intact (a file, not
        a directory made by a job; it answers)."""
        assert r.status_code < 500 or (r.status_code == 503 and "retry-after" in r.headers), (
            r.request.method, r.request.url, r.status_code, r.text)
        for suffix in ("", "-journal", "-wal", "-shm"):
            p = self.db.with_name(self.db.name + suffix)
            assert not p.is_dir(), f"a job made {p} a directory"
        assert self.c.get(J, headers=h(ADMIN), params={"limit": 1}).status_code == 200

    def forget(self, tok: str, job_id: str) -> None:
        r = self.c.delete(f"{J}/{job_id}", headers=h(tok), params={"force": "true"})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("attack")
    (root / "data" / "corpus").mkdir(parents=True)
    (root / "data" / "corpus" / "a.py").write_text("x = 1\n" * 100)
    (root / "data" / "val").mkdir()
    (root / "data" / "val" / "b.py").write_text("y = 2\n" * 100)
    (root / "base" / "llama").mkdir(parents=True)
    (root / "outside").mkdir()
    runs = root / "runs"
    runs.mkdir()
    (runs / "link").symlink_to(root / "outside")  # what bad_paths expects to find
    (root / "data" / "link").symlink_to(root / "outside")
    (runs / "loop").symlink_to(runs / "loop")
    s = Settings(runs_root=runs, store_url=str(runs / "elastron.db"), token=ADMIN,
                 user_tokens={"alice": ALICE, "bob": BOB}, data_roots=(root / "data",),
                 object_stores=("s3://ckpts", "abfs://ckpts@acct.dfs.core.windows.net", "hdfs://nn:8020"),
                 azure_account="acct", resume_prefixes=(str(root / "base"), "s3://shared/base"),
                 max_live_jobs=4, lock_timeout_s=1.0, stop_timeout_s=0.5, sync_interval_s=0.05, schedule=False)
    stuck = threading.Event()
    mgr = JobManager(JobStore(s.store_url), stuck_launcher(stuck), runs_root=s.runs_root, data_roots=s.data_roots,
                     sync_interval_s=s.sync_interval_s, stop_timeout_s=s.stop_timeout_s,
                     resume_prefixes=s.resume_prefixes, object_stores=s.object_stores, azure_account=s.azure_account,
                     max_live_jobs=s.max_live_jobs, lock_timeout_s=s.lock_timeout_s,
                     quotas={"bob": Quota(max_priority=5)}, max_finished_jobs=2)
    with live_server(create_app(jobs=mgr, settings=s)) as url:
        server = Server(url, root, stuck)
        yield server
        stuck.set()
        server.c.close()


def spec_with(**sections) -> dict:
    out = json.loads(json.dumps(SPEC))
    for k, v in sections.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def loc_of(r: httpx.Response) -> list:
    return r.json()["detail"][0]["loc"]


# -- high 1: data.val_path ----------------------------------------------------------------------------------

def test_val_path_outside_the_data_roots_is_refused_before_the_disk_is_looked_at(srv):
    msgs = []
    for where in ("/etc", "/", "/no/such/dir", str(srv.root / "outside"), str(srv.root / "data" / "link")):
        t0 = time.monotonic()
        r = srv.submit(BOB, spec_with(data={"source": "corpus", "path": str(srv.root / "data" / "corpus"),
                                            "val_path": where, "suffixes": [""]}, train={"eval_interval": 10}))
        assert r.status_code == 422 and loc_of(r) == ["body", "spec", "data", "val_path"], r.text
        assert time.monotonic() - t0 < 2.0  # "/" is not walked
        msgs.append(r.json()["detail"][0]["msg"].replace(repr(where), "PATH"))
    assert len(set(msgs)) == 1, msgs  # the same words whether it exists or not: no oracle
    ok = srv.submit(BOB, spec_with(data={"source": "corpus", "path": str(srv.root / "data" / "corpus"),
                                         "val_path": str(srv.root / "data" / "val")}, train={"eval_interval": 10}))
    assert ok.status_code == 201, ok.text
    srv.forget(BOB, ok.json()["id"])


# -- high 2: the store's own files --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["elastron.db", "elastron.db-journal", "elastron.db-wal", "elastron.db-shm",
                                  "elastron.db-wal/x"])
def test_no_run_or_checkpoint_dir_may_name_the_stores_files(srv, name):
    r = srv.submit(ALICE, run_dir=name)
    assert r.status_code == 422 and loc_of(r) == ["body", "run_dir"] and "reserved" in r.text, r.text
    r = srv.submit(ALICE, spec_with(checkpoint={"dir": str(srv.runs / name)}))
    assert r.status_code == 422 and loc_of(r) == ["body", "spec", "checkpoint", "dir"], r.text


# -- medium 3: places held after DELETE; resume prefixes read-only -------------------------------------------

def test_a_deleted_jobs_checkpoints_stay_out_of_another_users_reach(srv):
    ck = str(srv.runs / "alice-ck")
    a = srv.submit(ALICE, spec_with(checkpoint={"dir": ck}))
    assert a.status_code == 201, a.text
    srv.forget(ALICE, a.json()["id"])
    r = srv.submit(BOB, spec_with(checkpoint={"dir": ck}))
    assert r.status_code == 409 and "another user's job" in r.text and a.json()["id"] not in r.text
    r = srv.submit(BOB, spec_with(checkpoint={"dir": str(srv.runs / "bob-ck"), "resume_from": ck}))
    assert r.status_code == 422 and loc_of(r) == ["body", "spec", "checkpoint", "resume_from"]
    again = srv.submit(ALICE, spec_with(checkpoint={"resume_from": ck}))  # still hers
    assert again.status_code == 201, again.text
    srv.forget(ALICE, again.json()["id"])
    assert srv.c.delete(f"{J}/{a.json()['id']}/places", headers=h(BOB)).status_code == 403  # admin only
    freed = srv.c.delete(f"{J}/{a.json()['id']}/places", headers=h(ADMIN))
    assert freed.status_code == 200 and freed.json()["freed"] == 2, freed.text  # run_dir and checkpoint.dir
    r = srv.submit(BOB, spec_with(checkpoint={"dir": ck}))
    assert r.status_code == 201, r.text
    srv.forget(BOB, r.json()["id"])


def test_shared_resume_prefixes_are_read_only_and_a_local_one_can_be_resumed_from(srv):
    base = str(srv.root / "base" / "llama")
    for where in (base, "s3://shared/base/x", "s3://shared"):
        r = srv.submit(BOB, spec_with(checkpoint={"dir": where}))
        assert r.status_code == 422 and "read-only" in r.text or "not inside an object store" in r.text, r.text
    r = srv.submit(BOB, spec_with(checkpoint={"resume_from": base}))
    assert r.status_code == 201, r.text
    srv.forget(BOB, r.json()["id"])


# -- medium 4: other spellings of one store -----------------------------------------------------------------

@pytest.mark.parametrize("held,other", [
    ("abfs://ckpts/bob", "abfs://ckpts@acct.dfs.core.windows.net/bob"),
    ("abfs://ckpts/bob", "az://ckpts@acct.blob.core.windows.net/bob/x"),
    ("hdfs://nn:8020/bob", "hdfs://nn/bob/x"),
    ("hdfs://nn:8020/bob", "hdfs://NN:8020/bob"),
    ("s3://ckpts/bob", "s3a://ckpts/bob/x"),
])
def test_another_spelling_of_a_held_place_is_the_same_place(srv, held, other):
    a = srv.submit(BOB, spec_with(checkpoint={"dir": held}))
    assert a.status_code == 201, a.text
    try:
        r = srv.submit(ALICE, spec_with(checkpoint={"dir": other}))
        assert r.status_code == 409 and a.json()["id"] not in r.text, r.text
    finally:
        srv.forget(BOB, a.json()["id"])


@pytest.mark.parametrize("where", ["FILE:///etc", "S3://ckpts/x", "hdfs:///bob", "s3://arn:aws:s3:eu-west-1:1:accesspoint/a",
                                   "hdfs://attacker.example:8020/x", "abfs://ckpts@evil.dfs.core.windows.net/x",
                                   "s3://someone-else/x", "gs://anything/x"])
def test_unlisted_hosts_and_spellings_that_cannot_be_compared_are_refused(srv, where):
    for field in ("dir", "resume_from"):
        r = srv.submit(ALICE, spec_with(checkpoint={field: where}))
        assert r.status_code == 422 and loc_of(r) == ["body", "spec", "checkpoint", field], r.text


# -- medium 5: no waiting without a bound ------------------------------------------------------------------

def test_deletes_of_a_stuck_job_do_not_pile_up_and_others_reads_answer(srv):
    j = srv.submit(ALICE, spec_with(name="stuck")).json()["id"]
    b = srv.submit(BOB).json()["id"]
    with ThreadPoolExecutor(20) as pool:
        futs = [pool.submit(srv.c.delete, f"{J}/{j}", headers=h(ALICE)) for _ in range(20)]
        # each answer is checked below; 503s carry Retry-After
        time.sleep(0.3)
        t0 = time.monotonic()
        assert srv.c.get(f"{J}/{b}", headers=h(BOB)).status_code == 200
        assert time.monotonic() - t0 < 1.0
        answers = [f.result() for f in futs]
        codes = sorted(r.status_code for r in answers)
        for r in answers:
            srv.check(r)
    # one waited for the coordinator (which did not take the stop, so it was released); the rest at once:
    # 503 from the one-command guard, or 429 past alice's requests answered at once (PerUserLimit)
    assert codes.count(503) + codes.count(429) >= 19 and set(codes) <= {200, 429, 503}, codes
    assert srv.c.get(f"{J}/{j}", headers=h(ALICE)).status_code == 404
    srv.forget(BOB, b)


def test_a_user_has_a_bounded_number_of_live_jobs(srv):
    ids = [srv.submit(BOB).json()["id"] for _ in range(4)]
    r = srv.submit(BOB)
    assert r.status_code == 409 and "ELASTRON_MAX_LIVE_JOBS" in r.text
    assert srv.submit(ALICE).status_code == 201  # another user is not held back
    for i in ids:
        srv.forget(BOB, i)


# -- medium 6: typed model overrides ------------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [("rope_theta", "x"), ("norm_eps", [1]), ("tie_embeddings", "yes"),
                                        ("head_size", 2**62), ("head_size", 10**400), ("dim", 2**56),
                                        ("preset", "small")])
def test_model_overrides_are_typed(srv, name, value):
    body = json.dumps({"spec": spec_with(model={"overrides": {name: value}})})
    r = srv.c.post(J, content=body, headers={**h(ALICE), "content-type": "application/json"})
    srv.check(r)
    assert r.status_code == 422 and loc_of(r)[-1] == name, r.text


def test_init_std_nan_is_refused(srv):
    body = json.dumps({"spec": spec_with(model={"overrides": {"init_std": float("nan")}})})  # NaN, as JSON5 allows
    r = srv.c.post(J, content=body, headers={**h(ALICE), "content-type": "application/json"})
    srv.check(r)
    assert r.status_code == 422, r.text


# -- low 7 ------------------------------------------------------------------------------------------------

def test_a_user_sees_counts_of_the_cluster_not_its_nodes(srv):
    r = srv.c.get("/api/v1/cluster", headers=h(BOB))
    srv.check(r)
    assert r.status_code == 200 and r.json()["nodes"] == []


# -- the earlier reviews' inputs ---------------------------------------------------------------------------

def test_the_earlier_reviews_path_inputs_are_still_refused(srv):
    for body, loc, why in bad_paths(srv.root):
        r = srv.c.post(J, json={"spec": SPEC, **body}, headers=h(BOB))
        srv.check(r)
        assert r.status_code == 422 and loc_of(r) == ["body", *loc], (body, r.text)


def test_the_earlier_reviews_unusable_values_get_a_4xx(srv):
    for label, raw in bodies():
        r = srv.c.post(J, content=raw, headers={**h(ALICE), "content-type": "application/json"})
        srv.check(r)
        assert 400 <= r.status_code < 500, (label, r.status_code, r.text)


@pytest.mark.parametrize("src", ["/etc", "../../..", "http://169.254.169.254/latest/meta-data", "sftp://host/ck",
                                 "memory://x", "https://example.com/ck", "s3://shared/base/../other",
                                 "file:///etc/passwd", "relative/dir", "s3://someone-elses-bucket/ck"])
def test_the_earlier_reviews_resume_from_inputs_are_refused(srv, src):
    r = srv.submit(BOB, spec_with(checkpoint={"resume_from": src}))
    assert r.status_code == 422 and loc_of(r) == ["body", "spec", "checkpoint", "resume_from"], r.text


def test_no_user_reads_another_users_job(srv):
    a = srv.submit(ALICE, spec_with(name="x1")).json()["id"]
    rd = srv.c.get(f"{J}/{a}", headers=h(ALICE)).json()["run_dir"]
    for path in (f"{J}/{a}", f"{J}/{a}/events", f"{J}/{a}/metrics", f"{J}/{a}/checkpoints"):
        r = srv.c.get(path, headers=h(BOB))
        srv.check(r)
        assert r.status_code == 404, (path, r.text)
    for path in (f"{J}/{a}/pause", f"{J}/{a}/stop"):
        assert srv.c.post(path, headers=h(BOB)).status_code == 404
    assert srv.c.delete(f"{J}/{a}", headers=h(BOB)).status_code == 404
    assert a not in srv.c.get(J, headers=h(BOB)).text
    r = srv.submit(BOB, spec_with(checkpoint={"resume_from": f"{rd}/checkpoints"}))
    assert r.status_code == 422 and "alice" not in r.text
    r = srv.submit(BOB, run_dir=Path(rd).name)  # the reply echoes what bob sent, and names no job
    assert r.status_code == 409 and f"job {a}" not in r.text and "another user's job" in r.text
    srv.forget(ALICE, a)


def test_an_unexpected_error_is_a_500_that_says_nothing_internal(tmp_path, caplog):
    from fastapi.testclient import TestClient

    class Broken(JobManager):
        def list(self, **kw):
            raise RuntimeError(f"disk I/O error at {tmp_path}/runs/elastron.db for job of alice")

    s = Settings(runs_root=tmp_path / "runs", store_url=":memory:", user_tokens={"bob": BOB}, schedule=False)
    mgr = Broken(JobStore(":memory:"), stuck_launcher(threading.Event()), runs_root=s.runs_root)
    with TestClient(create_app(jobs=mgr, settings=s), raise_server_exceptions=False) as c:
        r = c.get(J, headers=h(BOB))
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert "disk" not in r.text and "alice" not in r.text and str(tmp_path) not in r.text
    ref = r.json()["detail"].split("reference ")[1].split(" ")[0]
    assert any(ref in rec.getMessage() and rec.exc_info for rec in caplog.records)  # the trace is logged


def test_the_client_retries_a_delete_the_guard_answered_503():
    from api.client import Client

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        if len(seen) < 3:
            return httpx.Response(503, json={"detail": "busy"}, headers={"Retry-After": "0"})
        return httpx.Response(200, json={"id": "j", "state": "STOPPED", "deleted": True, "run_dir": "/r"})

    with Client("http://x", transport=httpx.MockTransport(answer)) as c:
        assert c.delete("j")["deleted"] and seen == ["DELETE"] * 3


# -- issue 52: the fourth review ---------------------------------------------------------------------------

def post_raw(srv, path: str, raw: str, tok: str = ALICE) -> httpx.Response:
    r = srv.c.post(path, content=raw, headers={**h(tok), "content-type": "application/json"})
    srv.check(r)
    return r


def test_2_a_user_may_not_ask_for_a_priority_above_the_ceiling_the_operator_set(srv):
    for tok, prio, top in ((ALICE, 1_000_000, 0), (ALICE, 1, 0), (BOB, 6, 5)):
        r = srv.submit(tok, spec_with(scheduling={"priority": prio}))
        assert r.status_code == 403 and f"ceiling of {top}" in r.text, r.text
    for tok, prio in ((ALICE, 0), (ALICE, -3), (BOB, 5), (ADMIN, 1_000_000)):  # the admin has no ceiling
        r = srv.submit(tok, spec_with(scheduling={"priority": prio}))
        assert r.status_code == 201, (tok, prio, r.text)
        srv.forget(tok, r.json()["id"])


@pytest.mark.parametrize("shape", ["name", "run_dir", "unknown key", "resize"])
def test_3_deeply_nested_json_is_a_422_not_a_500(srv, shape):
    deep = "[" * 480 + "]" * 480  # 960 bytes
    path, raw = J, {"name": '{"spec": {"name": %s}}' % deep,
                    "run_dir": '{"spec": %s, "run_dir": %s}' % (json.dumps(SPEC), deep),
                    "unknown key": '{"spec": %s, "x": {"y": %s}}' % (json.dumps(SPEC), deep)}.get(shape, "")
    if shape == "resize":
        a = srv.submit(ALICE).json()["id"]
        path, raw = f"{J}/{a}/resize", '{"workers": %s}' % deep
    t0 = time.monotonic()
    r = post_raw(srv, path, raw)
    assert r.status_code == 422 and time.monotonic() - t0 < 1.0, r.text
    assert len(r.content) < 4096 and "[[[" not in r.text  # the value refused is not echoed
    if shape == "resize":
        srv.forget(ALICE, a)


@pytest.mark.parametrize("field", ["data.path", "data.val_path", "model.init_from", "checkpoint.dir",
                                   "checkpoint.resume_from", "run_dir"])
def test_4_a_long_location_is_refused_within_a_second(srv, field):
    section, _, key = field.partition(".")
    for where in ("/etc/" + "a/" * 450_000, str(srv.root / "data" / "corpus") + "/a" * 450_000):  # 900 KB
        spec = spec_with(data={"source": "corpus", "path": str(srv.root / "data" / "corpus")})
        spec[section] = {**spec.get(section, {}), key: where}
        body = {"run_dir": where} if field == "run_dir" else {"spec": spec}
        t0 = time.monotonic()
        r = srv.c.post(J, json={"spec": SPEC, **body}, headers=h(ALICE))
        srv.check(r)
        assert r.status_code == 422 and time.monotonic() - t0 < 1.0, (field, r.status_code, time.monotonic() - t0)
        assert "at most" in r.text and len(r.content) < 4096  # the length cap (the schema's, or admission's 4096)


def test_4_a_location_outside_its_roots_is_judged_before_the_disk_is_looked_at(tmp_path, monkeypatch):
    from service.server.admission import Admission
    from service.server.specs import SpecError

    (tmp_path / "data").mkdir()
    adm = Admission(runs_root=tmp_path / "runs", data_roots=[tmp_path / "data"])
    calls = []
    real = Path.resolve
    monkeypatch.setattr(Path, "resolve", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    for judge, where in ((adm.data, "/etc/" + "a/" * 2000), (adm.write, "/etc/" + "a/" * 2000),
                         (adm.data, str(tmp_path / "runs" / "x")), (adm.write, str(tmp_path / "data" / "x"))):
        with pytest.raises(SpecError):
            judge(where, ("spec", "data", "path"))
    assert calls == []
    assert adm.data(str(tmp_path / "data" / "x"), ("spec", "data", "path")).local and calls  # inside: resolved


def test_5_a_users_finished_jobs_are_kept_up_to_a_limit_and_names_are_no_metric_labels(srv):
    mine = set(r["id"] for r in srv.c.get(J, headers=h(ALICE)).json())
    ids = []
    for i in range(3):
        j = srv.submit(ALICE, spec_with(name=f"secret-name-{i}")).json()["id"]
        assert srv.c.post(f"{J}/{j}/stop", headers=h(ALICE)).status_code == 202
        wait_for(lambda: srv.c.get(f"{J}/{j}", headers=h(ALICE)).json()["state"] == "STOPPED", what="stopped")
        ids.append(j)
    wait_for(lambda: srv.c.get(f"{J}/{ids[0]}/events", headers=h(ALICE)).json(), what="events stored")
    metrics = srv.c.get("/metrics", headers=h(ADMIN))
    assert metrics.status_code == 200 and ids[0] in metrics.text and "secret-name" not in metrics.text
    new = srv.submit(ALICE).json()["id"]  # alice's 4th finished-or-live job: her oldest finished one goes
    kept = {r["id"] for r in srv.c.get(J, headers=h(ALICE)).json()} - mine
    assert ids[0] not in kept and {ids[1], ids[2], new} <= kept, (ids, kept)
    assert srv.c.get(f"{J}/{ids[0]}/events", headers=h(ADMIN)).status_code == 404
    assert srv.c.get(f"{J}/{ids[1]}/events", headers=h(ALICE)).json()  # the kept ones keep their events
    for j in (ids[1], ids[2], new):
        srv.forget(ALICE, j)


@pytest.mark.parametrize("root", ["s3://ckpts", "s3://ckpts/", "hdfs://nn:8020", "hdfs://nn/", "s3a://CKPTS",
                                  "abfs://ckpts@acct.dfs.core.windows.net"])
def test_6_an_object_stores_root_cannot_be_held(srv, root):
    r = srv.submit(ALICE, spec_with(checkpoint={"dir": root}))
    assert r.status_code == 422 and "root of an object store" in r.text, r.text
    b = srv.submit(BOB, spec_with(checkpoint={"dir": root.rstrip("/") + "/bob"}))  # the store stays usable
    assert b.status_code == 201, b.text
    srv.forget(BOB, b.json()["id"])


@pytest.mark.parametrize("port", ["\u00b2", "\u0668\u0660\u0662\u0660", "\uff18\uff10\uff12\uff10"])
def test_7_an_hdfs_port_is_ascii_digits(srv, port):
    r = srv.submit(ALICE, spec_with(checkpoint={"dir": f"hdfs://nn:{port}/jobs/x"}))
    assert r.status_code == 422 and "ASCII digits" in r.text, r.text


def test_8_a_directory_in_the_runs_root_that_no_job_holds_is_nobodys_to_take(srv):
    manual = srv.runs / "ops-manual-run"
    (manual / "checkpoints" / "step-1").mkdir(parents=True)
    for body in ({"run_dir": "ops-manual-run"}, {"run_dir": "ops-manual-run/sub"},
                 {"spec": spec_with(checkpoint={"dir": str(manual / "checkpoints")})}):
        r = srv.c.post(J, json={"spec": SPEC, **body}, headers=h(ALICE))
        srv.check(r)
        assert r.status_code == 422 and "no job holds it" in r.text, (body, r.text)
    r = srv.submit(ALICE, spec_with(checkpoint={"resume_from": str(manual / "checkpoints")}))
    assert r.status_code == 422, r.text  # nor may she read it
    adopted = srv.submit(ADMIN, run_dir="ops-manual-run")  # the operator adopts it
    assert adopted.status_code == 201, adopted.text
    r = srv.submit(ALICE, run_dir="ops-manual-run")
    assert r.status_code == 409, r.text  # now a job's: another owner's place
    srv.forget(ADMIN, adopted.json()["id"])


@pytest.mark.parametrize("field", ["data.path", "data.val_path", "model.init_from"])
def test_10_a_data_field_is_a_path_not_a_url(srv, field):
    section, _, key = field.partition(".")
    corpus = str(srv.root / "data" / "corpus")
    spec = spec_with(data={"source": "corpus", "path": corpus, "val_path": corpus}, train={"eval_interval": 10})
    spec[section] = {**spec.get(section, {}), key: f"file://{srv.root / 'data' / 'corpus'}"}
    r = srv.submit(ALICE, spec)
    assert r.status_code == 422 and loc_of(r) == ["body", "spec", section, key] and "not a URL" in r.text, r.text


def test_1_standby_workers_count_against_the_owners_quota_and_are_shown(tmp_path):
    from fastapi.testclient import TestClient

    from tests.api.helpers import make_app, make_launcher, stop_all

    launcher, _ = make_launcher({"a": 4, "b": 4}, step_s=0.02)
    greedy = spec_with(resources={"standby_per_node": 4}, parallel={"min_workers": 1, "max_workers": 1},
                       train={"steps": 400})
    try:
        with TestClient(make_app(tmp_path, launcher, schedule=True, token=ADMIN, user_tokens={"alice": ALICE, "bob": BOB},
                                 quotas={"alice": Quota(max_workers=3)})) as c:
            mine = c.post(J, json={"spec": greedy}, headers=h(ALICE)).json()["id"]
            theirs = c.post(J, json={"spec": greedy}, headers=h(BOB)).json()["id"]
            for j, tok in ((mine, ALICE), (theirs, BOB)):
                wait_for(lambda: c.get(f"{J}/{j}", headers=h(tok)).json()["world_size"] == 1, what="running on 1")

            def held(tok):
                return c.get("/api/v1/quotas", headers=h(tok)).json()[0]["workers_held"]

            # alice's quota of 3: her 1 member and 2 standbys
            assert wait_for(lambda: held(ALICE) == 3, what="alice's standbys counted") and held(ALICE) == 3
            # bob has no worker quota: his 1 member and 4 standbys beside it (node b is outside his grant)
            assert wait_for(lambda: held(BOB) == 5, what="bob's standbys counted")
    finally:
        stop_all(launcher)


@pytest.mark.parametrize("field,value,last", [
    ("resources.standby_per_node", 1_000_000, "standby_per_node"), ("resources.standby_per_node", 10**400, "standby_per_node"),
    ("train.eval_batches", 10**400, "eval_batches"), ("train.eval_interval", 10**400, "eval_interval"),
    ("name", "n" * 100_000, "name"), ("logging.wandb", {"project": "other-team/x"}, "project"),
    ("logging.wandb", {"project": "p" * 10_000}, "project")],
    ids=["standby-1e6", "standby-401-digits", "eval_batches", "eval_interval", "name-100k", "wandb-project-with-entity",
         "wandb-project-10k"])
def test_1_5_9_every_size_and_name_has_an_upper_bound(srv, field, value, last):
    """Findings 1, 5 and 9 and the read-only W&B finding, whose bounds live in the one spec schema (h77):
    logging.wandb.project is written with the workers' W&B credentials, so it is a bare project name
    (no entity/ prefix: another team's projects) of bounded length."""
    section, _, key = field.partition(".")
    spec = spec_with(**({section: {key: value}} if key else {section: value}))
    r = post_raw(srv, J, json.dumps({"spec": spec}))
    if r.status_code == 201:
        srv.forget(ALICE, r.json()["id"])
    assert r.status_code == 422 and loc_of(r)[-1] == last, r.text[:300]


def test_read_only_a_checkpoint_listing_follows_no_link_and_reads_latest_bounded(srv):
    a = srv.submit(ALICE).json()["id"]
    ck = Path(srv.c.get(f"{J}/{a}", headers=h(ALICE)).json()["run_dir"]) / "checkpoints"
    (ck / "step-5").mkdir(parents=True)
    (ck / "step-5" / "manifest.json").write_text("{}")
    (ck / "latest").write_text("step-5" + " " * 5_000_000 + "x")  # 5 MB
    secret = srv.root / "outside" / "secret"
    secret.mkdir(exist_ok=True)
    (secret / "big.bin").write_bytes(b"s" * 10_000)
    (ck / "step-9").symlink_to(secret)  # a link out of the run directory
    (ck / "step-5" / "data").symlink_to(secret)
    r = srv.c.get(f"{J}/{a}/checkpoints", headers=h(ALICE))
    srv.check(r)
    got = r.json()
    assert got["latest"] is not None and len(got["latest"]) <= 256 and len(r.content) < 4096, len(r.content)
    assert [e["name"] for e in got["entries"]] == ["step-5"] and got["entries"][0]["bytes"] == 2  # not 10_002
    (ck / "latest").unlink()
    (ck / "latest").symlink_to(secret / "big.bin")
    assert srv.c.get(f"{J}/{a}/checkpoints", headers=h(ALICE)).json()["latest"] is None
    srv.forget(ALICE, a)


def test_abuse_one_tokens_flood_is_held_to_its_share_before_its_body_is_read():
    import asyncio

    from api.app import PerUserLimit

    release, seen = asyncio.Event(), []

    async def slow(scope, receive, send):  # an app that answers once released
        seen.append(scope["path"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    s = Settings(runs_root=Path("runs"), token=ADMIN, user_tokens={"alice": ALICE, "bob": BOB})
    app = PerUserLimit(slow, s, max_inflight=2)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            flood = [asyncio.create_task(c.post(f"/a{i}", headers=h(ALICE), content=b"x" * 1000)) for i in range(5)]
            forged = asyncio.create_task(c.get("/f", headers=h("not-a-token")))
            bobs = asyncio.create_task(c.get("/b", headers=h(BOB)))
            await asyncio.sleep(0.2)
            release.set()
            return [r.status_code for r in await asyncio.gather(*flood)], (await forged).status_code, (await bobs)

    codes, forged, bob = asyncio.run(go())
    assert sorted(codes) == [200, 200, 429, 429, 429] and forged == 200 and bob.status_code == 200
    assert len([p for p in seen if p.startswith("/a")]) == 2  # the refused ones never reached the app


def test_the_client_retries_a_429_of_the_per_token_limit():
    from api.client import Client

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        if len(seen) < 3:
            return httpx.Response(429, json={"detail": "too many"}, headers={"Retry-After": "0"})
        return httpx.Response(200, json=[])

    with Client("http://x", transport=httpx.MockTransport(answer)) as c:
        assert c.jobs() == [] and seen == ["GET"] * 3
