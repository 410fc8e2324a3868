"""Process-group set-up for one rank: env:// under torchrun or Ray, a private single-rank group otherwise."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_store() -> dist.TCPStore:
    """Rank 0's TCP store of a group to come, listening from now on a port the system picks (`.port`),
    before any peer is told where to find it. A peer that looks for a store not listening yet waits out
    torch's connect backoff (0.1-0.7 s measured here) before it looks again, so a rank 0 that opened its
    store only when the rendezvous call reached it made every rank that got there first wait for it
    (most of a 4-rank transfer group's rendezvous). `rendezvous(..., store=...)` on rank 0 takes it."""
    return dist.TCPStore("0.0.0.0", 0, None, True, timeout=timedelta(seconds=_SLICE_S), wait_for_workers=False)


def pick_device(kind: str = "auto") -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("resources.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def env_world() -> tuple[int, int]:
    """(rank, world_size) from the environment (torchrun/Ray set them); (0, 1) when run alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class RendezvousCancelled(RuntimeError):
    """A rendezvous called off (`cancelled()`) before every rank had joined it."""


_SLICE_S = 0.5
"""The longest a rendezvous waits between two looks at `cancelled()`."""


def init_process_group(device: torch.device, *, timeout_s: float = 300.0,
                       cancelled: Callable[[], bool] | None = None,
                       store: dist.TCPStore | None = None) -> dict[str, float]:
    """Initialise the default group from env://. A lone process gets a loopback rendezvous of its own.
    `cancelled`: asked while the ranks gather (`rendezvous`); once it says so, RendezvousCancelled.
    `store`: on rank 0, the store it opened beforehand (`open_store`) at MASTER_PORT.
    Returns the seconds of its two parts where the rendezvous is our own (`cancelled` given):
    `rendezvous_s` (every rank joined rank 0's store) and `connect_s` (the backend's group over it: gloo's
    connections between every pair of ranks); empty otherwise, or when a group already existed."""
    if dist.is_initialized():
        return {}
    global _excepthook
    _excepthook = sys.excepthook  # torch wraps it in each init: put back by `destroy_process_group`
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    # gloo always, for CPU collectives (DCP, async save); nccl for CUDA tensors when on GPUs.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    # With no group in this process, name the new one as a fresh process would: torch names the default
    # group by a counter that destroying a group resets, but a failed init (a peer died during the
    # rendezvous) leaves it raised, and the ranks' store keys would then differ until the timeout.
    _reset_group_names()
    timeout = timedelta(seconds=timeout_s)
    if cancelled is None:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        return {}
    rank, world_size = env_world()
    t0 = time.perf_counter()
    store = rendezvous(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                       timeout_s=timeout_s, cancelled=cancelled, store=store)
    t1 = time.perf_counter()
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return {"rendezvous_s": t1 - t0, "connect_s": time.perf_counter() - t1}


def rendezvous(rank: int, world_size: int, addr: str, port: int, *, timeout_s: float,
               cancelled: Callable[[], bool], store: dist.TCPStore | None = None) -> dist.TCPStore:
    """Rank 0's TCP store at `addr:port` once every rank has joined it, waited for in slices of at most
    `_SLICE_S` with `cancelled()` asked between them. A peer that died before joining would otherwise hold
    every other rank in `init_process_group` until `timeout_s`, where no abort reaches it; this way the
    caller can call the wait off (RendezvousCancelled) and the process stays usable. TimeoutError after
    `timeout_s`. `store`: rank 0's, opened beforehand (`open_store`); rank 0 opens it here otherwise."""
    deadline = time.monotonic() + timeout_s

    def go_on(what: str) -> None:
        if cancelled():
            raise RendezvousCancelled(f"rendezvous called off while {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rendezvous: still {what} after {timeout_s:.0f}s")

    if store is not None and (rank != 0 or store.port != port):
        raise ValueError(f"rendezvous: a store opened beforehand is rank 0's at port {port}, "
                         f"got rank {rank} with a store at port {store.port}")
    while store is None:
        try:
            store = dist.TCPStore(addr, port, world_size, rank == 0, timeout=timedelta(seconds=_SLICE_S),
                                  wait_for_workers=False)
        except RuntimeError:  # rank 0's store not up yet, or its host gone (DistNetworkError)
            if rank == 0:
                raise  # it could not listen: waiting will not change that
            go_on("connecting to rank 0's store")
    # The last rank to join says so under a key the others wait for in the store (a blocking wait each,
    # in slices): no rank polls, so N ranks waiting cost the store N requests per slice, not N every 5 ms.
    if int(store.add("elastron/joined", 1)) == world_size:
        store.set("elastron/all_joined", "1")
    while True:
        try:
            store.wait(["elastron/all_joined"], timedelta(seconds=_SLICE_S))
            break
        except dist.DistStoreError:  # the slice ended (a store whose host is gone raises otherwise)
            go_on(f"waiting for the {world_size} ranks to join")
    store.set_timeout(timedelta(seconds=timeout_s))  # the group's own waits on the store, from here on
    return store


def _reset_group_names() -> None:
    from torch.distributed import distributed_c10d

    distributed_c10d._world.group_count = 0


_excepthook = None
"""`sys.excepthook` as it was before the live group's init. torch's init wraps the hook in one more
closure each time (prefixing "[rankN]: " to tracebacks) and its destroy does not unwrap it: in a worker
that re-forms its group at every reconfiguration the chain would grow by one per group formed."""


def destroy_process_group() -> None:
    """Destroy the default group, put back the `sys.excepthook` its init wrapped, and forget the device
    meshes built on it (`forget_meshes`)."""
    global _excepthook
    if dist.is_initialized():
        dist.destroy_process_group()
    if _excepthook is not None:
        sys.excepthook, _excepthook = _excepthook, None
    forget_meshes()


def forget_meshes() -> None:
    """Clear DTensor's sharding-propagation caches (Python's and the C++ fast path's, for the calling
    thread: the one that builds trainers and trains).

    Their entries hold the DeviceMesh of the first DTensor op with each signature, and they are looked up
    by mesh *equality*, which compares the mesh's shape, ranks and axis names but not which rank this
    process is. A worker that was rank 1 of a 2-rank layout and is later rank 0 of another 2-rank layout
    would get the old mesh back from a cache hit (when its new model is materialised, `to_empty`), with
    the old mesh coordinate: its parameters would report the other rank's box, so a checkpoint load
    fills its shard with the other rank's rows, a live transfer delivers pieces its box does not
    cover, and a save writes one box twice and the other not at all. Every group change goes through
    `destroy_process_group`, so the caches never outlive the meshes they were built for (which they
    would otherwise keep alive). What `torch.distributed.tensor.debug._clear_sharding_prop_cache` does,
    without importing that module (it pulls in torch._inductor: 2.6-5 s on this box)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor op ran: nothing cached
        return
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
