"""Tier 2: a collective stuck on a silent peer ends, so a failed group can be salvaged instead of waiting
out the collective timeout.

Rank 1 stays alive and never joins; rank 0's all-reduce hangs, and its control lane calls `Worker.abort()`
one second in (as the coordinator does after a peer failed). On NCCL the abort ends the collective while
the peer is still silent. Gloo has no abort (`Worker.abort` leaves it alone, by design): its collective
ends as soon as the silent peer's process closes its sockets, which this test checks instead, well
inside the group's 120 s timeout. The same test runs on both (tests/multiproc.py picks the backend).
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.multiproc import backend, rank_device, run_ranks

pytestmark = pytest.mark.dist

SILENT_S = {"nccl": 60.0, "gloo": 3.0}
"""How long rank 1 stays silent before leaving: on NCCL longer than the abort may take."""


def hung_body(silent_s: float, run_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from workers.actor import Worker
    from workers.config import JobConfig

    worker = Worker(JobConfig.from_dict({}), run_dir) if dist.get_rank() == 0 else None
    dist.barrier()  # both are up; from here rank 1 is silent
    if worker is None:
        time.sleep(silent_s)
        return {}
    aborted: list[bool] = []
    timer = threading.Timer(1.0, lambda: aborted.append(worker.abort()))
    t = torch.ones(4, device=rank_device())
    timer.start()
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        t.sum().item()  # on CUDA the collective runs on a stream: wait for it, as a training step does
        outcome = "completed"
    except Exception as e:  # noqa: BLE001 (which error a broken collective raises is the backend's)
        outcome = f"{type(e).__name__}: {str(e)[:200]}"
    elapsed = time.monotonic() - t0
    timer.join()
    return {"outcome": outcome, "elapsed": elapsed, "aborted": aborted}


def test_a_collective_hung_on_a_silent_peer_is_ended(tmp_path):
    silent = SILENT_S[backend()]
    r0, _ = run_ranks(2, hung_body, silent, str(tmp_path), timeout=silent + 60)
    assert r0["aborted"] == [True]
    assert r0["outcome"] != "completed", r0
    if backend() == "nccl":
        assert r0["elapsed"] < silent - 10, r0  # ended by the abort, while the peer was still silent
    else:
        # ended when the peer left (rank 1 starts its silence as it leaves the barrier, which can be a few ms
        # before rank 0 starts its clock), not by the abort at 1 s and not at the group's timeout
        assert silent - 0.5 <= r0["elapsed"] < silent + 30, r0
