"""Process-group set-up for one rank: env:// under torchrun or Ray, a private single-rank group otherwise."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def init_process_group(device: torch.device, *, timeout_s: float = 300.0) -> None:
    """Initialise the default group from env://. A lone process gets a loopback rendezvous of its own."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    # gloo always, for CPU collectives (DCP, async save); nccl for CUDA tensors when on GPUs.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    # With no group in this process, name the new one as a fresh process would: torch names the default
    # group by a counter that destroying a group resets, but a failed init (a peer died during the
    # rendezvous) leaves it raised, and the ranks' store keys would then differ until the timeout.
    _reset_group_names()
    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout_s))


def _reset_group_names() -> None:
    from torch.distributed import distributed_c10d

    distributed_c10d._world.group_count = 0


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
