"""`elastron submit|jobs|status|resize|pause|resume|stop|events` against a live server on 127.0.0.1."""

from __future__ import annotations

import argparse

import pytest
import yaml

from api.cli_client import add_client_commands
from tests.api.helpers import SPEC, live_server, make_app, make_launcher, stop_all, wait_for
from tests.fakes import Gate
from tests.ports import free_port


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="elastron")
    add_client_commands(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    return args.fn(args)


@pytest.fixture
def server(tmp_path, monkeypatch):
    gate = Gate(limit=3)
    launcher, _ = make_launcher(gate=gate)
    with live_server(make_app(tmp_path, launcher, token="tok")) as url:
        monkeypatch.setenv("ELASTRON_SERVER", url)
        monkeypatch.setenv("ELASTRON_API_TOKEN", "tok")
        yield url, gate
    stop_all(launcher)


def test_the_whole_job_lifecycle_from_the_command_line(server, tmp_path, capsys):
    url, gate = server
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(SPEC))
    assert run(["submit", str(job_yaml), "--steps", "30", "-q"]) == 0
    job_id = capsys.readouterr().out.strip()
    assert len(job_id) == 12

    def status() -> str:
        assert run(["status", job_id]) == 0
        return capsys.readouterr().out

    out = wait_for(lambda: "3/30" in (s := status()) and s, what="step 3 in `elastron status`")
    assert f"job {job_id} (tiny)" in out and "RUNNING" in out and "dp=4 tp=1 pp=1" in out

    assert run(["jobs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["id", "name", "state", "prio", "step", "loss", "tokens/s", "workers", "layout"]
    assert lines[2].split()[:5] == [job_id, "tiny", "RUNNING", "0", "3/30"]

    assert run(["resize", job_id, "2"]) == 0
    assert f"resize of job {job_id} accepted" in capsys.readouterr().out
    wait_for(lambda: "dp=2 tp=1 pp=1" in status(), what="resized layout in `elastron status`")

    assert run(["pause", job_id]) == 0
    assert "pause of job" in capsys.readouterr().out
    wait_for(lambda: "PAUSED" in status(), what="PAUSED")
    assert run(["resume", job_id]) == 0
    capsys.readouterr()
    wait_for(lambda: "RUNNING" in status(), what="RUNNING")
    assert run(["stop", job_id]) == 0
    capsys.readouterr()
    wait_for(lambda: "STOPPED" in status(), what="STOPPED")

    assert run(["events", job_id]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["time", "step", "kind", "state", "cause", "reason"]
    for text in ("RUNNING -> PAUSED", "PAUSED -> STARTING", "-> STOPPED", "resize"):
        assert text in out, text


def test_api_errors_are_one_line_and_exit_1(server, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**SPEC, "parallel": {"tp": 3}}))
    assert run(["submit", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elastron: error: 422 spec.parallel.tp: ")
    assert "tp=3 does not divide n_heads=4" in err[0]

    assert run(["status", "nope"]) == 1
    assert capsys.readouterr().err.strip() == "elastron: error: 404 no job with id 'nope'"

    assert run(["pause", "nope", "--token", "wrong"]) == 1
    assert capsys.readouterr().err.strip() == "elastron: error: 403 wrong API token"


def test_a_job_file_that_cannot_be_read_is_exit_2(server, tmp_path, capsys):
    assert run(["submit", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert run(["submit", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not valid YAML" in err[0]


def test_a_server_that_does_not_answer_is_one_line_naming_the_url(capsys, monkeypatch):
    port = free_port()  # nothing listens on it
    monkeypatch.delenv("ELASTRON_SERVER", raising=False)
    assert run(["jobs", "--server", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot reach the Elastron server at http://127.0.0.1:{port}" in err[0]


def test_a_queued_job_shows_its_place_in_the_queue():
    from api.cli_client import _state

    assert _state({"state": "QUEUED", "queue_position": 2}) == "QUEUED #2"
    assert _state({"state": "RUNNING", "queue_position": None}) == "RUNNING"
