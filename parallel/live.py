"""Live resharding: move model and optimizer state from the workers of one layout to the workers of
another over a process group, without storage.

A resize on live workers goes:
  1. every worker of the old layout `hold()`s its boxes (the live local shards, nothing copied) and
     leaves its training group;
  2. old and new workers (survivors, leavers still before their deadline, joiners) form one transfer
     group; `transfer()` runs the exchange plan (`parallel/exchange.py`, computed identically on every
     worker from the two layouts): a survivor copies what it keeps locally, every other piece travels
     as its own message, sent from where it lies in the old shard when it is a contiguous run of it
     (small pieces packed into one message per (sender, receiver) pair), all of them posted at once
     (batched point-to-point: gloo on CPU, NCCL on GPU);
  3. the new training group is formed, the new model and optimizer are built, and `fill()` gives them
     the received pieces: a piece that is a whole plain-tensor shard (replicated tensors, a survivor's
     own shard: the join of a replica) or a whole shard of an AdamW moment (FSDP and TP moments too)
     becomes that shard, its buffer kept as it is, so its bytes are neither copied nor faulted in
     again; any other piece is copied into its shard (the same box intersection a checkpoint load uses).
The result is bitwise what a save under the old layout and a load under the new one give
(tests/distributed/test_live_reshard.py). Non-tensor state (step, data position, RNG, AdamW step
counters) travels as JSON from the old rank 0.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections import defaultdict
from dataclasses import dataclass, field
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.checkpoint import state as state_mod
from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.tensor_io import Target
from parallel.exchange import Transfer
from parallel.sharding import Box


@dataclass(slots=True)
class Held:
    """What one worker of the old layout holds: its box of every tensor, by checkpoint key."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    boxes: dict[str, Box] = field(default_factory=dict)
    optimizer_steps: dict[str, int] = field(default_factory=dict)
    movable: bool = False
    """Whether a new rank on the same worker may take these tensors as its own shards instead of copying
    them: true for the shards of a trainer that is handed over and then dropped
    (`workers.reshard.hand_over`) and for the peer snapshots a group is formed from (the join that
    adopts them drops the snapshots after), false for copies something else still keeps."""


class Got(NamedTuple):
    """A piece of one tensor that a new rank gets from `transfer`."""

    box: Box
    data: torch.Tensor
    movable: bool
    """Whether `fill` may make `data` the shard itself: a receive buffer, or a movable `Held`'s tensor."""


def hold(model: nn.Module, optimizer: torch.optim.Optimizer) -> Held:
    """This worker's boxes of every model and optimizer tensor (the live local shards, detached)."""
    tensors, steps = state_mod.collect(model, optimizer)
    out = Held(optimizer_steps=steps)
    for p in state_mod.pieces(tensors):
        out.tensors[p.key] = p.data
        out.boxes[p.key] = Box(tuple(p.offsets), tuple(p.data.shape))
    return out


def _slice(t: torch.Tensor, have: Box, want: Box) -> torch.Tensor:
    return t[tuple(slice(w - h, w - h + n) for w, h, n in zip(want.offsets, have.offsets, want.sizes))]


