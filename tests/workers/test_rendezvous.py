"""The workers' rendezvous (`workers.runtime.rendezvous`): every rank joins rank 0's store, and a wait for a
peer that never comes (it died before joining) can be called off, leaving the process usable."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.ports import free_port
from workers.runtime import RendezvousCancelled, rendezvous


def test_every_rank_gets_the_store_once_all_have_joined():
    port = free_port()
    with ThreadPoolExecutor(3) as pool:
        stores = list(pool.map(lambda r: rendezvous(r, 3, "127.0.0.1", port, timeout_s=30, cancelled=lambda: False),
                               [1, 2, 0]))
    stores[0].set("from-rank-1", "x")
    assert all(s.get("from-rank-1") == b"x" for s in stores)  # one store, rank 0's


@pytest.mark.parametrize("rank", [0, 1], ids=["rank 0 waits for a peer", "rank 1 waits for rank 0's store"])
def test_a_wait_for_a_peer_that_never_joins_is_called_off_at_once(rank):
    called_off = threading.Event()
    threading.Timer(0.3, called_off.set).start()
    t0 = time.monotonic()
    with pytest.raises(RendezvousCancelled, match="called off"):
        rendezvous(rank, 2, "127.0.0.1", free_port(), timeout_s=60, cancelled=called_off.is_set)
    assert time.monotonic() - t0 < 5  # not the 60 s timeout: at most one slice after the call-off


def test_a_rendezvous_that_nobody_calls_off_ends_at_its_timeout():
    with pytest.raises(TimeoutError, match="waiting for the 2 ranks"):
        rendezvous(0, 2, "127.0.0.1", free_port(), timeout_s=0.5, cancelled=lambda: False)
