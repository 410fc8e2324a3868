"""Bad inputs (issue #8 item 3): each is refused with one clear line, and nothing is lost.

The surface a user sees is asserted as they see it: `elastron ...` as a process or through `api.cli.main`
(exit code != 0 and exactly one line on stderr naming the problem and what to do), or the job API (4xx with
a JSON detail naming the field); "nothing lost" on disk: a rejected command or request creates nothing.

Here: job configs (wrong types, unknown keys, impossible layouts, missing or unreadable data), a run
directory that cannot be written, a Ray address that does not answer, oversized and path-traversing API
requests (the full path list is tests/api/test_request_limits.py). Bad checkpoints (truncated, bit-flipped,
a manifest naming a missing file, another model's shape): tests/chaos/test_bad_checkpoints.py.
"""

from __future__ import annotations

import copy
import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from api.cli import main
from tests.api.helpers import make_app, make_launcher, stop_all
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
J = "/api/v1/jobs"
CFG = {
    "name": "bad-inputs",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "seq_len": 16},
    "train": {"steps": 8, "global_batch_size": 4, "micro_batch_size": 2, "warmup_steps": 1},
    "parallel": {"min_workers": 1, "max_workers": 4},
    "checkpoint": {"interval_steps": 2, "keep_last": 5, "async_save": False},
    "resources": {"device": "cpu"},
}


# -- helpers -----------------------------------------------------------------------------------------------

def patched(base: dict, **sections) -> dict:
    out = copy.deepcopy(base)
    for k, v in sections.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def write_cfg(path: Path, cfg: dict) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def elastron(*args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr[-3000:]}"
    return lines[0]


