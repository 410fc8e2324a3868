"""Hostile requests: bodies over the size limit get 413 with the limit in a JSON body, and every path the
server would resolve (run_dir, checkpoint.dir, data.path) that tries to leave its roots gets 422 with a
one-line reason naming the field, with nothing created on disk outside the runs root."""

from __future__ import annotations

import copy
import json
import os

import pytest
from fastapi.testclient import TestClient

from api.deps import Settings
from tests.api.helpers import SPEC, make_app, make_launcher, stop_all
from workers.config import spec_maxima

J = "/api/v1/jobs"


@pytest.fixture
def env(tmp_path):
    launcher, _ = make_launcher()
    (tmp_path / "data" / "corpus").mkdir(parents=True)
    (tmp_path / "data" / "corpus" / "a.py").write_text("print('hello')\n" * 50)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.bin").write_bytes(b"\x00\x01" * 64)
    app = make_app(tmp_path, launcher, max_body_bytes=4096, data_roots=(tmp_path / "data",),
                   object_stores=("s3://elastron",))
    with TestClient(app) as c:
        c.tmp = tmp_path
        yield c
    stop_all(launcher)


def with_spec(**sections) -> dict:
    s = copy.deepcopy(SPEC)
    for k, v in sections.items():
        s[k] = {**s.get(k, {}), **v}
    return s


def tree_outside_runs(tmp) -> set[str]:
    """Everything under tmp except the runs root and the store's files."""
    out = set()
    for dirpath, dirs, files in os.walk(tmp):
        rel = os.path.relpath(dirpath, tmp)
        if rel == "runs" or rel.startswith("runs" + os.sep):
            continue
        out.update(os.path.join(rel, n) for n in dirs + files if not n.startswith("jobs.db"))
    return out


# -- body size ---------------------------------------------------------------------------------------------