def transfer(plan: list[Transfer], *, old_rank: int | None, new_rank: int | None, held: Held | dict[int, Held] | None,
             dtypes: dict[str, torch.dtype], old_to_group: dict[int, int], new_to_group: dict[int, int],
             group: Any = None, device: torch.device | str = "cpu",
             timings: dict[str, float] | None = None) -> dict[str, list[Got]]:
    """Run this worker's part of `plan` on `group` (collective over every worker in it). `old_rank` /
    `new_rank`: this worker's rank in each layout (None if it has none there); `*_to_group`: layout
    rank -> rank in `group`. `held`: its old shards, or {old rank: shards} when it serves several old
    ranks (copies kept for ranks that are gone: `workers.snapshots`). Returns the pieces this worker
    receives as a new rank, by key; pieces it keeps are views of its old shards, so those must stay
    untouched until `fill` has run."""
    me = dist.get_rank(group)
    helds = held if isinstance(held, dict) else ({old_rank: held} if held is not None else {})
    received: dict[str, list[Got]] = defaultdict(list)
    sends: dict[int, list[Transfer]] = defaultdict(list)
    recvs: dict[int, list[Transfer]] = defaultdict(list)
    for t in plan:
        src, dst = old_to_group[t.src], new_to_group[t.dst]
        h = helds.get(t.src) if src == me else None
        if src == me and (h is None or t.key not in h.boxes or not h.boxes[t.key].contains(t.box)):
            raise CheckpointError(f"live reshard: the plan has worker {me} send {t.key} {t.box} of old rank "
                                  f"{t.src}, which it does not hold ({h.boxes.get(t.key) if h else None})")
        if src == dst == me:  # a survivor keeps this piece: `fill` copies it straight from the old shard
            received[t.key].append(Got(t.box, _slice(h.tensors[t.key], h.boxes[t.key], t.box), h.movable))
        elif src == me:
            sends[dst].append(t)
        elif dst == me:
            recvs[src].append(t)
    if (sends and not helds) or (old_rank is None and sends) or (new_rank is None and recvs):
        raise CheckpointError(f"exchange plan gives worker {me} a part it cannot play")
    clock = _Laps(timings)
    ops = []
    for dst, ts in sorted(sends.items()):
        for msg in _messages(ts, dtypes):
            parts = [_slice(helds[t.src].tensors[t.key], helds[t.src].boxes[t.key], t.box) for t in msg]
            # A piece that is a contiguous run of its shard (FSDP dim-0 shards, whole tensors) goes as a
            # view: the network reads it where it lies. Only small pieces are packed (one copy).
            buf = _bytes(parts[0]) if len(parts) == 1 else torch.cat([_bytes(x) for x in parts])
            ops.append(dist.P2POp(dist.isend, buf.to(device), _peer(group, dst), group))
    clock.lap("pack")
    inbox: list[tuple[list[Transfer], torch.Tensor]] = []
    bufs = []
    for src, ts in sorted(recvs.items()):
        bufs.append(buf := torch.empty(sum(_nbytes(t, dtypes) for t in ts), dtype=torch.uint8, device=device))
        pos = 0
        for msg in _messages(ts, dtypes):
            n = sum(_nbytes(t, dtypes) for t in msg)
            inbox.append((msg, buf[pos:pos + n]))
            ops.append(dist.P2POp(dist.irecv, buf[pos:pos + n], _peer(group, src), group))
            pos += n
    clock.lap("alloc")
    if ops:
        works = dist.batch_isend_irecv(ops)
        clock.lap("post")
        if PREFAULT:
            for buf in reversed(bufs):
                _prefault(buf)
            clock.lap("prefault")
        one_per_op = len(works) == len(ops)  # gloo; NCCL coalesces the batch into one work
        for op, work in zip(ops, works):
            work.wait()
            clock.lap(("wait_send" if op.op is dist.isend else "wait_recv") if one_per_op else "wait")
    for msg, buf in inbox:
        pos = 0
        for t in msg:
            n = _nbytes(t, dtypes)
            received[t.key].append(Got(t.box, buf[pos:pos + n].view(dtypes[t.key]).reshape(t.box.sizes), True))
            pos += n
    clock.lap("unpack")
    return dict(received)


PACK_BELOW = 64 << 10
"""Pieces smaller than this (bytes) travel packed into one message per pair: a P2P op each would cost
more than copying them (norm weights, biases, thin shards). With 1 MiB, packing the 2 -> 1 resize's
mid-sized pieces still cost 0.09 s of 0.45 s; with 64 KiB, 0.01 s and no slower wire time than with
every piece on its own (benchmarks/live_reshard.py)."""


def _nbytes(t: Transfer, dtypes: dict[str, torch.dtype]) -> int:
    return t.box.numel * dtypes[t.key].itemsize


def _messages(ts: list[Transfer], dtypes: dict[str, torch.dtype]) -> list[list[Transfer]]:
    """The messages between one pair, in the order both sides post them: the small pieces packed into
    one, then every other piece on its own. Decided from the plan alone, so sender and receiver agree."""
    small = [t for t in ts if _nbytes(t, dtypes) < PACK_BELOW]
    return ([small] if small else []) + [[t] for t in ts if _nbytes(t, dtypes) >= PACK_BELOW]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 tensor: a view if `t` is contiguous, else a copy."""
    return t.contiguous().reshape(-1).view(torch.uint8)


PREFAULT = True
"""While its receives run, a CPU worker faults in the pages of its receive buffers from their far end
(MADV_POPULATE_WRITE, Linux 5.14+), so the first touch of fresh memory, the receive's main cost once the
bytes are no longer packed (0.3-0.6 s per GB on the 2-core VM of docs/benchmarks.md), is split between
gloo's receiving thread and this one, which would otherwise only wait."""
_PAGE = mmap.PAGESIZE


