"""benchmarks/gpu.py runs on CPU with the tiniest settings and prints both loops side by side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gpu_module():
    """benchmarks/gpu.py as a module (benchmarks/ is scripts, not a package)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu


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
    if mode == "--interleave":
        diff = out.stdout.split("## profile difference, micro batch 1, compile False, AC none")[1].splitlines()
        total = next(line for line in diff if line.startswith("| (total) |")).split("|")
        el_ms, pl_ms, d_ms = (float(x) for x in total[2:5])
        assert el_ms > 0 and pl_ms > 0 and d_ms == pytest.approx(el_ms - pl_ms, abs=0.011)


def test_profile_difference_lists_the_largest_gaps_first():
    gpu = _gpu_module()
    el = {"aten::mm": [10.0, 4.0], "aten::copy_": [3.0, 30.0], "only_elastron": [0.5, 1.0],
          gpu.TOTAL: [20.0, 0.0]}
    pl = {"aten::mm": [9.5, 4.0], "aten::copy_": [1.0, 10.0], "only_plain": [1.0, 2.0], gpu.TOTAL: [15.0, 0.0]}
    rows = gpu.profile_difference(el, pl).splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["aten::copy_", "only_plain", "aten::mm", "only_elastron",
                                                       "(total)"]
    assert rows[0].split("|")[4].strip() == "+2.00" and rows[1].split("|")[4].strip() == "-1.00"
    assert rows[-1].split("|")[4].strip() == "+5.00"


def test_a_profiler_marker_is_listed_by_its_count_after_the_totals_not_ranked_as_an_op():
    gpu = _gpu_module()
    el = {"aten::mm": [10.0, 4.0], gpu.TOTAL: [10.0, 0.0]}
    pl = {"aten::mm": [9.0, 4.0], "Command Buffer Full": [123.0, 263.0], gpu.TOTAL: [9.0, 0.0]}
    rows = gpu.profile_difference(el, pl).splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows][:2] == ["aten::mm", "(total)"]
    assert rows[2].startswith("| Command Buffer Full (a marker") and rows[2].split("|")[3].strip() == "(263)"
