"""Tier 3: `ray job submit --working-dir . -- elastron run job.yaml` against a local `ray start --head`.

The head runs with --block in its own process session and is torn down by killing that session, not
with `ray stop` (which would kill every Ray cluster on the machine, other tests' included).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _up(url: str) -> bool:
    """The dashboard answers HTTP (Ray 2.60 enables token auth by default, so 401 counts as up)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except urllib.error.HTTPError as e:
        return e.code in (401, 403)
    except OSError:
        return False


@pytest.fixture
def ray_head():
    # A short temp dir: Ray's Unix socket paths under pytest's long tmp_path exceed the 108-byte limit.
    tmp = tempfile.mkdtemp(prefix="rjs", dir="/tmp")
    gcs, dash = free_port(), free_port()
    # Ray 2.60 heads use token authentication; give the head and the client the same token explicitly
    # (what `ray get-auth-token --generate` would put in ~/.ray/auth_token), so the test does not
    # depend on that file.
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--num-cpus=2", f"--temp-dir={tmp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 90
        while not _up(f"{url}/api/version"):
            assert proc.poll() is None, f"ray start --head exited with {proc.returncode}"
            assert time.monotonic() < deadline, "Ray dashboard did not come up in 90 s"
            time.sleep(0.5)
        yield url, env
    finally:  # also when the head never came up: nothing may outlive the test
        # SIGKILL: on SIGTERM Ray drains for 30 s. Its daemons carry the temp dir on their command line.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        subprocess.run(["pkill", "-9", "-f", tmp], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_job_submit_runs_an_elastron_job(ray_head, tmp_path):
    url, env = ray_head
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 90
    while True:
        r = subprocess.run(
            [str(BIN / "ray"), "job", "submit", f"--address={url}", "--working-dir", str(ROOT), "--",
             "elastron", "run", "examples/tiny.yaml", "--steps", "4", "--workers", "1", "--run-dir", str(run_dir)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        # The dashboard answers before the head's job agent is up (seen on a loaded box): Ray says to retry.
        if "No available agent to submit job" not in r.stderr + r.stdout or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SUCCEEDED at step 4/4" in r.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert any(e["to_state"] == "SUCCEEDED" for e in map(json.loads, (run_dir / "events.jsonl").open()))