def test_a_body_over_the_configured_limit_is_413_with_the_limit(env):
    r = env.post(J, json={"spec": {**SPEC, "name": "x" * 5000}})
    assert r.status_code == 413 and r.headers["content-type"] == "application/json"
    assert r.json() == {"detail": "request body is larger than the server's limit of 4096 bytes"}

    def chunks():  # no Content-Length: the limit holds while the body is read
        for _ in range(10):
            yield b" " * 1000
    r = env.post(J, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["detail"]
    assert env.post(f"{J}/nope/resize", content=b"{" + b" " * 5000 + b"}",
                    headers={"content-type": "application/json"}).status_code == 413
    assert env.get(J).json() == []
    padded = json.dumps({"spec": SPEC, "steps": 1}) + " " * 3000  # under it (a name is at most 128 characters)
    assert env.post(J, content=padded, headers={"content-type": "application/json"}).status_code == 201


def test_the_limit_comes_from_the_environment_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("ELASTRON_MAX_BODY_BYTES", "2048")
    assert Settings.from_env().max_body_bytes == 2048
    monkeypatch.setenv("ELASTRON_MAX_BODY_BYTES", "1MiB")
    with pytest.raises(ValueError, match="ELASTRON_MAX_BODY_BYTES must be a whole number of bytes, got '1MiB'"):
        Settings.from_env()
    assert Settings().max_body_bytes == 1 << 20  # the default: 1 MiB


# -- paths -------------------------------------------------------------------------------------------------

def bad_paths(tmp) -> list[tuple[dict, list, str]]:
    out, runs = tmp / "outside", tmp / "runs"
    return [
        ({"run_dir": "../outside/r"}, ["run_dir"], "must not contain '..'"),
        ({"run_dir": "a/../../outside/r"}, ["run_dir"], "must not contain '..'"),
        ({"run_dir": str(out / "r")}, ["run_dir"], "inside the runs root"),
        ({"run_dir": "r\x00x"}, ["run_dir"], "without NUL bytes"),
        ({"run_dir": "link/r"}, ["run_dir"], "inside the runs root"),  # runs/link -> outside
        ({"run_dir": "loop/r"}, ["run_dir"], "cannot be resolved"),  # runs/loop -> runs/loop
        ({"spec": with_spec(checkpoint={"dir": str(out / "ck")})}, ["spec", "checkpoint", "dir"], "inside the runs root"),
        ({"spec": with_spec(checkpoint={"dir": f"{runs}/../outside/ck"})}, ["spec", "checkpoint", "dir"], "'..'"),
        ({"spec": with_spec(checkpoint={"dir": f"file://{out}/ck"})}, ["spec", "checkpoint", "dir"], "inside the runs root"),
        ({"spec": with_spec(checkpoint={"dir": f"FILE://{out}/ck"})}, ["spec", "checkpoint", "dir"], "lower case"),
        ({"spec": with_spec(checkpoint={"dir": f"simplecache::file://{out}/ck"})}, ["spec", "checkpoint", "dir"],
         "chained URLs"),
        ({"spec": with_spec(checkpoint={"dir": f"local://{out}/ck"})}, ["spec", "checkpoint", "dir"], "scheme must be one of"),
        ({"spec": with_spec(checkpoint={"dir": f"{runs}/ck\x00"})}, ["spec", "checkpoint", "dir"], "NUL"),
        ({"spec": with_spec(checkpoint={"dir": "relative/ck"})}, ["spec", "checkpoint", "dir"], "absolute path"),
        ({"spec": with_spec(data={"source": "tokens", "path": str(out / "secret.bin")})}, ["spec", "data", "path"],
         "outside the server's data roots"),
        ({"spec": with_spec(data={"source": "corpus", "path": "/etc"})}, ["spec", "data", "path"],
         "outside the server's data roots"),
        ({"spec": with_spec(data={"source": "corpus", "path": f"{tmp}/data/../outside"})}, ["spec", "data", "path"],
         "'..'"),
        ({"spec": with_spec(data={"source": "corpus", "path": "data/corpus"})}, ["spec", "data", "path"],
         "must be an absolute path"),
        ({"spec": with_spec(data={"source": "corpus", "path": f"{tmp}/data/corpus\x00"})}, ["spec", "data", "path"],
         "NUL"),
        ({"spec": with_spec(data={"source": "corpus", "path": f"{tmp}/data/link"})}, ["spec", "data", "path"],
         "outside the server's data roots"),  # data/link -> outside
    ]


N_BAD = 20


def test_the_bad_path_list_is_complete(tmp_path):
    assert len(bad_paths(tmp_path)) == N_BAD


@pytest.mark.parametrize("i", range(N_BAD))
def test_paths_that_leave_their_roots_are_422_and_create_nothing(env, i):
    (env.tmp / "runs").mkdir(exist_ok=True)
    (env.tmp / "runs" / "link").symlink_to(env.tmp / "outside")
    (env.tmp / "data" / "link").symlink_to(env.tmp / "outside")
    (env.tmp / "runs" / "loop").symlink_to(env.tmp / "runs" / "loop")
    body, loc, why = bad_paths(env.tmp)[i]
    before = tree_outside_runs(env.tmp)
    r = env.post(J, json={"spec": SPEC, "steps": 2, **body})
    assert r.status_code == 422, r.text
    err = r.json()["detail"][0]
    assert err["loc"] == ["body", *loc] and why in err["msg"] and "\n" not in err["msg"], err
    assert env.get(J).json() == []
    assert tree_outside_runs(env.tmp) == before


def test_a_path_outside_the_data_roots_says_the_same_whether_or_not_it_exists(env):
    paths = (str(env.tmp / "outside"), str(env.tmp / "no-such-dir"))
    msgs = [env.post(J, json={"spec": with_spec(data={"source": "corpus", "path": p})}).json()["detail"][0]["msg"]
            .replace(repr(p), "PATH") for p in paths]
    assert msgs[0] == msgs[1] and "PATH" in msgs[0]


def test_paths_inside_their_roots_are_accepted(env):
    runs = env.tmp / "runs"
    for body in ({"run_dir": "team/exp"}, {"run_dir": str(runs / "abs")},
                 {"spec": with_spec(checkpoint={"dir": f"file://{runs}/ck"})},
                 {"spec": with_spec(checkpoint={"dir": "s3://elastron/ck"})},
                 {"spec": with_spec(data={"source": "corpus", "path": str(env.tmp / "data" / "corpus")})},
                 {"spec": with_spec(data={"source": "corpus", "path": str(env.tmp / "data")})}):  # the root itself
        r = env.post(J, json={"spec": SPEC, "steps": 1, **body})
        assert r.status_code == 201, (body, r.text)


def test_data_roots_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTRON_DATA_ROOTS", f"{tmp_path}/a{os.pathsep}{tmp_path}/b")
    assert Settings.from_env().data_roots == (tmp_path / "a", tmp_path / "b")
    monkeypatch.delenv("ELASTRON_DATA_ROOTS")
    assert Settings.from_env().data_roots is None  # the runs root only


# -- sizes -----------------------------------------------------------------------------------------------------

def _over(path: tuple[str, ...], value) -> tuple[dict, list]:
    """A spec with the field at `path` set to `value`, and the loc the 422 must name."""
    spec: dict = {}
    d = spec
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value
    if path[0] == "model":
        spec["model"]["preset"] = "tiny"
    return with_spec(**spec), ["body", "spec", *path]


def test_the_reviews_huge_model_overrides_are_a_422_naming_the_field_and_the_limit(env):
    """Issue 15 item 2's reproduction: overrides of 2**56 once held a request thread for 13.9 s and were
    accepted. They are refused before any planning (the time is in docs/hardening.md, not asserted)."""
    big = 2**56
    body = {"spec": with_spec(model={"preset": "tiny", "overrides": {
        "dim": big, "n_heads": big, "n_kv_heads": big, "vocab_size": big, "ffn_hidden": big}})}
    r = env.post(J, json=body)
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "spec", "model", "overrides", "dim"]
    assert "at most 65536" in err["msg"] and str(big) in err["msg"]
    assert env.get(J).json() == []


