"""The head-loss recovery docs/deploy.md promises: a job resubmitted with the same run directory resumes
from the last committed checkpoint, and redoes nothing before it.

`elastron run` (api.run.run_job) on a private local Ray: a first run to step 6 (checkpoints at 4 and 6);
a resubmission to step 8 picks up at 6; then the newest checkpoint is left uncommitted (its manifest, the
commit record written last, removed, as when the head dies mid-save) and a resubmission to step 10 resumes
from step 6 again and retrains 7 and 8 to the same losses as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

JOB = {
    "name": "resume",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "seq_len": 32},
    # --steps is the run's length and its schedule's (issue 31): decay_steps pins the LR schedule, so that
    # submissions of 6, 8 and 10 steps train the same steps alike, as one interrupted run would
    "train": {"steps": 50, "decay_steps": 50, "global_batch_size": 4, "micro_batch_size": 2, "warmup_steps": 2,
              "seed": 3},
    "parallel": {"min_workers": 1, "max_workers": 1},
    "checkpoint": {"interval_steps": 4, "keep_last": 3, "async_save": False},
    "resources": {"device": "cpu", "cpus_per_worker": 1},
}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _resumed_steps(run_dir: Path) -> list[int]:
    """The step each submission's first worker group resumed at, from events.jsonl."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e["details"]["resumed_step"] for e in events if e["kind"] == "resize"]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from api.run import connect_ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ray.is_initialized():  # never reuse another test's cluster
        ray.shutdown()
    connect_ray(None)  # a private local Ray, as `elastron run` without --address starts
    yield
    ray.shutdown()


def test_resubmission_resumes_from_the_last_committed_checkpoint(local_ray, tmp_path, capsys):
    from api.run import run_job

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"

    def submit(steps: int) -> list[dict]:
        before = len(_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
        assert run_job(str(job), steps=steps, run_dir=str(run_dir), settle_seconds=0.5) == 0
        return _metrics(run_dir)[before:]

    first = submit(6)
    assert [m["step"] for m in first] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000004", "step-00000006"]

    second = submit(8)  # the same run directory, more steps
    assert [m["step"] for m in second] == [7, 8]
    assert _resumed_steps(run_dir) == [0, 6]

    # The head died while step 8 was being saved: its shards are there, its manifest is not.
    (ckpts / "step-00000008" / "manifest.json").unlink()
    third = submit(10)
    assert [m["step"] for m in third] == [7, 8, 9, 10], "must resume at 6 and redo only 7 and 8"
    assert _resumed_steps(run_dir) == [0, 6, 6]
    # Resumed state, not a restart under old step numbers: 7 and 8 retrain to the same losses.
    for again, before in zip(third[:2], second):
        assert again["loss"] == pytest.approx(before["loss"], rel=1e-5)
    assert "SUCCEEDED at step 10/10" in capsys.readouterr().out
