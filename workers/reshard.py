"""A worker's side of a live reshard: what it carries across the change of process group, and the
exchange it takes part in (see `parallel/live.py` for the protocol).

    handover = hand_over(old_trainer)          # while the old training group still exists
    ... the old group is destroyed; the transfer group (old and new workers) is formed ...
    received = exchange(handover, ...)         # collective over the transfer group
    ... the transfer group is destroyed; the new training group is formed, the new trainer built ...
    new_trainer.adopt(received.pieces, received.optimizer_steps, received.state)

Every worker computes its own part of the exchange plan (`parallel.exchange.plan_rank`: what it sends
and receives) from the two layouts and the model's shapes, so nothing but tensors and one JSON state
document travels, and the planning a worker does grows with its share of the state, not with the world.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
import gc
import time
from typing import Any

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.llama import build_model
from parallel.exchange import plan_order, plan_rank
from parallel.layout import Layout
from parallel.live import Held, hold, transfer
from parallel.sharding import BoxMap


@dataclass(slots=True)
class Handover:
    """What one worker of the old layout carries: its shards (kept alive by these references) and, on
    the old rank 0, the JSON state (step, data position, RNG, LR schedule)."""

    held: Held
    state: dict[str, Any] | None
    extra: dict[int, Held] = field(default_factory=dict)
    """Copies of other old ranks' shards it serves (ranks that are gone: `workers.snapshots`)."""


@dataclass(slots=True)
class Received:
    pieces: dict[str, list]
    optimizer_steps: dict[str, int]
    state: dict[str, Any]
    bytes_received: int = 0
    """Bytes that came over the network to this worker (pieces it kept from its own shards excluded)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds in each phase on this worker: agree (optimizer steps), plan, state (JSON), send_recv, and
    the parts of send_recv as `send_recv.<part>` (`SEND_RECV_PARTS`)."""


SEND_RECV_PARTS = ("pack", "alloc", "post", "prefault", "wait_send", "wait_recv", "wait", "unpack")
"""What `parallel.live.transfer` times: packing the slices it sends, allocating receive buffers, posting
the ops, faulting in the receive buffers' pages while the receives run, waiting for its sends / its
receives (or for the batch, where it is one work), the received pieces' views."""


def hand_over(trainer: Any) -> Handover:
    """Collect `trainer`'s shards and state before its group goes away (waits for a save in flight).
    `trainer` must not train again: a new rank on this worker takes its shards over without a copy."""
    trainer.flush_checkpoint()
    held = hold(trainer.model, trainer.optimizer)
    held.movable = True  # the trainer is dropped after: a new rank on this worker may keep its shards
    return Handover(held=held, state=trainer.checkpoint_state() if trainer.rank == 0 else None)


def hand_over_salvaged(trainer: Any, state: dict[str, Any]) -> Handover:
    """A survivor's shards after a failure (no save to wait for, no collective): every survivor carries
    the JSON state, since the old rank 0 may be the one that died. `trainer` must not train again."""
    held = hold(trainer.model, trainer.optimizer)
    held.movable = True  # the broken trainer is dropped after
    return Handover(held=held, state=state)


