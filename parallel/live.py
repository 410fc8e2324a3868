"""Live resharding: move model and optimizer state from the workers of one layout to the workers of
another over a process group, without storage.

A resize on live workers goes:
  1. every worker of the old layout `hold()`s its boxes (the live local shards, nothing copied) and
     leaves its training group;
  2. old and new workers (survivors, leavers still before their deadline, joiners) form one transfer
     group; `transfer()` runs the exchange plan (`parallel/exchange.py`, computed identically on every
     worker from the two layouts): a survivor copies what it keeps locally, every other piece travels
     in one message per (sender, receiver) pair, all of them posted at once (batched point-to-point:
     gloo on CPU, NCCL on GPU);
  3. the new training group is formed, the new model and optimizer are built, and `fill()` copies the
     received pieces into their shards (the same box intersection a checkpoint load uses).
The result is bitwise what a save under the old layout and a load under the new one give
(tests/distributed/test_live_reshard.py). Non-tensor state (step, data position, RNG, AdamW step
counters) travels as JSON from the old rank 0.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.checkpoint import state as state_mod
from parallel.checkpoint.manifest import CheckpointError
from parallel.checkpoint.tensor_io import Target
from parallel.exchange import Transfer
from parallel.sharding import Box


@dataclass(slots=True)
class Held:
    """What one worker of the old layout holds: its box of every tensor, by checkpoint key."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    boxes: dict[str, Box] = field(default_factory=dict)
    optimizer_steps: dict[str, int] = field(default_factory=dict)


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


def transfer(plan: list[Transfer], *, old_rank: int | None, new_rank: int | None, held: Held | None,
             dtypes: dict[str, torch.dtype], old_to_group: dict[int, int], new_to_group: dict[int, int],
             group: Any = None, device: torch.device | str = "cpu",
             timings: dict[str, float] | None = None) -> dict[str, list[tuple[Box, torch.Tensor]]]:
    """Run this worker's part of `plan` on `group` (collective over every worker in it). `old_rank` /
    `new_rank`: this worker's rank in each layout (None if it has none there); `*_to_group`: layout
    rank -> rank in `group`. Returns the pieces this worker receives as a new rank, by key; pieces it
    keeps are views of its old shards, so those must stay untouched until `fill` has run."""
    me = dist.get_rank(group)
    received: dict[str, list[tuple[Box, torch.Tensor]]] = defaultdict(list)
    sends: dict[int, list[Transfer]] = defaultdict(list)
    recvs: dict[int, list[Transfer]] = defaultdict(list)
    for t in plan:
        src, dst = old_to_group[t.src], new_to_group[t.dst]
        if src == me and (held is None or t.key not in held.boxes or not held.boxes[t.key].contains(t.box)):
            raise CheckpointError(f"live reshard: the plan has worker {me} send {t.key} {t.box}, which it does "
                                  f"not hold ({held.boxes.get(t.key) if held else None})")
        if src == dst == me:  # a survivor keeps this piece: `fill` copies it straight from the old shard
            received[t.key].append((t.box, _slice(held.tensors[t.key], held.boxes[t.key], t.box)))
        elif src == me:
            sends[dst].append(t)
        elif dst == me:
            recvs[src].append(t)
    if (sends and held is None) or (old_rank is None and sends) or (new_rank is None and recvs):
        raise CheckpointError(f"exchange plan gives worker {me} a part it cannot play")
    clock = _Laps(timings)
    ops, inbox = [], {}
    for dst, ts in sorted(sends.items()):
        parts = [_slice(held.tensors[t.key], held.boxes[t.key], t.box).contiguous().reshape(-1).view(torch.uint8)
                 for t in ts]
        ops.append(dist.P2POp(dist.isend, torch.cat(parts).to(device), _peer(group, dst), group))
    clock.lap("pack")
    for src, ts in sorted(recvs.items()):
        nbytes = sum(t.box.numel * dtypes[t.key].itemsize for t in ts)
        inbox[src] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ops.append(dist.P2POp(dist.irecv, inbox[src], _peer(group, src), group))
    clock.lap("alloc")
    if ops:
        works = dist.batch_isend_irecv(ops)
        clock.lap("post")
        one_per_op = len(works) == len(ops)  # gloo; NCCL coalesces the batch into one work
        for op, work in zip(ops, works):
            work.wait()
            clock.lap(("wait_send" if op.op is dist.isend else "wait_recv") if one_per_op else "wait")
    for src, buf in inbox.items():
        pos = 0
        for t in recvs[src]:
            n = t.box.numel * dtypes[t.key].itemsize
            received[t.key].append((t.box, buf[pos:pos + n].view(dtypes[t.key]).reshape(t.box.sizes)))
            pos += n
    clock.lap("unpack")
    return dict(received)


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


def fill(model: nn.Module, optimizer: torch.optim.Optimizer, pieces: dict[str, list[tuple[Box, torch.Tensor]]],
         optimizer_steps: dict[str, int]) -> None:
    """Copy received pieces into this worker's shards of the new model and optimizer (creating AdamW
    state as a checkpoint load does). Raises CheckpointError if a shard is not covered exactly."""

    def read(targets: dict[str, Target]) -> None:
        with torch.no_grad():
            for key, target in targets.items():
                want = Box(tuple(target.offsets), tuple(target.local.shape))
                got = 0
                for box, t in pieces.get(key, ()):
                    part = want.intersect(box)
                    if part is None:
                        continue
                    _slice(target.local, want, part).copy_(_slice(t, box, part))
                    got += part.numel
                if got != want.numel:
                    raise CheckpointError(f"live reshard: {key} received {got} of the {want.numel} elements "
                                          f"of this rank's box {want}")

    state_mod.load(model, optimizer, read, optimizer_steps)
