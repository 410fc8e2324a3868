"""Peer snapshots: each rank's shards of one step, in its own host memory and in its buddy's, so that a
rank lost without notice can be served from memory (`parallel.peers` pairs the ranks and judges what
the survivors' copies cover).

    snaps = PeerSnapshots.start(node_id, shard_bytes=..., available_bytes=...)  # collective, at `join`
    if snaps.pace.due(step):                           # every `checkpoint.peer_interval` steps or more (workers.pace)
        snaps.take(step, hold(model, optimizer), state)  # collective; the copy runs on in the background
    snaps.holdings()                                   # {old rank: complete steps}, after a failure
    snaps.handover(step, ranks)                        # the copies of those old ranks at that step

    snaps.guard(optimizer)                             # the copy of a round ends before the next update

Each round (`take`): the rank waits for its previous round's sends and receives (a background thread),
agrees with the others on the newest step every rank has completed (a one-integer all-reduce: the
committed step), and returns; a background thread then copies its shards into the buffer that does not
hold the committed step (during the next step's forward and backward, which leave the shards as they
are: `settle`, run by the optimizer's step pre-hook that `guard` registers, waits for that copy before
the update changes them), and sends that buffer, on a gloo group of its own, to its buddy, while
receiving the copies it keeps into their spare buffers the same way. So each slot (its own copy, and each copy it keeps) holds
two buffers: the committed one, never overwritten before every rank has completed the next, and the one
being filled; a half-sent snapshot never replaces a whole one. Nothing is written to disk.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallel.checkpoint.host_pool import layout as pool_layout
from parallel.live import Held
from parallel.peers import Pairing, pair
from parallel.sharding import Box
from workers.pace import Pace
from workers.report import Taken

log = logging.getLogger(__name__)

AFFORDABLE = 0.5
"""A rank takes snapshots only if they need at most this share of the host's available memory."""

ROUND_SLACK_S = 10.0
ROUND_FLOOR_BYTES_PER_S = 50e6
"""A group's first round must end within ROUND_SLACK_S + its bytes at this rate (a hundredth of a slow
data-centre link), else it fails: a peer that died mid-round (gloo ends no pending send or receive when
a peer is SIGKILLed) then holds the round's two buffers for seconds, not for the group's timeout."""
ROUND_MARGIN = 4.0
ROUND_MIN_S = 5.0
"""Each later round: within ROUND_MARGIN x the last complete round's time, and at least ROUND_MIN_S
(`next_bound`); a round that fails doubles the bound for the next (the box's load rose)."""


def next_bound(bound_s: float | None, *, ok: bool, round_s: float) -> float | None:
    """The bound of the next round after one that took `round_s` and completed (`ok`) or failed under
    `bound_s` (None: the first round's bound from its bytes)."""
    if ok:
        return max(ROUND_MIN_S, ROUND_MARGIN * round_s)
    return None if bound_s is None else 2 * bound_s


@dataclass(slots=True)
class Copy:
    """One complete (or filling) copy of one rank's shards at one step."""

    step: int = -1
    """-1: holds nothing complete."""
    buf: torch.Tensor | None = None
    header: dict[str, Any] = field(default_factory=dict)
    """keys -> [offsets, sizes, dtype, start]; optimizer_steps; state."""

    def held(self) -> Held:
        out = Held(optimizer_steps=dict(self.header["optimizer_steps"]))
        for key, (offsets, sizes, dtype, start) in self.header["keys"].items():
            dt = getattr(torch, dtype)
            n = dt.itemsize * _numel(sizes)
            out.tensors[key] = self.buf[start:start + n].view(dt).view(tuple(sizes))
            out.boxes[key] = Box(tuple(offsets), tuple(sizes))
        return out


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