def tree(path: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `path` (what "nothing changed" compares)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


# -- 5: job configs --------------------------------------------------------------------------------------------

def bad_configs(data: Path) -> list[tuple[str, dict, list, str]]:
    """(id, spec, the field's path in the spec, what the CLI's line says)."""
    return [
        ("wrong type", patched(CFG, train={"steps": "ten"}), ["train", "steps"],
         "train.steps: expected an integer, got 'ten' (str)"),
        ("unknown key", patched(CFG, train={"stepz": 3}), ["train", "stepz"], "train: unknown field 'stepz'"),
        ("unknown section", {**CFG, "trian": {}}, ["trian"], "config: unknown field 'trian'"),
        ("tp does not divide the heads", patched(CFG, parallel={"layout": "tp=3"}), ["parallel", "layout"],
         "tp=3 does not divide the model's n_heads=4"),
        ("dp does not divide the batch", patched(CFG, parallel={"layout": "dp=3"}), ["parallel", "layout"],
         "dp=3 does not divide train.global_batch_size=4"),
        ("too few microbatches for pp", patched(CFG, parallel={"layout": "dp=2,pp=4"}), ["parallel", "layout"],
         "pp=4 needs >= 4 microbatches per step but dp=2 leaves 2 samples per DP rank"),
        ("missing data path", patched(CFG, data={"source": "corpus", "path": str(data / "missing")}),
         ["data", "path"], "does not exist"),
        ("dangling symlink", patched(CFG, data={"source": "tokens", "path": str(data / "dangling.bin")}),
         ["data", "path"], "does not exist"),
        ("a file where a directory is needed", patched(CFG, data={"source": "corpus", "path": str(data / "t.bin")}),
         ["data", "path"], "must be a directory for source 'corpus'"),
        ("a corpus without files", patched(CFG, data={"source": "corpus", "path": str(data / "empty")}),
         ["data", "path"], "holds no readable file ending with ['.py']"),
        ("an unreadable corpus", patched(CFG, data={"source": "corpus", "path": str(data / "locked")}),
         ["data", "path"], "is not readable"),
    ]


@pytest.fixture
def data_dir(tmp_path) -> Path:
    data = tmp_path / "data"
    (data / "empty").mkdir(parents=True)
    (data / "empty" / "notes.txt").write_text("not python\n")
    (data / "t.bin").write_bytes(b"\x00\x01" * 64)
    (data / "dangling.bin").symlink_to(data / "gone.bin")
    (data / "locked").mkdir()
    (data / "locked" / "a.py").write_text("print('hi')\n" * 10)
    (data / "locked").chmod(0)
    yield data
    (data / "locked").chmod(0o755)


def _skip_unreadable_as_root(case: str) -> None:
    if case == "an unreadable corpus" and os.geteuid() == 0:
        pytest.skip("running as root, which reads a mode-000 directory; the other data cases still run")


CONFIG_IDS = [c[0] for c in bad_configs(Path("/x"))]


@pytest.mark.parametrize("case", CONFIG_IDS)
def test_elastron_train_refuses_a_bad_config_in_one_line_and_creates_nothing(data_dir, tmp_path, capsys, case):
    _skip_unreadable_as_root(case)
    _, spec, _, needle = next(c for c in bad_configs(data_dir) if c[0] == case)
    run_dir = tmp_path / "run"
    assert main(["train", write_cfg(tmp_path / "cfg.yaml", spec), "--run-dir", str(run_dir), "--nproc", "1"]) == 2
    captured = capsys.readouterr()
    err = one_line(captured.err)
    assert err.startswith("elastron: error: ") and needle in err, err
    assert captured.out == "" and not run_dir.exists()


def test_the_real_command_exits_2_with_one_line(tmp_path):
    r = elastron("train", write_cfg(tmp_path / "cfg.yaml", patched(CFG, train={"steps": "ten"})),
                 "--run-dir", str(tmp_path / "run"), timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert one_line(r.stderr) == "elastron: error: train.steps: expected an integer, got 'ten' (str)"


def test_a_corpus_too_short_for_one_sample_is_one_line_from_the_rank(tmp_path):
    """Found only when a rank reads the data; still one line and exit 2, before any step."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.py").write_text("x = 1")
    cfg = patched(CFG, data={"source": "corpus", "path": str(tmp_path / "data")})
    r = elastron("train", write_cfg(tmp_path / "cfg.yaml", cfg), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert one_line(r.stderr) == (f"error: data: corpus '{tmp_path / 'data'}' has 6 bytes in 1 files; "
                                  "need at least seq_len + 1 = 17")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_layout_flag_that_cannot_fit_is_refused_before_any_rank_starts(tmp_path, capsys):
    cfg = write_cfg(tmp_path / "cfg.yaml", CFG)
    assert main(["train", cfg, "--run-dir", str(tmp_path / "run"), "--nproc", "3", "--layout", "dp=3"]) == 2
    err = one_line(capsys.readouterr().err)
    assert err == ("elastron: error: layout dp=3,tp=1,pp=1: dp=3 does not divide train.global_batch_size=4; "
                   "use a dp that does, or another batch")
    assert main(["train", cfg, "--run-dir", str(tmp_path / "run"), "--nproc", "3", "--layout", "tp=3"]) == 2
    assert "tp=3 does not divide the model's n_heads=4" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.fixture
def api(tmp_path):
    launcher, _ = make_launcher()
    app = make_app(tmp_path, launcher, max_body_bytes=4096, data_roots=(tmp_path / "data",))
    with TestClient(app) as c:
        c.tmp = tmp_path
        yield c
    stop_all(launcher)


@pytest.mark.parametrize("case", CONFIG_IDS)
def test_the_api_refuses_a_bad_config_with_422_naming_the_field(api, data_dir, case):
    _skip_unreadable_as_root(case)
    _, spec, loc, needle = next(c for c in bad_configs(data_dir) if c[0] == case)
    r = api.post(J, json={"spec": spec, "steps": 2})
    assert r.status_code == 422, r.text
    err = r.json()["detail"][0]
    assert err["loc"] == ["body", "spec", *loc], err
    if loc[-1] not in ("steps", "stepz", "trian"):  # those three are pydantic's own words at the edge
        assert needle in err["msg"], err
    assert "\n" not in err["msg"]
    assert api.get(J).json() == []
    assert not (api.tmp / "runs").exists() or not any((api.tmp / "runs").iterdir())


# -- 6: a run directory that cannot be written ------------------------------------------------------------------

def test_a_run_dir_under_a_file_fails_before_any_rank_starts(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file, not a directory\n")
    assert main(["train", write_cfg(tmp_path / "cfg.yaml", CFG), "--run-dir", str(blocker / "run")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # rank 0 prints every step: none ran (a rank's own failure would be a traceback)
    assert one_line(captured.err) == (f"elastron: error: run directory '{blocker / 'run'}' cannot be created: "
                                      f"'{blocker}' is not a directory; pick another path (--run-dir)")
    assert blocker.read_text() == "a file, not a directory\n"


def test_a_checkpoint_dir_under_a_file_fails_the_same_way(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    cfg = patched(CFG, checkpoint={"dir": str(blocker / "ck")})
    assert main(["train", write_cfg(tmp_path / "cfg.yaml", cfg), "--run-dir", str(tmp_path / "run")]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"checkpoint.dir '{blocker / 'ck'}' cannot be created" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-500 directory; the file case covers it")
def test_a_read_only_run_dir_fails_before_any_rank_starts(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        assert main(["train", write_cfg(tmp_path / "cfg.yaml", CFG), "--run-dir", str(ro)]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"run directory '{ro}' is not writable: permission denied" in err
    finally:
        ro.chmod(0o700)


def test_elastron_run_checks_the_run_dir_before_starting_ray(tmp_path, capsys):
    import ray

    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main(["run", write_cfg(tmp_path / "cfg.yaml", CFG), "--run-dir", str(blocker / "run")]) == 2
    assert "cannot be created" in one_line(capsys.readouterr().err)
    assert not ray.is_initialized()


@pytest.mark.parametrize("cfg,args,needle", [
    (patched(CFG, parallel={"tp": 3}), [], "no parallel layout can run this job: no valid layout on 4 down to 1 "
                                           "workers"),
    (CFG, ["--workers", "0"], "--workers must be >= 1, got 0"),
], ids=["tp that divides no head count", "no workers"])
def test_elastron_run_judges_the_layout_before_starting_ray(tmp_path, capsys, cfg, args, needle):
    """As the API does at submit: the coordinator cannot tell a job no layout fits from one short of
    capacity, so it would wait in WAITING_FOR_CAPACITY for good."""
    import ray

    assert main(["run", write_cfg(tmp_path / "cfg.yaml", cfg), "--run-dir", str(tmp_path / "run"), *args]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("elastron: error: ") and needle in err, err
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


# -- 7: a Ray address that does not answer ----------------------------------------------------------------------

def test_elastron_run_with_a_dead_ray_address_fails_fast_in_one_line(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = elastron("run", write_cfg(tmp_path / "cfg.yaml", CFG), "--address", address, "--run-dir",
                 str(tmp_path / "run"), timeout=60)
    assert r.returncode == 1
    err = one_line(r.stderr)
    assert err.startswith(f"elastron: error: cannot connect to Ray at {address}: nothing answers there "), err
    assert time.monotonic() - t0 < 60


def test_elastron_serve_with_a_dead_ray_address_fails_fast_naming_it(tmp_path):
    address, port = f"127.0.0.1:{free_port()}", free_port()
    t0 = time.monotonic()
    r = elastron("serve", "--address", address, "--port", str(port), timeout=60,
                 env={"ELASTRON_RUNS_ROOT": str(tmp_path / "runs")})
    assert r.returncode == 1 and time.monotonic() - t0 < 60
    # serve logs its settings first (api/app.py); the failure itself is one line naming the address.
    (err,) = [line for line in r.stderr.splitlines() if "ERROR" in line or "Traceback" in line]
    assert f"cannot start: cannot connect to Ray at {address}: nothing answers there" in err, r.stderr
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # it never bound the API port


def test_an_address_that_times_out_is_bounded(monkeypatch):
    from api import run

    def silent(addr, timeout):
        assert timeout == 2.0 and addr == ("10.1.2.3", 6379)
        raise TimeoutError("timed out")

    monkeypatch.setattr(run.socket, "create_connection", silent)
    monkeypatch.setenv("ELASTRON_RAY_CONNECT_TIMEOUT_S", "2")
    with pytest.raises(ConnectionError, match=r"nothing answers there \(no answer within 2 s\)"):
        run.probe_address("10.1.2.3:6379")
    with pytest.raises(ConnectionError):
        run.probe_address("ray://10.1.2.3:6379")
    run.probe_address("auto")  # not host:port: left to Ray


# -- 8: hostile requests (the full list: tests/api/test_request_limits.py) ---------------------------------------

def test_an_oversized_body_is_413_json_and_records_nothing(api):
    r = api.post(J, json={"spec": {**CFG, "name": "x" * 5000}})
    assert r.status_code == 413 and r.json() == {"detail": "request body is larger than the server's limit of "
                                                           "4096 bytes"}
    assert api.get(J).json() == []


@pytest.mark.parametrize("body,loc,needle", [
    ({"run_dir": "../../etc"}, ["run_dir"], "must not contain '..'"),
    ({"spec": patched(CFG, checkpoint={"dir": "/etc/elastron"})}, ["spec", "checkpoint", "dir"],
     "inside the runs root"),
    ({"spec": patched(CFG, data={"source": "tokens", "path": "/etc/passwd"})}, ["spec", "data", "path"],
     "outside the server's data roots"),
], ids=["run_dir", "checkpoint.dir", "data.path"])
def test_path_traversal_is_422_naming_the_field(api, body, loc, needle):
    r = api.post(J, json={"spec": CFG, "steps": 2, **body})
    assert r.status_code == 422, r.text
    err = r.json()["detail"][0]
    assert err["loc"] == ["body", *loc] and needle in err["msg"], err
    assert api.get(J).json() == []
