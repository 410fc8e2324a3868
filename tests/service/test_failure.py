"""The failure policy (service.control.failure), row by row: every expected answer is written out."""

from __future__ import annotations

import pytest

from parallel.layout import Layout
from service.control.failure import (PATIENCE_S, RESTORE_PATIENCE_S, During, Facts, Response, classify, live_gap,
                                     respond)
from service.pool.group import FailureKind as K
from workers.report import Salvaged
from tests.fakes import metrics_row

T, R, X, A = During.TRAINING, During.RESTORE, During.TRANSFER, During.TAKEOVER
NO_SALVAGE = "storage"

# kind, during, live_reshard, holds_group, snapshots -> salvage, abort, patience_s, heal, memory
ROWS = [
    # a node lost in training, however noticed: salvage, abort the survivors' collectives, full patience
    (K.NODE_LOST, T, True, True, False, True, True, 15.0, True, False),
    (K.NODE_LOST, T, True, True, True, True, True, 15.0, True, True),
    (K.WORKER_DIED, T, True, True, True, True, True, 15.0, True, True),
    (K.TIMED_OUT, T, True, True, False, True, True, 15.0, True, False),
    (K.WORKER_RAISED, T, True, True, True, True, True, 15.0, True, True),
    # storage resharding, or no group: nothing to salvage, whatever the kind
    (K.NODE_LOST, T, False, True, True, False, True, 15.0, False, False),
    (K.WORKER_DIED, R, False, True, False, False, True, 15.0, False, False),
    (K.NODE_LOST, T, True, False, True, False, True, 15.0, False, False),
    (K.START_FAILED, R, True, False, False, False, True, 15.0, False, False),
    # a failed transfer: the live state went with it; only peer snapshots, when on
    (K.NODE_LOST, X, True, True, False, False, True, 15.0, False, False),
    (K.WORKER_DIED, X, True, True, False, False, True, 15.0, False, False),
    (K.NODE_LOST, X, True, True, True, True, True, 15.0, False, True),
    (K.TIMED_OUT, X, True, True, True, True, True, 15.0, False, True),
    # a failed re-form from storage: those that answer at once stay warm
    (K.NODE_LOST, R, True, True, False, True, True, 1.0, True, False),
    (K.OUT_OF_STEP, R, True, True, True, True, True, 1.0, True, True),
    # a restarted coordinator takes over: no peer died, so no abort
    (K.COORDINATOR_RESTARTED, A, True, True, False, True, False, 15.0, True, False),
    (K.COORDINATOR_RESTARTED, A, True, True, True, True, False, 15.0, True, True),
    (K.COORDINATOR_RESTARTED, A, False, True, True, False, True, 15.0, False, False),
]


@pytest.mark.parametrize("kind, during, live, group, snaps, salvage, abort, patience, heal, memory", ROWS)
def test_the_response_to_each_failure(kind, during, live, group, snaps, salvage, abort, patience, heal, memory):
    r = respond(Facts(kind=kind, during=during, live_reshard=live, holds_group=group, snapshots=snaps))
    assert (r.salvage, r.abort, r.patience_s, r.heal, r.memory) == (salvage, abort, patience, heal, memory)
    assert (r.why_not == "") == salvage  # no salvage always says why
    assert r.source_family == ("survivors" if salvage else NO_SALVAGE)


def test_the_patience_constants_are_the_ones_the_table_names():
    assert (PATIENCE_S, RESTORE_PATIENCE_S) == (15.0, 1.0)


@pytest.mark.parametrize("during, snaps, why", [
    (X, False, "the workers handed their state over to the transfer that failed, and peer snapshots are off"),
    (T, True, None),
])
def test_a_failed_transfer_without_snapshots_says_why_nothing_is_kept(during, snaps, why):
    r = respond(Facts(kind=K.NODE_LOST, during=during, live_reshard=True, holds_group=True, snapshots=snaps))
    assert r.why_not == (why or "")


# reported, a node of the group found dead -> the kind it counts as
KINDS = [
    (K.WORKER_DIED, True, K.NODE_LOST),
    (K.TIMED_OUT, True, K.NODE_LOST),
    (K.NODE_LOST, True, K.NODE_LOST),
    (K.NODE_LOST, False, K.NODE_LOST),
    (K.WORKER_DIED, False, K.WORKER_DIED),
    (K.TIMED_OUT, False, K.TIMED_OUT),
    (K.WORKER_RAISED, True, K.WORKER_RAISED),
    (K.CONFIG_REJECTED, True, K.CONFIG_REJECTED),
]


@pytest.mark.parametrize("reported, on_dead_node, counted", KINDS)
def test_one_node_loss_is_one_kind_whoever_noticed_it(reported, on_dead_node, counted):
    assert classify(reported, on_dead_node=on_dead_node) is counted


DP2 = Layout(dp_replicate=2)
TP2 = Layout(tp=2)


def held(rank, step, rows=None):
    return Salvaged(held=True, step=step, old_rank=rank, rows=tuple(metrics_row(s) for s in (rows or [step])))


@pytest.mark.parametrize("layout, answers, last_step, why", [
    (DP2, {0: held(0, 7)}, 7, None),  # one replica holds everything
    (DP2, {0: held(0, 7), 1: held(1, 7)}, 7, None),
    (DP2, {0: held(0, 8)}, 7, None),  # the step its interrupted call finished came back with its rows
    (DP2, {}, 7, "no worker answered with state it can vouch for"),
    (DP2, {0: Salvaged(held=False, why="no trainer", old_rank=0, snapshots={0: (6,)})}, 7,
     "no worker answered with state it can vouch for"),
    (DP2, {0: held(0, 7), 1: Salvaged(held=False, old_rank=1, snapshots={1: (6,)})}, 7,
     "ranks [1] cannot vouch for their live state"),
    (DP2, {0: held(0, 7), 1: held(1, 8)}, 7, "the survivors stopped at different steps [7, 8]"),
    (TP2, {0: held(0, 7)}, 7, "ranks [0] of dp=1,tp=2,pp=1 do not hold every shard between them"),
    (DP2, {0: Salvaged(held=True, step=8, old_rank=0)}, 7, "the metrics of step 8 were lost with the failed worker"),
])
def test_whether_the_survivors_live_state_can_heal(layout, answers, last_step, why):
    assert live_gap(layout, answers, last_step=last_step) == why


def test_a_response_is_a_value():
    with pytest.raises(AttributeError):
        Response(salvage=True).salvage = False  # frozen