class Slot:
    """Two buffers of one rank's copies: the committed one and the one being filled."""

    def __init__(self) -> None:
        self.copies = [Copy(), Copy()]

    def spare(self, committed: int) -> Copy:
        """The buffer to fill: not the one holding `committed` (the older one if neither does)."""
        a, b = self.copies
        if a.step == committed and a.step >= 0:
            return b
        if b.step == committed and b.step >= 0:
            return a
        return a if a.step <= b.step else b

    def steps(self) -> tuple[int, ...]:
        return tuple(sorted(c.step for c in self.copies if c.step >= 0))

    def at(self, step: int) -> Copy | None:
        return next((c for c in self.copies if c.step == step), None)

    def nbytes(self) -> int:
        return sum(c.buf.numel() for c in self.copies if c.buf is not None)


class PeerSnapshots:
    """This rank's snapshots: its own slot and the slots of the ranks whose buddy it is."""

    def __init__(self, *, rank: int, pairing: Pairing, group: Any, timeout_s: float = 120.0,
                 pace: Pace | None = None) -> None:
        self.rank, self.pairing, self.group = rank, pairing, group
        self.pace = pace or Pace(every=1, budget=0.0)
        """When the rounds are taken: every rank calls `take` when `pace.due` says so."""
        self.timeout_s = timeout_s
        """The snapshot group's timeout: no wait of a round lasts longer."""
        self.buddy = pairing.buddy[rank]
        self.own = Slot()
        self.kept = {r: Slot() for r in pairing.keeps(rank)}
        self.committed = -1
        """The newest step every rank has completed (own copy sent, copies kept received)."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copied = threading.Event()
        """Set once the round in flight has copied the shards (set: nothing to wait for)."""
        self._copied.set()
        self._guard: Any = None
        """The optimizer step pre-hook's handle (`guard`)."""
        self.copy_s = 0.0
        """Seconds the last round's copy of the shards took, in the background."""
        self.settle_s = 0.0
        """Seconds the training thread waited for the last round's copy (`settle`)."""
        self.round_s = 0.0
        """Seconds the last complete round's background send and receive took."""
        self.bound_s: float | None = None
        """How long the next round's waits may last (None: the first round's bound, from its bytes)."""
        self.memory_bytes = 0
        """The host memory the snapshots take on this rank, as estimated at start."""
        self.last_error: BaseException | None = None
        """What made the last failed round fail (its copies do not count)."""

    @classmethod
    def start(cls, node_id: str, *, shard_bytes: int, available_bytes: int | None,
              timeout_s: float = 120.0, pace: Pace | None = None) -> PeerSnapshots | None:
        """Pair the ranks of the default group by their nodes and make the snapshot group (collective on
        every rank). Returns None, having logged why in one line, when there is no pairing or some rank
        cannot afford the memory (two buffers of its own shards and of each copy it keeps).

        `timeout_s`: the snapshot group's timeout (the training group's is the same), the longest any wait
        of a round may last (`next_bound` bounds them further). Gloo's default for a new group is 30
        minutes, and a SIGKILLed peer does not end a pending send or receive before that: its survivor's
        round would hold the buffers it was sending and filling all that time."""
        rank, world = dist.get_rank(), dist.get_world_size()
        nodes: list[Any] = [None] * world
        dist.all_gather_object(nodes, node_id)
        pairing = pair(nodes)
        if not pairing.paired:
            log.warning("peer snapshots off: %s", pairing.why)
            return None
        need = 2 * shard_bytes * (1 + len(pairing.keeps(rank)))  # the copies it keeps: about its own size
        ok = available_bytes is None or need <= AFFORDABLE * available_bytes
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not ok:
            log.warning("peer snapshots off: rank %d needs %.0f MiB for them, %.0f MiB of memory is available",
                        rank, need / 2**20, (available_bytes or 0) / 2**20)
            return None
        if not flag.item():
            log.warning("peer snapshots off: another rank cannot afford their memory")
            return None
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        log.info("peer snapshots on: rank %d keeps its copy on rank %s and copies of ranks %s: about %.0f MiB",
                 rank, pairing.buddy[rank], list(pairing.keeps(rank)), need / 2**20)
        out = cls(rank=rank, pairing=pairing, group=group, timeout_s=timeout_s, pace=pace)
        out.memory_bytes = need
        return out

    # -- a round ---------------------------------------------------------------------------------------
    def take(self, step: int, held: Held, state: dict[str, Any]) -> Taken:
        """Snapshot `held` (this rank's shards after step `step`'s update) and `state` (collective: every
        rank calls it at the same steps, those `pace.due` names); returns what it cost this thread. The
        one agreement of the round also settles the interval to the next: the largest any rank proposes.

        The copy of `held` runs in the background: `held`'s tensors must stay unchanged until `settle()`
        returns (the optimizer's step pre-hook calls it, `guard`). `Taken.copy_s` is what the copy of
        the previous round cost this thread (its `settle`), as this round's own is not known yet."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        # one all-reduce (MIN): the newest step complete everywhere, and the largest proposed interval
        agree = torch.tensor([self._complete_step(), -self.pace.propose()], dtype=torch.int64)
        dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=self.group)
        self.committed, interval = int(agree[0]), -int(agree[1])
        t2 = time.perf_counter()
        own = self.own.spare(self.committed)
        own.step = -1  # filling: not a copy of any step until the background copy ends
        self._copied.clear()
        self._thread = threading.Thread(target=self._copy_and_round, args=(own, step, held, state),
                                        name="peer-snapshot", daemon=True)
        self._thread.start()
        self.pace.taken(step, interval, t2 - t0)  # the copy's wait (settle) is in a busy step's time
        return Taken(wait_s=round(t1 - t0, 4), agree_s=round(t2 - t1, 4), copy_s=round(self.settle_s, 4),
                     committed=self.committed, interval=interval)

    def settle(self) -> float:
        """Wait until the round in flight has copied the shards it was given (they may change after);
        returns the seconds waited."""
        t0 = time.perf_counter()
        self._copied.wait()
        self.settle_s = time.perf_counter() - t0
        return self.settle_s

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step` wait for the round's copy of the shards it is about to update (a step
        pre-hook, removed by `close`)."""
        if self._guard is not None:
            self._guard.remove()
        def before_step(*_) -> None:  # a pre-hook returns None (or new arguments)
            self.settle()

        self._guard = optimizer.register_step_pre_hook(before_step)

    def in_flight(self) -> bool:
        """Whether a round still sends or receives in the background."""
        t = self._thread
        return t is not None and t.is_alive()

    def _complete_step(self) -> int:
        """The newest step whose own copy and every kept copy are complete here (-1: none)."""
        steps = set(self.own.steps())
        for s in self.kept.values():
            steps &= set(s.steps())
        return max(steps, default=-1)

    def _copy_and_round(self, own: Copy, step: int, held: Held, state: dict[str, Any]) -> None:
        """The background part of a round: copy `held` into `own` (then the caller's shards are free to
        change), and send and receive (`_round`)."""
        t0 = time.perf_counter()
        try:
            _fill(own, step, held, state)
        except BaseException as e:  # the round sends nothing: the copy is not whole
            self._error = self.last_error = e.with_traceback(None)
            return
        finally:
            self.copy_s = time.perf_counter() - t0
            self._copied.set()
        self._round(own)

    def _round(self, own: Copy) -> None:
        """Send `own` to the buddy and receive the copies kept here (the snapshot group spans every rank
        of the default group, so group ranks are global ranks). The sends are posted first and depend on
        no receive, and each copy kept here counts as soon as its own receives end: a peer that died
        keeps no other rank's copy from arriving, nor a salvage from the copies that did."""
        t0 = time.perf_counter()
        try:
            g = self.group
            head = json.dumps(own.header).encode()
            sizes = torch.tensor([len(head), own.buf.numel()], dtype=torch.int64)
            head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8)  # referenced until the waits end
            kept = sorted(self.kept)
            got_sizes = {r: torch.empty(2, dtype=torch.int64) for r in kept}
            recv_sizes = {r: dist.irecv(got_sizes[r], r, group=g) for r in kept}
            sends = [dist.isend(t, self.buddy, group=g) for t in (sizes, head_t, own.buf)]
            moved = own.buf.numel() * (1 + len(kept))  # a kept copy is about this rank's own size
            bound = self.bound_s or ROUND_SLACK_S + moved / ROUND_FLOOR_BYTES_PER_S
            deadline = timedelta(seconds=min(bound, self.timeout_s))
            for r in kept:
                recv_sizes[r].wait(deadline)
                c = self.kept[r].spare(self.committed)
                c.step = -1  # filling: not complete until the receive is
                n = int(got_sizes[r][1])
                if c.buf is None or c.buf.numel() != n:
                    c.buf = torch.empty(n, dtype=torch.uint8)
                got_head = torch.empty(int(got_sizes[r][0]), dtype=torch.uint8)
                for w in (dist.irecv(got_head, r, group=g), dist.irecv(c.buf, r, group=g)):
                    w.wait(deadline)
                c.header = json.loads(bytes(got_head.numpy()))
                c.step = int(c.header["step"])
            for w in sends:
                w.wait(deadline)
            self.round_s = time.perf_counter() - t0
            self.bound_s = next_bound(self.bound_s, ok=True, round_s=self.round_s)
        except BaseException as e:  # a peer died mid-round: what was filling stays incomplete
            # kept without its traceback, whose frames would keep this round's buffers alive
            self._error = self.last_error = e.with_traceback(None)
            self.bound_s = next_bound(self.bound_s, ok=False, round_s=time.perf_counter() - t0)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the round in flight; False if it is still running after `timeout_s` (it is then
        abandoned: the copies it was filling never count)."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():  # the copies it fills are marked incomplete until their receive ends
                return False
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            log.warning("a peer snapshot round failed (%s): its copies do not count", e)
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Drop every copy (the group that took them is gone). A round still in flight after `timeout_s`
        keeps only the two buffers it is sending and filling, until its waits end (the round's bound)."""
        self.wait(timeout_s)
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        self.own, self.kept = Slot(), {}

    # -- after a failure -------------------------------------------------------------------------------
    def holdings(self) -> dict[int, tuple[int, ...]]:
        """{old rank: the complete snapshot steps of its copy held here} (this rank's own, and those it
        keeps)."""
        out = {self.rank: self.own.steps()} if self.own.steps() else {}
        out.update({r: s.steps() for r, s in self.kept.items() if s.steps()})
        return out

    def handover(self, step: int, ranks) -> tuple[dict[int, Held], dict[str, Any] | None]:
        """The copies of `ranks` at `step` held here (as the exchange's old shards), and the JSON state
        that goes with that step (from its own copy, else from any copy of that step it holds: every
        rank's state of one step serves)."""
        out: dict[int, Held] = {}
        for r in ranks:
            c = (self.own if r == self.rank else self.kept[r]).at(step)
            if c is None:
                raise RuntimeError(f"rank {self.rank} holds no copy of rank {r} at snapshot step {step} (it "
                                   f"holds {self.holdings()}; last failed round: {self.last_error!r})")
            out[r] = c.held()
        any_copy = [c for c in (self.own.at(step), *(s.at(step) for s in self.kept.values())) if c is not None]
        return out, (any_copy[0].header["state"] if any_copy else None)


def _fill(c: Copy, step: int, held: Held, state: dict[str, Any]) -> None:
    """Copy `held`'s tensors into `c`'s buffer (allocated, or re-allocated for another size)."""
    keys = sorted(held.tensors)
    sizes = [held.tensors[k].numel() * held.tensors[k].element_size() for k in keys]
    starts, total = pool_layout(sizes)
    if c.buf is None or c.buf.numel() != total:
        c.buf = torch.empty(total, dtype=torch.uint8)
    c.step = -1
    meta = {}
    for k, a, n in zip(keys, starts, sizes):
        t = held.tensors[k]
        c.buf[a:a + n].view(t.dtype).view(t.shape).copy_(t.detach())
        b = held.boxes[k]
        meta[k] = [list(b.offsets), list(b.sizes), str(t.dtype).removeprefix("torch."), a]
    c.header = {"step": step, "keys": meta, "optimizer_steps": dict(held.optimizer_steps), "state": state}
    c.step = step
