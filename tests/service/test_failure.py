"""The recovery's decisions (service.control.failure), row by row: every expected answer is written out."""

from __future__ import annotations

import pytest

from parallel.layout import Layout
from parallel.planner import Plan
from service.control.failure import (During, Facts, Failure, Verdict, classify, fate, give_up, judge, live_gap, respond,
                                     within_window)
from service.control.source import Heal, Memory
from service.pool.group import FailureKind as K
from service.pool.group import Fate
from workers.report import Salvaged
from tests.fakes import metrics_row

T, R, X, A = During.TRAINING, During.RESTORE, During.TRANSFER, During.TAKEOVER

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


@pytest.mark.parametrize("live, group, standing, carry_on, salvage", [
    (True, True, True, True, False),  # still the lost plan's group: it trains on, nothing salvaged
    (True, True, False, False, True),  # not: salvaged for the next group to form from
    (False, True, True, True, False),  # nothing moves: a storage job carries on too
    (False, True, False, False, False),  # a storage job never moves state between workers
    (True, False, True, False, False),  # no group to take over
])
def test_a_takeover_carries_on_only_a_group_that_still_stands(live, group, standing, carry_on, salvage):
    r = respond(Facts(kind=K.COORDINATOR_RESTARTED, during=A, live_reshard=live, holds_group=group, snapshots=True,
                      standing=standing))
    assert (r.carry_on, r.salvage) == (carry_on, salvage)


@pytest.mark.parametrize("kind, during, live, group, snaps, salvage, abort, patience, heal, memory", ROWS)
def test_the_response_to_each_failure(kind, during, live, group, snaps, salvage, abort, patience, heal, memory):
    r = respond(Facts(kind=kind, during=during, live_reshard=live, holds_group=group, snapshots=snaps))
    assert (r.salvage, r.abort, r.patience_s, r.heal, r.memory) == (salvage, abort, patience, heal, memory)
    assert (r.why_not == "") == salvage  # no salvage always says why


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


# a member's answer -> its fate
FATES = [
    (None, Fate.STOP),  # silent, or on a dead node
    (Salvaged(held=True, step=7, old_rank=0), Fate.KEEP),
    (Salvaged(held=False, why="no trainer", reusable=True, old_rank=1, snapshots={1: (6,)}), Fate.KEEP),
    (Salvaged(held=False, why="the failure struck after a weight update", reusable=True), Fate.IDLE),
    (Salvaged(held=False, why="a checkpoint save was still running"), Fate.STOP),
]


@pytest.mark.parametrize("answer, want", FATES)
def test_each_member_is_kept_idled_or_stopped_by_its_answer(answer, want):
    assert fate(answer) is want


FSDP = Plan(layout=Layout(dp_shard=2), world_size=2, available=2, micro_batch_size=1, grad_accum_steps=1,
            memory_bytes=0.0, reasons=())
REPL = Plan(layout=DP2, world_size=2, available=2, micro_batch_size=1, grad_accum_steps=1, memory_bytes=0.0,
            reasons=())
HEAL_OK = respond(Facts(kind=K.NODE_LOST, during=T, live_reshard=True, holds_group=True, snapshots=True))
TRANSFER = respond(Facts(kind=K.NODE_LOST, during=X, live_reshard=True, holds_group=True, snapshots=True))
NO_SNAPS = respond(Facts(kind=K.NODE_LOST, during=T, live_reshard=True, holds_group=True, snapshots=False))
SNAP = Salvaged(held=False, why="no trainer", reusable=True, old_rank=0, snapshots={0: (5, 6), 1: (5, 6)})


@pytest.mark.parametrize("old, response, answers, last_step, want", [
    # a replica holds everything at the job's step: heal, nothing redone
    (REPL, HEAL_OK, {0: held(0, 7)}, 7, Verdict(source=Heal(old=REPL, ranks=(0,)), step=7, rows=(metrics_row(7),))),
    # one FSDP shard lost, its copy held by the survivor: form from snapshot 6, at the job's step 7
    (FSDP, HEAL_OK, {0: Salvaged(held=True, step=7, old_rank=0, snapshots={0: (5, 6), 1: (5, 6)})}, 7,
     Verdict(source=Memory(old=FSDP, step=6, serve=((0, 0), (1, 0))),
             why_not_live="ranks [0] of dp=2,tp=1,pp=1 do not hold every shard between them", step=7)),
    # a failed transfer: the live state went with it; the snapshots form the group
    (FSDP, TRANSFER, {0: SNAP}, 7, Verdict(source=Memory(old=FSDP, step=6, serve=((0, 0), (1, 0))),
                                           why_not_live="the live state went with the transfer that failed", step=7)),
    # no snapshots held, snapshots off: storage, saying both whys
    (FSDP, NO_SNAPS, {0: held(0, 7)}, 7,
     Verdict(source=None, why_not_live="ranks [0] of dp=2,tp=1,pp=1 do not hold every shard between them",
             why_not_memory="peer snapshots are off")),
    # snapshots on, but nobody answered with any
    (FSDP, HEAL_OK, {}, 7, Verdict(source=None, why_not_live="no worker answered with state it can vouch for",
                                   why_not_memory="no survivor holds a snapshot")),
])
def test_the_survivors_answers_judged(old, response, answers, last_step, want):
    assert judge(old, response, answers, last_step=last_step) == want


def f(t, kind, error=""):
    return Failure(time=t, kind=kind, error=error)


# failures, now (max_restarts 2, window 60 s) -> why the job gives up, or None
BUDGET = [
    ([], 10.0, None),
    ([f(1, K.WORKER_DIED), f(2, K.WORKER_DIED)], 10.0, None),
    ([f(1, K.WORKER_DIED, "a"), f(2, K.WORKER_DIED, "b"), f(3, K.WORKER_DIED, "c")], 10.0,
     "worker_died failed 3 times in the last 60 s (max_restarts=2); last error: c"),
    ([f(1, K.WORKER_DIED), f(2, K.NODE_LOST), f(3, K.WORKER_RAISED)], 10.0, None),  # kinds counted apart
    ([f(0, K.WORKER_DIED), f(2, K.WORKER_DIED), f(3, K.WORKER_DIED)], 60.0, None),  # t=0 left the window
    ([f(0, K.WORKER_DIED), f(2, K.WORKER_DIED), f(3, K.WORKER_DIED, "x")], 59.9,
     "worker_died failed 3 times in the last 60 s (max_restarts=2); last error: x"),
    ([f(1, K.CONFIG_REJECTED, "data.token_dtype is wrong")], 10.0,
     "the job's configuration cannot run, so it is not restarted: data.token_dtype is wrong"),
    ([f(5, K.NODE_LOST, "n")] * 3 + [f(1, K.WORKER_RAISED, "w")] * 3, 10.0,  # the most recent exhausted kind
     "node_lost failed 3 times in the last 60 s (max_restarts=2); last error: n"),
]


@pytest.mark.parametrize("failures, now, why", BUDGET)
def test_the_restart_budget(failures, now, why):
    assert give_up(failures, now=now, max_restarts=2, window_s=60.0) == why


def test_the_ledger_keeps_the_failures_within_the_window_and_every_final_one():
    kept = within_window([f(1, K.CONFIG_REJECTED), f(2, K.WORKER_DIED), f(50, K.NODE_LOST)], now=70.0, window_s=60.0)
    assert kept == [f(1, K.CONFIG_REJECTED), f(50, K.NODE_LOST)]
