"""A worker whose last attempt to join a group failed (a peer died during the rendezvous) joins the next
group like a fresh process: torch names a process's default group by a counter that only destroying a
group resets, so a failed `init_process_group` used to leave it one ahead, and that worker and a peer
with a clean history then waited on different store keys until the timeout, at every re-form (a job
stuck in 120 s form timeouts after a double fault in the chaos run of 2026-11-27)."""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks
from tests.ports import free_port

pytestmark = pytest.mark.dist


def body(port: int) -> dict:
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from workers.runtime import destroy_process_group, init_process_group

    destroy_process_group()  # run_ranks' group: the workers start this test without a rank
    rank = int(os.environ["RANK"])
    failed = None
    if rank == 1:  # a rendezvous whose peer never comes
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2,
                                    timeout=timedelta(seconds=1))
        except Exception as e:  # noqa: BLE001 (gloo's timeout surfaces as several error types)
            failed = type(e).__name__
        assert not dist.is_initialized()
    os.environ["MASTER_PORT"] = str(port)
    init_process_group(torch.device("cpu"), timeout_s=20)
    x = torch.ones(1)
    dist.all_reduce(x)
    return {"failed": failed, "sum": x.item(), "name": dist.distributed_c10d._get_default_group().group_name}


def test_a_worker_whose_last_join_failed_forms_the_next_group_with_a_fresh_peer():
    r0, r1 = run_ranks(2, body, free_port(), timeout=120)
    assert r1["failed"] is not None and r0["failed"] is None  # the failed attempt really happened
    assert r0["sum"] == r1["sum"] == 2.0
    assert r0["name"] == r1["name"] == "0"
