"""benchmarks/gpu.py runs on CPU with the tiniest settings and prints both loops side by side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["--interleave", "--no-interleave"])  # the CPU default, the CUDA default
def test_cpu_tiny_run_prints_both_rows(mode):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--preset", "tiny",
           "--seq-len", "16", "--micro-batches", "1", "--warmup", "1", "--steps", "2", "--profile", mode]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 | no | none |")]
    assert [r.split("|")[4].strip() for r in rows] == ["elastron", "plain"], out.stdout
    ratio = float(rows[0].split("|")[8])
    assert ratio > 0
    assert "## profile: elastron" in out.stdout and "## profile: plain" in out.stdout
    assert "losses: elastron and plain within" in out.stdout
    assert ("paired (median over steps" in out.stdout) is (mode == "--interleave")
    assert ("interleaved;" in out.stdout) is (mode == "--interleave")
