"""What a survivor of a failure may vouch for (Trainer.salvage_state): a step that failed before its weight
update leaves the weights at the last finished step and only the data position moved, which is put back;
one that failed after the update (before its loss was out) is not salvaged."""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks

pytestmark = pytest.mark.dist

CFG = {"model": {"preset": "tiny"}, "data": {"source": "synthetic", "seq_len": 16},
       "train": {"steps": 10, "global_batch_size": 4, "micro_batch_size": 2, "seed": 3},
       "checkpoint": {"interval_steps": 100}}


def body(cfg_dict: dict) -> dict:
    import torch

    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    tr = Trainer(JobConfig.from_dict(cfg_dict), layout=Layout(), device=torch.device("cpu")).build()
    tr.train_step()
    clean = tr.salvage_state()
    at_step_1 = tr.loader.state_dict()

    def peer_died(batch):
        raise RuntimeError("Connection closed by peer")
    tr.on_batch = peer_died  # the batch is drawn, then a collective fails: weights untouched
    with pytest.raises(RuntimeError):
        tr.train_step()
    moved = tr.loader.state_dict() != at_step_1
    before_update = tr.salvage_state()
    rewound = tr.loader.state_dict() == at_step_1

    tr.on_batch = None
    real_step = tr.optimizer.step

    def dies_after_update(*a, **k):
        real_step(*a, **k)
        raise RuntimeError("killed after the update")
    tr.optimizer.step = dies_after_update
    with pytest.raises(RuntimeError):
        tr.train_step()
    return {"clean_step": clean["lr_schedule"]["step"], "moved": moved, "rewound": rewound,
            "before_step": before_update["lr_schedule"]["step"], "before_data": before_update["data"],
            "clean_data": clean["data"], "after_update": tr.salvage_state()}


def test_salvage_rewinds_a_step_that_failed_before_its_update_and_refuses_one_after(tmp_path):
    (got,) = run_ranks(1, body, CFG)
    assert got["clean_step"] == got["before_step"] == 1
    assert got["moved"] and got["rewound"] and got["before_data"] == got["clean_data"]
    assert got["after_update"] is None