def _prefault(buf: torch.Tensor, chunk: int = 8 << 20) -> None:
    """Fault in `buf`'s pages, last chunk first. Concurrent writes into `buf` are safe: populating a page
    maps it and leaves its contents alone. Stops at the first refusal (an old kernel, not Linux)."""
    if buf.device.type != "cpu" or sys.platform != "linux":
        return
    lo = -(-buf.data_ptr() // _PAGE) * _PAGE
    hi = (buf.data_ptr() + buf.numel() * buf.element_size()) // _PAGE * _PAGE
    while hi > lo:
        start = max(lo, hi - chunk)
        if not _madvise(start, hi - start, 23):  # MADV_POPULATE_WRITE
            return
        hi = start


_libc: Any = None


def _madvise(addr: int, length: int, advice: int) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return _libc.madvise(addr, length, advice) == 0
    except (OSError, AttributeError):
        return False


class _Laps:
    """Adds the seconds since the previous lap to `into[name]` (no-op without `into`)."""

    def __init__(self, into: dict[str, float] | None) -> None:
        self.into, self.t = into, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        if self.into is not None:
            self.into[name] = self.into.get(name, 0.0) + now - self.t
        self.t = now


def _peer(group: Any, rank_in_group: int) -> int:
    """P2POp takes a global rank."""
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


@dataclass(slots=True)
class Filled:
    """What `fill` did with the bytes it was given (a seam for tests and benchmarks)."""

    moved: int = 0
    """Bytes of pieces that became shards as they were (no copy, no fresh pages)."""
    copied: int = 0
    """Bytes copied into freshly allocated shards."""


def fill(model: nn.Module, optimizer: torch.optim.Optimizer, pieces: dict[str, list[Got]],
         optimizer_steps: dict[str, int]) -> Filled:
    """Give this worker's shards of the new model and optimizer their values from the received pieces
    (creating AdamW state as a checkpoint load does). A movable piece that is a whole shard of a plain
    tensor, or of an optimizer moment (a DTensor the optimizer alone holds), becomes that shard: the
    tensor takes the piece's memory (a moment: a DTensor of the same mesh, placements and shape over
    it) and its own unset allocation is dropped unwritten, so neither a copy nor the first touch of
    fresh pages is paid. Every other piece is copied in, and so is a whole piece of a DTensor parameter
    (FSDP and TP keep its shard inside storage of their own). Raises CheckpointError if a shard is not
    covered exactly."""
    out = Filled()
    whole: dict[str, torch.Tensor] = {}

    def read(targets: dict[str, Target]) -> None:
        with torch.no_grad():
            for key, target in targets.items():
                want = Box(tuple(target.offsets), tuple(target.local.shape))
                mine = [g for g in pieces.get(key, ()) if want.intersect(g.box) is not None]
                if len(mine) == 1 and _takes(mine[0], want, target.local):
                    whole[key] = mine[0].data  # taken below, once it is known whether the shard is plain
                    continue
                got = 0
                for box, t, _ in mine:
                    part = want.intersect(box)
                    _slice(target.local, want, part).copy_(_slice(t, box, part))
                    got += part.numel
                out.copied += got * target.local.element_size()
                if got != want.numel:
                    raise CheckpointError(f"live reshard: {key} received {got} of the {want.numel} elements "
                                          f"of this rank's box {want}")

    state_mod.load(model, optimizer, read, optimizer_steps)
    if whole:
        live, _ = state_mod.collect(model, optimizer)
        # where each optimizer moment lives, so that a DTensor moment can be replaced by one on the piece
        moment = {id(v): (st, name) for st in optimizer.state.values() for name, v in st.items()
                  if isinstance(v, DTensor)}
        with torch.no_grad():
            for key, data in whole.items():
                n = data.numel() * data.element_size()
                t = live[key]
                if isinstance(t, DTensor) and id(t) in moment:
                    # the moment becomes a DTensor of the same spec over the piece: its unset allocation
                    # (never touched) is dropped, and neither a copy nor fresh pages are paid
                    st, name = moment[id(t)]
                    st[name] = DTensor.from_local(data, device_mesh=t.device_mesh, placements=t.placements,
                                                  run_check=False, shape=t.shape, stride=t.stride())
                    out.moved += n
                elif isinstance(t, DTensor):  # a parameter: FSDP and TP keep its shard in storage of their own
                    state_mod.local_box(t)[0].copy_(data)
                    out.copied += n
                else:  # the same tensor object (what the optimizer and the modules refer to), new memory
                    t.data = data
                    out.moved += n
    return out


def _takes(g: Got, want: Box, local: torch.Tensor) -> bool:
    """Whether `g` can stand in for the whole shard `local` (box `want`) as it is."""
    return (g.movable and g.box == want and g.data.dtype == local.dtype and g.data.device == local.device
            and g.data.is_contiguous() and local.is_contiguous())
