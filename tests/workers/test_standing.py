"""What a worker answers a coordinator that takes it over (`Worker.standing`): sound, with its rank, plan,
step and the rows of its last call, only while it trains in a group whose last call did not fail."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist

CFG = {"model": {"preset": "tiny"}, "data": {"source": "synthetic", "seq_len": 16},
       "train": {"steps": 10, "global_batch_size": 4, "micro_batch_size": 2, "seed": 3},
       "checkpoint": {"interval_steps": 100}}


def body(run_dir: str) -> dict:
    from parallel.layout import Layout
    from parallel.planner import Plan
    from workers.actor import Worker
    from workers.config import JobConfig

    plan = Plan(layout=Layout(), world_size=1, available=1, micro_batch_size=2, grad_accum_steps=2,
                memory_bytes=0.0, reasons=())
    w = Worker(JobConfig.from_dict(CFG), run_dir)
    out = {"fresh": w.standing()}

    def join():
        w.join(rank=0, world_size=1, master_addr="127.0.0.1", master_port=w.open_store(), plan=plan)
    join()
    w.run(until_step=10, steps=3)
    out["trained"] = w.standing()

    def peer_died(batch):
        raise RuntimeError("Connection closed by peer")
    w.trainer.on_batch = peer_died
    try:
        w.run(until_step=10, steps=1)
    except RuntimeError:
        pass
    out["failed"] = w.standing()
    join()  # a new group: sound again
    out["rejoined"] = w.standing()
    w.leave()
    out["left"] = w.standing()
    return {k: asdict(v) for k, v in out.items()} | {"plan": asdict(plan)}


def test_a_worker_stands_sound_only_while_it_trains_in_a_group_whose_last_call_did_not_fail(tmp_path):
    (got,) = run_ranks(1, body, str(tmp_path))
    assert got["fresh"]["sound"] is False and got["fresh"]["why"] == "it is in no training group"
    trained = got["trained"]
    assert trained["sound"] and trained["rank"] == 0 and trained["step"] == 3 and trained["plan"] == got["plan"]
    assert [r["step"] for r in trained["rows"]] == [1, 2, 3]  # the last call's rows, for a coordinator that lost them
    assert not got["failed"]["sound"] and got["failed"]["why"] == "a step of its last call failed"
    assert got["rejoined"]["sound"] and got["rejoined"]["step"] == 0  # resumed from the start: nothing committed
    assert not got["left"]["sound"] and got["left"]["why"] == "it is in no training group"
