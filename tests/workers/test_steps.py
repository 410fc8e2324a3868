"""`--steps` is the run's length and its LR schedule's: with --steps 10 on a 2000-step config the cosine
decays over those 10 steps (unless train.decay_steps fixes the decay), and `workers.train` trains with it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from workers.config import ConfigError, JobConfig, with_steps
from workers.lr import lr_at

ROOT = Path(__file__).resolve().parents[2]


def cfg(**train) -> JobConfig:
    return JobConfig.from_dict({"train": {"steps": 2000, "lr": 1e-3, "warmup_steps": 2, "min_lr_ratio": 0.1,
                                          "schedule": "cosine", **train}})


def test_steps_sets_the_schedule_length():
    t = with_steps(cfg(), 10).train
    assert t.steps == 10
    assert lr_at(6, t) == pytest.approx(5.5e-4)  # half way down the cosine at step 6 of 10 (2 of warmup)
    assert lr_at(6, cfg().train) > 0.999e-3  # what --steps 10 used to give: not decayed at all
    assert lr_at(9, t) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert with_steps(cfg(), None).train.steps == 2000


def test_decay_steps_still_fixes_the_schedule():
    t = with_steps(cfg(decay_steps=2000), 10).train
    assert lr_at(6, t) == lr_at(6, cfg().train)


@pytest.mark.parametrize("bad", [0, -3])
def test_steps_below_one_is_refused(bad):
    with pytest.raises(ConfigError, match=f"--steps must be >= 1, got {bad}"):
        with_steps(cfg(), bad)


def test_workers_train_decays_over_the_given_steps(tmp_path):
    r = subprocess.run([sys.executable, "-m", "workers.train", str(ROOT / "examples" / "tiny.yaml"), "--steps", "8",
                        "--run-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    want = with_steps(JobConfig.from_dict({"train": {"steps": 50, "lr": 0.003, "warmup_steps": 5,
                                                     "schedule": "cosine"}}), 8).train
    assert [m["step"] for m in rows] == list(range(1, 9))
    assert [m["lr"] for m in rows] == pytest.approx([lr_at(s, want) for s in range(8)])
    assert rows[-1]["lr"] < 0.4 * 0.003  # two thirds down the cosine at the last of 8 steps (of 50: ~0.003)
