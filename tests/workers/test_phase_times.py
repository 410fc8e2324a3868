"""Trainer.phase_times, the seam benchmarks/throughput.py times a step through: while a dict is set, each
of PHASES gets the time spent in it, and together they stay within the step; unset, nothing is timed."""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist

CFG = {"model": {"preset": "tiny"}, "data": {"source": "synthetic", "seq_len": 16},
       "train": {"steps": 10, "global_batch_size": 4, "micro_batch_size": 2, "seed": 3},
       "checkpoint": {"interval_steps": 100}}


def body(cfg_dict: dict) -> dict:
    import time

    import torch

    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import PHASES, Trainer

    tr = Trainer(JobConfig.from_dict(cfg_dict), layout=Layout(), device=torch.device("cpu")).build()
    tr.train_step()  # untimed
    times: dict[str, float] = {}
    tr.phase_times = times
    real_step = tr.optimizer.step

    def slow_step(*a, **k):  # a phase known to take at least 50 ms
        time.sleep(0.05)
        return real_step(*a, **k)
    tr.optimizer.step = slow_step
    t0 = time.perf_counter()
    for _ in range(2):
        tr.train_step()
    wall = time.perf_counter() - t0
    timed = dict(times)
    tr.phase_times = None
    tr.train_step()
    return {"phases": list(PHASES), "times": timed, "after_unset": times, "wall": wall}


def test_each_phase_is_timed_within_the_step_and_only_while_asked():
    (got,) = run_ranks(1, body, CFG)
    times = got["times"]
    assert list(times) == got["phases"]
    assert all(v > 0 for v in times.values()), times
    assert 0.1 <= times["optimizer"] < got["wall"]  # the two 50 ms sleeps land in their phase
    assert sum(times.values()) <= got["wall"]
    assert got["after_unset"] == times  # the step after phase_times was unset added nothing
