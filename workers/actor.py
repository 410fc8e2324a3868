"""The body of one worker (one rank): a plain class the coordinator runs as a Ray actor.

A worker outlives layouts: `join()` forms (or re-forms) the process group and builds the trainer for a
layout, resuming from the latest committed checkpoint; `leave()` drops both but keeps the process (and
its imported torch) alive, so a planned resize costs a process-group re-form, not a process start.
Knows nothing of Ray beyond being called; knows nothing of HTTP.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.config import JobConfig


class Worker:
    def __init__(self, cfg: JobConfig, run_dir: str, *, threads: int = 1):
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        import torch

        torch.set_num_threads(threads)
        from workers.config import JobConfig

        if not isinstance(cfg, JobConfig):  # e.g. a caller still sending the spec as a dict
            raise TypeError(f"Worker needs the JobConfig parsed where the spec entered, got {type(cfg).__name__}")
        self.cfg = cfg  # not parsed again here; its data.path is checked where the data is read
        self.run_dir = Path(run_dir)
        self.trainer = None
        self.rank: int | None = None

    # -- placement and rendezvous --------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def free_port(self) -> int:
        """A port free on this worker's node, for a rendezvous that rank 0 hosts."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    # -- group membership ------------------------------------------------------------------------------
    def join(self, *, rank: int, world_size: int, master_addr: str, master_port: int, plan: dict,
             timeout_s: float = 120.0) -> dict[str, Any]:
        """Join a process group as `rank` and build the trainer for `plan` (a Plan.to_dict(): layout and
        micro batch, as the planner chose them), resuming from the latest committed checkpoint, if any.
        Returns the step training will continue from."""
        from parallel.planner import Plan
        from workers.runtime import init_process_group, pick_device
        from workers.trainer import Trainer

        self.leave()
        t0 = time.perf_counter()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        device = pick_device(self.cfg.resources.device)
        init_process_group(device, timeout_s=timeout_s)
        t1 = time.perf_counter()
        self.trainer = Trainer(self.cfg, plan=Plan.from_dict(plan), device=device,
                               run_dir=self.run_dir).build()
        self.rank = rank
        return {"step": self.trainer.step, "pg_s": t1 - t0, "build_s": time.perf_counter() - t1}

    def leave(self) -> None:
        """Drop the trainer and the process group; the process stays warm for the next layout."""
        from workers.runtime import destroy_process_group

        if self.trainer is not None:
            try:
                self.trainer.close()
            finally:
                self.trainer = None
        destroy_process_group()
        self.rank = None

    # -- training --------------------------------------------------------------------------------------
    def run(self, *, until_step: int, steps: int) -> list[dict]:
        """Train `steps` steps (fewer if `until_step` comes first). Every rank gets the same count from
        the coordinator: a rank that stopped on its own clock would leave the others blocked in the next
        step's collectives. Short calls keep the coordinator responsive between them."""
        if self.trainer is None:
            raise RuntimeError("worker has not joined a group")
        out = []
        for _ in range(steps):
            if self.trainer.step >= until_step:
                break
            out.append(self.trainer.train_step().to_dict())
        ck = getattr(self.trainer, "checkpointer", None)
        committed = (ck.last_committed_step if ck is not None else None) or 0
        for row in out:
            row["committed_step"] = committed
        return out

    def checkpoint(self) -> int:
        """Save at the current step and wait until it is committed (a planned resize calls this)."""
        if self.trainer is None:
            raise RuntimeError("worker has not joined a group")
        self.trainer.save_checkpoint(blocking=True)
        return self.trainer.step

    def step(self) -> int | None:
        return None if self.trainer is None else self.trainer.step
