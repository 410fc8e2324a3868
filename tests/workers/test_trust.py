"""workers.trust: whether a worker's shards outlive a peer's failure, row by row."""

from __future__ import annotations

import pytest

from workers.trust import StateFacts, Trust, trust

ROWS = [
    # has_trainer, updated_mid_step, save_running -> held, why, reusable
    (False, False, False, False, "no trainer", True),
    (False, True, True, False, "no trainer", True),
    (True, False, False, True, None, False),
    (True, True, False, False, "the failure struck after a weight update", True),
    (True, False, True, False, "a checkpoint save was still running", False),
    (True, True, True, False, "a checkpoint save was still running", False),
]


@pytest.mark.parametrize("has_trainer,updated,save_running,held,why,reusable", ROWS)
def test_a_worker_holds_its_shards_only_with_a_trainer_no_save_running_and_weights_at_the_seen_step(
        has_trainer, updated, save_running, held, why, reusable):
    got = trust(StateFacts(has_trainer=has_trainer, updated_mid_step=updated, save_running=save_running))
    assert got == Trust(held=held, why=why, reusable=reusable)