MAXIMA = spec_maxima()


@pytest.mark.parametrize("path", sorted(p for p in MAXIMA if p[:2] != ("model", "resolved")), ids=".".join)
def test_every_size_over_its_limit_is_a_422_naming_it(env, path):
    """Each number's documented maximum (the schema /openapi.json shows) is the one the API enforces."""
    limit = MAXIMA[path]
    spec, loc = _over(path, limit + 1 if isinstance(limit, int) else limit * 2)
    r = env.post(J, json={"spec": spec})
    assert r.status_code == 422, r.text
    errs = r.json()["detail"]
    assert any(e["loc"] == loc and f"at most {limit}" in e["msg"] for e in errs), errs


def test_the_limits_are_documented_in_the_schema(env):
    defs = env.get("/openapi.json").json()["components"]["schemas"]
    assert defs["DataConfig"]["properties"]["seq_len"]["anyOf"][0]["maximum"] == 1 << 20
    assert defs["TrainConfig"]["properties"]["steps"]["maximum"] == 10**12
    assert defs["ResourcesConfig"]["properties"]["standby_per_node"]["maximum"] == 4


def test_too_many_suffixes_are_refused(env):
    r = env.post(J, json={"spec": with_spec(data={"suffixes": [f".x{i}" for i in range(65)]})})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "spec", "data", "suffixes"]


def test_memory_checkpoints_are_refused_for_jobs(env):
    """memory:// lives in one process: a restarted coordinator (or another worker) would find nothing."""
    r = env.post(J, json={"spec": with_spec(checkpoint={"dir": "memory://elastron/ck"})})
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "spec", "checkpoint", "dir"] and "restart" in err["msg"]


def test_the_default_data_roots_are_none_not_the_runs_root(tmp_path):
    """With no ELASTRON_DATA_ROOTS a job cannot read the runs root (other jobs' files, the job store)."""
    launcher, _ = make_launcher()
    with TestClient(make_app(tmp_path, launcher)) as c:
        runs = tmp_path / "runs"
        (runs / "other-job").mkdir(parents=True)
        (runs / "other-job" / "a.py").write_text("x = 1\n")
        r = c.post(J, json={"spec": with_spec(data={"source": "corpus", "path": str(runs / "other-job")})})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "spec", "data", "path"]
    stop_all(launcher)
    from service.server.job_manager import JobManager
    from api.store import JobStore

    with pytest.raises(ValueError, match="holds the runs root"):
        JobManager(JobStore(":memory:"), launcher, runs_root=tmp_path / "runs", data_roots=[tmp_path])
