"""Issue 29 item 6 / issue 31 item 7: Ctrl-C on `elastron run` ends with one line saying where the job
stands: no traceback, and no Ray call after the shutdown that would start or join another cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_ctrl_c_stops_the_job_and_says_so_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.Popen([sys.executable, "-m", "api.cli", "run", str(ROOT / "examples" / "tiny.yaml"), "--steps",
                          "100000", "--workers", "1", "--run-dir", str(tmp_path / "run")],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # as a terminal's Ctrl-C finds it: a suite started in the background (`cmd &`) passes
                         # SIGINT on ignored, and an ignored SIGINT never reaches Python's handler
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # it trains
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err and "Connecting to latest cluster" not in err, err
    ours = [line for line in err.splitlines() if line.startswith("elastron")]
    assert len(ours) == 1 and ours[0].startswith("elastron run: interrupted: job ") and "resumes" in ours[0], err
