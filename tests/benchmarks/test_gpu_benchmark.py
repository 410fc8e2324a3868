"""benchmarks/gpu.py runs on CPU with the tiniest settings and prints both loops side by side."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_equivalence import tiny_cfg

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
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 | no | none | none |")]
    assert [r.split("|")[5].strip() for r in rows] == ["elastron", "plain"], out.stdout
    ratio = float(rows[0].split("|")[9])
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


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--preset", "tiny", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_model_overrides_are_read_as_preset_fields():
    gpu = _gpu_module()
    p = argparse.Namespace(override=["vocab_size=512", "ffn_hidden = 256", "norm_eps=1e-6"], layers=2)
    assert gpu.model_overrides(p) == {"vocab_size": 512, "ffn_hidden": 256, "norm_eps": 1e-6, "n_layers": 2}
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        gpu.model_overrides(argparse.Namespace(override=["n_layers"], layers=None))


@pytest.mark.parametrize("args,needle", [
    (["--override", "n_layer=2"], "unknown field 'n_layer'"),
    (["--float8", "fp8"], "--float8 fp8: expected none, tensorwise or rowwise"),
    (["--loss-compare", "tensorwise"], "--loss-compare needs --data"),
    (["--loss-compare", "tensorwise,colwise"], "--loss-compare colwise: expected tensorwise and/or rowwise"),
])
def test_bad_arguments_fail_in_one_line(args, needle):
    out = _run(*args)
    assert out.returncode == 2 and needle in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]


def test_float8_rows_with_a_cut_model():
    """A 2-step emulated float8 run of both loops beside the same setting without float8, on the preset
    cut to 2 layers with another vocabulary: the rows, the float8 ratio line, and both loops' losses
    agreeing (the same torchao conversion on both sides)."""
    pytest.importorskip("torchao.float8")
    out = _run("--layers", "2", "--override", "vocab_size=512", "--seq-len", "16", "--micro-batches", "1",
               "--warmup", "1", "--steps", "2", "--float8", "none,tensorwise")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tiny {'vocab_size': 512, 'n_layers': 2}, seq 16" in out.stdout
    loops = [(r.split("|")[4].strip(), r.split("|")[5].strip()) for r in out.stdout.splitlines()
             if r.startswith("| 1 | no | none |")]
    assert loops == [("none", "elastron"), ("none", "plain"), ("tensorwise", "elastron"), ("tensorwise", "plain")]
    assert "float8: mb 1 compile no AC none tensorwise: " in out.stdout and "x elastron without float8" in out.stdout
    worst = float(out.stdout.split("losses: elastron and plain within ")[1].split()[0])
    assert worst < 1e-4


def test_loss_compare_on_text(tmp_path):
    """The float8-against-bf16 loss comparison, 3 emulated steps each on a directory of text, bf16 once for
    both recipes."""
    pytest.importorskip("torchao.float8")
    data = tiny_cfg()["data"]["val_path"]  # a directory of Python source
    out = _run("--layers", "2", "--seq-len", "16", "--loss-compare", "tensorwise,rowwise", "--data", data,
               "--loss-steps", "3", "--loss-window", "2", "--json", str(tmp_path / "lc.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    lc = json.loads((tmp_path / "lc.json").read_text())["loss_compare"]
    assert lc["steps"] == 3 and lc["window"] == 2
    assert [r["recipe"] for r in lc["rows"]] == ["tensorwise", "rowwise"]
    assert out.stderr.count("none: first loss") == 1  # bf16 trained once, for both
    for row in lc["rows"]:
        assert 0 < row["rel_diff"] < 0.01 and lc["mean_loss_none"] != row["mean_loss"]
        assert f"{row['recipe']} {row['mean_loss']:.4f}, relative difference {row['rel_diff']:.2%}" in out.stdout
