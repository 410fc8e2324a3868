"""Whose checkpoint a job resumes (issue 15, item 1): another job's, or one written under another model
config, is refused in one line unless `checkpoint.resume_from` names it; a named foreign directory is
read, never written, cleaned or set aside."""

from __future__ import annotations

import os

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist


def spec(name: str, ckpt_dir: str, **ckpt) -> dict:
    return {"name": name, "model": {"preset": "tiny"}, "data": {"source": "synthetic", "seq_len": 16},
            "train": {"steps": 10, "global_batch_size": 4, "micro_batch_size": 2, "seed": 3},
            "checkpoint": {"dir": ckpt_dir, "interval_steps": 1, "async_save": False, **ckpt}}


def body(first: dict, attempts: list[dict], fit_steps: int = 2) -> list:
    import torch

    from parallel.checkpoint.errors import CheckpointError
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    cpu = torch.device("cpu")
    if first:
        Trainer(JobConfig.from_dict(first), layout=Layout(), device=cpu).build().fit(fit_steps)
    out = []
    for d in attempts:
        try:
            t = Trainer(JobConfig.from_dict(d), layout=Layout(), device=cpu).build()
            out.append(["resumed", t.step])
        except CheckpointError as e:
            out.append(["refused", str(e)])
    return out


def test_another_jobs_or_another_models_checkpoint_is_refused_unless_named(tmp_path):
    mine = str(tmp_path / "a")
    other_model = spec("a", mine)
    other_model["model"]["overrides"] = {"rope_theta": 500000.0}
    (got,) = run_ranks(1, body, spec("a", mine), [
        spec("b", mine),                          # another job pointed at a's directory
        other_model,                              # same job name, another model config
        spec("b", mine, resume_from=mine),        # named on purpose: the check is waived
        spec("a", mine),                          # a itself
    ])
    (k1, why1), (k2, why2), named, own = got
    assert k1 == "refused" and "job 'a' wrote it and this job is 'b'" in why1 and "checkpoint.resume_from" in why1
    assert k2 == "refused" and "another model config (rope_theta differ)" in why2
    assert named == ["resumed", 2] and own == ["resumed", 2]


def test_a_named_foreign_directory_is_read_only_and_used_only_until_the_job_has_its_own(tmp_path):
    theirs, mine = str(tmp_path / "theirs"), str(tmp_path / "mine")
    (setup,) = run_ranks(1, body, spec("a", theirs), [])
    assert setup == []
    stale = os.path.join(theirs, ".step-00000009.tmp")  # a's save in progress: must survive b's start
    os.makedirs(stale)
    before = sorted(os.listdir(theirs))
    (got,) = run_ranks(1, body, {}, [spec("b", mine, resume_from=theirs)])
    assert got == [["resumed", 2]]
    assert sorted(os.listdir(theirs)) == before and os.path.isdir(stale)
    # Once b has a checkpoint of its own, that is what it resumes: b goes on to step 4 in its own
    # directory, and a restart resumes at 4, not at a's 2.
    (again,) = run_ranks(1, body, spec("b", mine, resume_from=theirs), [spec("b", mine, resume_from=theirs)], 4)
    assert again == [["resumed", 4]] and sorted(os.listdir(theirs)) == before


def defaulted_seq_len_runs(straight_dir: str, split_dir: str) -> dict:
    import json

    import torch

    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    def cfg(ckpt_dir: str) -> JobConfig:
        s = spec("d", ckpt_dir)
        del s["data"]["seq_len"]  # taken from the model: min(128, 32)
        s["model"]["overrides"] = {"max_seq_len": 32}
        return JobConfig.from_dict(s)

    cpu = torch.device("cpu")
    straight = [m.loss for m in Trainer(cfg(straight_dir), layout=Layout(), device=cpu).build().fit(4)]
    first = cfg(split_dir)
    split = [m.loss for m in Trainer(first, layout=Layout(), device=cpu).build().fit(2)]
    again = JobConfig.from_dict(json.loads(json.dumps(first.to_dict())))  # as a restarted job reads it back
    t = Trainer(again, layout=Layout(), device=cpu).build()
    saved, resumed = t.resumed_from.state["job_config_digest"], t.step
    split += [m.loss for m in t.fit(4)]
    return {"seq_len": again.data.seq_len, "resumed": resumed, "digests": [saved, again.digest()],
            "straight": straight, "split": split}


def test_a_defaulted_seq_len_resumes_identically(tmp_path):
    (got,) = run_ranks(1, defaulted_seq_len_runs, str(tmp_path / "straight"), str(tmp_path / "split"))
    assert got["seq_len"] == 32 and got["resumed"] == 2
    assert got["digests"][0] == got["digests"][1]  # the checkpoint's config is this job's, unchanged
    assert got["split"] == pytest.approx(got["straight"], rel=1e-4) and len(got["split"]) == 4
