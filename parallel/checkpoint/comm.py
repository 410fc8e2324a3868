"""The checkpoint's own collectives: a gloo group apart from the training loop's, so a writer thread's
collectives never interleave with the loop's (gloo, or NCCL on GPUs) on the default group."""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Comm:
    """Collectives on the checkpoint's own gloo group; trivial ones when there is no process group
    (tools and unit tests run in one process)."""

    def __init__(self, timeout_s: float) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = None
        self.rank, self.world = 0, 1
        if self.enabled:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            # DCP warns on every single-process save/load; here that is the intent, not a mistake.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        if not self.enabled:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, ok: bool, token: int) -> bool:
        """Whether every rank passes `ok` true with the same `token` (an int below 2**62): two integers
        reduced, whatever the world size (no objects gathered)."""
        if not self.enabled:
            return ok
        t = torch.tensor([0 if ok else 1, token, -token], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t[0].item() == 0 and t[1].item() == -t[2].item()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)