@contextmanager
def _collector_paused():
    """No cyclic garbage collection inside: a full collection walks every object of a worker process
    (0.12 s for a trainer of the 1 GB benchmark state; more with Ray's), and the plan's thousands of
    small objects can set one off while the other workers wait in the next collective. What is created
    here is freed by reference counting; the collector catches up after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_collector_paused()
def exchange(handover: Handover | None, *, model: ModelConfig, old: Layout, new: Layout, old_rank: int | None,
             new_rank: int | None, old_to_group: dict[int, int], new_to_group: dict[int, int],
             nodes: dict[int, str] | None = None, device: torch.device | str = "cpu") -> Received:
    """This worker's part of the exchange on the current default group (collective over all its
    members). `*_to_group`: layout rank -> rank in the group (of the old ranks, only those still alive:
    after a failure the survivors, who must hold every box between them); `nodes`: group rank -> node
    id, so pieces come from the same node when a replica there has them."""
    clock = _Clock()
    meta = build_model(model)
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    dtypes = {n: p.dtype for n, p in meta.named_parameters()}
    # the step counters of every old rank this worker sends for: its own and the copies it serves (under
    # pipeline parallelism each old rank holds other parameters, so one worker's own counters are not all)
    mine: dict[str, int] = {}
    for held in ([handover.held, *handover.extra.values()] if handover else []):
        mine.update(held.optimizer_steps)
    steps = agree_steps(mine, list(shapes))
    clock.lap("agree")
    states = ("exp_avg", "exp_avg_sq") if steps else ()  # no AdamW state before the first step
    tied = model.tie_embeddings
    group_to_old = {g: r for r, g in old_to_group.items()}
    same_worker = {n: group_to_old[g] for n, g in new_to_group.items() if g in group_to_old}
    nodes = nodes or {}
    old_map, new_map = (BoxMap(old, shapes, model.n_layers, states, tied=tied),
                        BoxMap(new, shapes, model.n_layers, states, tied=tied))
    where = dict(alive=set(old_to_group), same_worker=same_worker,
                 old_node={r: nodes[g] for r, g in old_to_group.items() if g in nodes},
                 new_node={r: nodes[g] for r, g in new_to_group.items() if g in nodes})
    plan = plan_rank(old_map, new_map, old_rank=old_rank, new_rank=new_rank, **where)
    extra = handover.extra if handover else {}
    if extra:  # the sends of the old ranks it serves besides its own; its receives are in `plan` already
        plan = sorted({*plan, *(t for r in extra for t in plan_rank(old_map, new_map, old_rank=r, new_rank=None,
                                                                    **where))}, key=plan_order)
    clock.lap("plan")
    box = [handover.state if handover and handover.state is not None else None]
    dist.broadcast_object_list(box, src=old_to_group[min(old_to_group)])  # the lowest old rank still here
    clock.lap("state")
    key_dtype = {f"{prefix}{n}": dt for n, dt in dtypes.items()
                 for prefix in ("model.", *(f"optim.{st}." for st in states))}  # moments share the param's dtype
    parts = dict.fromkeys(SEND_RECV_PARTS, 0.0)
    held = ({old_rank: handover.held, **extra} if extra else handover.held) if handover else None
    pieces = transfer(plan, old_rank=old_rank, new_rank=new_rank, held=held,
                      dtypes=key_dtype, old_to_group=old_to_group, new_to_group=new_to_group, device=device,
                      timings=parts)
    clock.lap("send_recv")
    clock.laps.update({f"send_recv.{k}": v for k, v in parts.items()})
    me = dist.get_rank()
    got = sum(t.box.numel * key_dtype[t.key].itemsize for t in plan
              if new_to_group[t.dst] == me and old_to_group[t.src] != me)
    return Received(pieces=pieces, optimizer_steps=steps, state=box[0], bytes_received=got, timings=clock.laps)


def agree_steps(mine: dict[str, int], names: list[str]) -> dict[str, int]:
    """Every parameter's optimizer step counter that some member of the current default group holds
    (`mine`: this worker's), agreed by one all-reduce (max) of a counter per name of `names`, -1 where a
    member holds none: each worker sends and receives len(names) integers whatever the world size, and
    nothing is unpickled. (Every holder of a parameter stepped it as often; max picks that count.)"""
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(mine) - index.keys())
    if unknown:
        raise ValueError(f"optimizer step counters for {unknown[:3]} (of {len(unknown)}) name no parameter of "
                         f"the model; the handover and the model config disagree: rebuild both from one config")
    counts = torch.full((len(names),), -1, dtype=torch.int64)
    for name, step in mine.items():
        counts[index[name]] = step
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return {n: int(c) for n, c in zip(names, counts.tolist()) if c >= 0}


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now
