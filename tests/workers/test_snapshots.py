"""Peer snapshots on real ranks (gloo): each rank's copy lands in its buddy's memory, whole and as it was
at the step it was taken, and the committed step trails the newest by one round."""

from __future__ import annotations

import pytest

from tests.bodies import (snapshot_buddy_silent_body, snapshot_guard_body, snapshot_off_body, snapshot_peer_silent_body,
                          snapshot_rounds_body)
from tests.multiproc import run_ranks
from workers.snapshots import ROUND_MARGIN, ROUND_MIN_S, Copy, Slot, next_bound


def test_each_rank_keeps_its_buddys_copy_of_the_last_two_steps():
    out = run_ranks(3, snapshot_rounds_body, ["a", "b", "c"], 3)  # buddies: 0 -> 1 -> 2 -> 0
    for rank, res in enumerate(out):
        sender = (rank - 1) % 3
        assert res["holdings"] == {rank: (2, 3), sender: (2, 3)}
        assert res["committed"] == [-1, 1, 2]  # a round commits when the next one starts
        assert [c[0] for c in res["costs"]] == res["committed"]  # what each take says it agreed on
        assert all(s >= 0 for c in res["costs"] for s in c[1:])  # wait, agree, copy: measured seconds
        assert res["kept"] == {sender: {"model.w": (sender * 100 + 3.0, (sender * 4, 0)),
                                        "optim.exp_avg.model.w": (sender * 100 + 3.0, (sender * 2, 0))}}
        assert res["own"] == rank * 100 + 3.0 and res["steps"] == {"model.w": 3}
        assert res["state"] == {"lr_schedule": {"step": 3}}


def test_the_background_copy_ends_before_the_optimizer_updates_the_shards_it_copies():
    """`take` returns before the copy (it runs beside the next step's forward and backward); the
    optimizer's step pre-hook (`guard`) makes an update straight after it wait, so the copy is the
    shard as taken, on its own rank and its buddy's. `close` removes the hook."""
    for res in run_ranks(2, snapshot_guard_body, 1 << 16):
        assert res == {"own_as_taken": True, "kept_whole": True, "stepped": True, "guards_left": 0}, res


@pytest.mark.parametrize("nodes, available, buddies", [
    (["a", "b"], [None, None], [1, 0]),
    (["a", "a"], [None, None], [None, None]),         # one node: no copy can live elsewhere
    (["a", "b"], [None, 6 << 10], [None, None]),      # rank 1: 4 KiB of copies > half of 6 KiB: every rank runs without
    (["a", "b"], [16 << 10, 16 << 10], [1, 0]),       # 4 KiB within half of 16 KiB
])
def test_snapshots_start_only_where_every_rank_has_a_buddy_and_the_memory(nodes, available, buddies):
    assert run_ranks(2, snapshot_off_body, nodes, available) == buddies


def test_a_round_whose_peer_stops_answering_ends_within_its_bound_and_frees_its_buffers():
    """A round waits on its buddy about as long as rounds take (`next_bound`; the first one as long as its
    bytes need), well within the snapshot group's timeout (gloo's default for a new group, 30 minutes, kept a killed
    peer's survivor holding every snapshot buffer of the old group, ~3 copies of its shard per failure:
    found by benchmarks/soak.py); once it has ended and the snapshots are closed, none of their buffers is
    alive. Here: slack and floor 2 s, group timeout 60 s, the round must end within 30 s."""
    out = run_ranks(2, snapshot_peer_silent_body, 60.0, 2.0, 30.0, timeout=150)[0]
    assert out["ended"] and out["failed"], out
    # its own copies of rounds 1 and 2 and the kept copy of round 1 (round 2's receive never began)
    assert out["buffers"] == 3 and out["alive_buffers"] == 0 and out["round_threads"] == 0, out


@pytest.mark.dist
def test_a_copy_counts_once_received_while_the_send_to_a_silent_buddy_still_waits():
    """A salvage reads the holdings without waiting for the round: rank 1 must already count rank 0's copy of
    the round whose send to the dead rank 2 cannot end."""
    out = run_ranks(3, snapshot_buddy_silent_body, 8.0, 5.0, timeout=120)[1]
    assert out["holdings"] == {1: (1, 2), 0: (1, 2)}, out
    assert out["round_waiting"], out  # counted before its round ended


@pytest.mark.parametrize("bound, ok, took, after", [
    (None, True, 0.5, ROUND_MIN_S),           # a quick first round: the floor
    (None, True, 3.0, 12.0),                  # 4x a slow round
    (12.0, True, 0.2, ROUND_MIN_S),           # the bound follows the rounds down
    (5.0, False, 5.0, 10.0),                  # a failed round doubles it (the load rose)
    (None, False, 7.0, None),                 # a failed first round: the next is bounded by its bytes again
])
def test_a_rounds_bound_follows_the_last_complete_round(bound, ok, took, after):
    assert ROUND_MARGIN == 4.0 and ROUND_MIN_S == 5.0
    assert next_bound(bound, ok=ok, round_s=took) == after


def _slot(a: int, b: int) -> Slot:
    s = Slot()
    s.copies = [Copy(step=a), Copy(step=b)]
    return s


@pytest.mark.parametrize("steps, committed, fills", [
    ((4, 5), 5, 0),     # the committed copy (5) stays; the older one is refilled
    ((4, 5), 4, 1),     # round 5 not committed everywhere: 4 stays, 5's buffer is refilled
    ((-1, -1), -1, 0),  # nothing yet
    ((3, -1), 3, 1),
    ((6, 2), 1, 1),     # neither is the committed step: the older is refilled
])
def test_a_round_never_fills_the_buffer_of_the_committed_step(steps, committed, fills):
    s = _slot(*steps)
    assert s.spare(committed) is s.copies[fills]
