"""The torchrun contract of workers.train, and its one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")


def run_train(*args, env=None):
    return subprocess.run([sys.executable, "-m", "workers.train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args,needle", [
    (["--layout", "dp=2,tp=2"], "needs 4 ranks"),
    (["--layout", "dp=2,warp=1"], "unknown layout key 'warp'"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_invalid_layout_or_steps_exit_nonzero_with_one_line(tmp_path, args, needle):
    r = run_train(TINY, "--run-dir", str(tmp_path), *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


def test_invalid_config_exits_nonzero_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  global_batch_size: many\n")
    r = run_train(str(bad), "--run-dir", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip() == "error: train.global_batch_size: expected an integer, got 'many' (str)"


@pytest.mark.dist
def test_torchrun_trains_dp2_pp2_and_writes_metrics(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run([str(torchrun), "--nproc_per_node", "4", "-m", "workers.train", TINY,
                        "--layout", "dp=2,tp=1,pp=2", "--steps", "3", "--run-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "layout", "world_size", "time"} <= m.keys()
        assert m["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2} and m["world_size"] == 4
        assert 0 < m["loss"] < 10 and m["grad_norm"] > 0
    assert [m["tokens"] for m in rows] == [8 * 64, 16 * 64, 24 * 64]  # global batch 8 x seq_len 64
