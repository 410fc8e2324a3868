"""The workers' rendezvous (`workers.runtime.rendezvous`): every rank joins rank 0's store, and a wait for a
peer that never comes (it died before joining) can be called off, leaving the process usable."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.ports import free_port
from workers.runtime import RendezvousCancelled, open_store, rendezvous


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


def test_a_rank_waiting_for_a_late_peer_sends_the_store_a_request_per_slice_not_a_poll(monkeypatch):
    """Waiting ranks block in the store (the last to join sets a key they wait for) instead of polling
    it every 5 ms (N ranks waiting sent the store N requests every 5 ms). Rank 0 waits 1 s for rank 1
    here: a handful of requests (the old loop sent ~200)."""
    import torch.distributed as dist

    real = dist.TCPStore
    counts: dict[int, int] = {}

    class Counted:
        def __init__(self, host, port, world_size, is_master, **kw):
            self._store, self._rank = real(host, port, world_size, is_master, **kw), 0 if is_master else 1
            counts.setdefault(self._rank, 0)

        def __getattr__(self, name):
            counts[self._rank] += 1
            return getattr(self._store, name)

    monkeypatch.setattr(dist, "TCPStore", Counted)
    port = free_port()

    def late(rank: int):
        if rank:
            time.sleep(1.0)
        return rendezvous(rank, 2, "127.0.0.1", port, timeout_s=30, cancelled=lambda: False)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(late, [0, 1]))
    assert counts[0] <= 8, counts  # add, two or three slices' waits, set_timeout


def test_peers_that_come_before_rank_0_find_its_store_opened_beforehand_at_their_first_try(monkeypatch):
    """Rank 0 opens its store before the peers are told its port (`open_store`, the coordinator's first
    call): a peer there 1 s before rank 0 connects with one attempt. With rank 0 opening the store only when
    its own call arrives, that peer's attempts fail until then (one per 0.5 s slice, each after torch's
    connect backoff, which made every early rank late)."""
    import torch.distributed as dist

    store = open_store()
    real = dist.TCPStore
    made: list[bool] = []  # is_master of each store constructed from here on, failed attempts included

    def counted(host, port, world_size, is_master, **kw):
        made.append(is_master)
        return real(host, port, world_size, is_master, **kw)

    monkeypatch.setattr(dist, "TCPStore", counted)

    def come(rank: int):
        if rank == 0:
            time.sleep(1.0)
            return rendezvous(0, 3, "127.0.0.1", store.port, timeout_s=30, cancelled=lambda: False, store=store)
        return rendezvous(rank, 3, "127.0.0.1", store.port, timeout_s=30, cancelled=lambda: False)

    with ThreadPoolExecutor(3) as pool:
        stores = list(pool.map(come, [1, 2, 0]))
    assert made == [False, False]  # one attempt per peer; rank 0 made no store of its own
    stores[2].set("from-rank-0", "x")
    assert stores[0].get("from-rank-0") == b"x"


def test_a_store_opened_beforehand_is_rank_0s_at_its_port():
    store = open_store()
    with pytest.raises(ValueError, match="rank 0's at port"):
        rendezvous(1, 2, "127.0.0.1", store.port, timeout_s=1, cancelled=lambda: False, store=store)
