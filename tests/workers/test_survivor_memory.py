"""A worker that survives reconfigurations holds the same objects after the 6th as after the 2nd: what an
old layout held (model, optimizer, staging pool, hand-over pieces, process groups) is freed when the
worker drops it, not whenever Python's cyclic collector happens to run (benchmarks/soak.py measures the
resident memory of every process over a long run)."""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import asdict

import pytest

from tests.multiproc import run_ranks
from tests.ports import free_port

CFG = {"name": "soak", "model": {"preset": "tiny", "overrides": {"n_layers": 2}},
       "data": {"source": "synthetic", "seq_len": 16},
       "train": {"steps": 1000, "global_batch_size": 4, "micro_batch_size": 2, "seed": 3},
       "parallel": {"dp_mode": "shard"},
       "checkpoint": {"interval_steps": 1000, "async_save": True}}


def census() -> dict[str, int]:
    """Live objects of the kinds a layout owns, and the bytes of the CPU tensor storages among them.
    0-d tensors are left out: a step's passing scalars (a loss, a norm) may still be alive in another
    thread when the census runs, and a layout's state is never made of them alone."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    kinds = {"tensors": torch.Tensor, "modules": torch.nn.Module, "optimizers": torch.optim.Optimizer,
             "meshes": DeviceMesh}
    out = dict.fromkeys([*kinds, "tensor_bytes"], 0)
    storages: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.dim() == 0:
            continue
        for name, kind in kinds.items():
            if isinstance(o, kind):
                out[name] += 1
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            try:
                s = o.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            except (RuntimeError, NotImplementedError):  # fake and wrapper tensors have no storage of their own
                pass
    out["tensor_bytes"] = sum(storages.values())
    from workers.snapshots import Copy

    out["snapshot_buffers"] = sum(1 for o in gc.get_objects() if isinstance(o, Copy) and o.buf is not None)
    import torch.distributed as dist

    out["process_groups"] = len(dist.distributed_c10d._world.pg_map)
    return out


def survivor_body(cfg_dict: dict, run_dir: str, ports: list[int]) -> list[dict]:
    """Rank 0 survives six reconfigurations between one and two workers (live shrink, live grow, storage
    shrink, storage grow, live shrink, live grow), each followed by a non-blocking save and a step, as
    the coordinator does after a live move; automatic cyclic collection off, as it effectively is in a
    worker between its rare full collections. The two ranks are on two nodes, so every two-worker group
    takes peer snapshots at each step (their buffers are part of the census). Returns rank 0's census
    after each."""
    import torch.distributed as dist

    from workers.actor import Worker
    from workers.config import JobConfig, job_plan

    rank = dist.get_rank()
    dist.destroy_process_group()
    os.environ["ELASTRON_NODE_ID"] = f"node-{rank}"  # two nodes: every two-worker group takes peer snapshots
    cfg = JobConfig.from_dict(cfg_dict)
    one, two = job_plan(cfg, 1), job_plan(cfg, 2)
    port = iter(ports)
    w = Worker(cfg, run_dir)
    gc.disable()
    addr = "127.0.0.1"
    try:
        w.join(rank=rank, world_size=2, master_addr=addr, master_port=next(port), plan=two)
        first = w.run(until_step=1000, steps=1)
        out = []
        for path, size in (("live", 1), ("live", 2), ("storage", 1), ("storage", 2), ("live", 1), ("live", 2)):
            old = 3 - size
            if path == "live":
                if rank < old:
                    w.hand_over()
                w.reshard(rank=rank, world_size=2, master_addr=addr, master_port=next(port),
                          old_plan=two if old == 2 else one, new_plan=two if size == 2 else one,
                          old_rank=rank if rank < old else None, new_rank=rank if rank < size else None,
                          old_to_group={r: r for r in range(old)}, new_to_group={r: r for r in range(size)},
                          nodes={0: "n", 1: "n"})
            elif rank < old:
                w.checkpoint(blocking=True)
                w.leave()
            p = next(port)
            if rank < size:
                w.join(rank=rank, world_size=size, master_addr=addr, master_port=p, plan=two if size == 2 else one,
                       adopt=path == "live")
                w.checkpoint(blocking=False)
                w.run(until_step=1000, steps=1)
            if rank == 0:
                w.trainer.flush_checkpoint()
                if w.snapshots is not None:
                    w.snapshots.wait()  # the step's snapshot round, still receiving in the background
                out.append(census())
        w.leave()
        taken = first.rows[0].snapshot
        return {"census": out, "first_snapshot": None if taken is None else asdict(taken)}
    finally:
        gc.enable()


@pytest.mark.dist
def test_a_survivor_holds_after_the_6th_reconfiguration_what_it_held_after_the_2nd(tmp_path):
    ports = [free_port() for _ in range(14)]
    got = run_ranks(2, survivor_body, CFG, str(tmp_path), ports)[0]
    after = got["census"]
    # the step's row says what its snapshot cost the training thread (the first round: nothing committed
    # yet); the copy itself runs in the background (copy_s is the thread's wait for it, 0 when it had
    # ended), and the buffers counted below show it ran
    assert set(got["first_snapshot"]) == {"wait_s", "agree_s", "copy_s", "committed", "interval"}
    assert got["first_snapshot"]["committed"] == -1
    assert after[1]["modules"] > 0 and after[1]["tensor_bytes"] > 0  # the census sees the trainer
    # two workers: its own copy and its buddy's of the one round taken; one worker: none
    assert after[1]["snapshot_buffers"] == 2 and after[0]["snapshot_buffers"] == 0
    assert after[5] == after[1], f"after the 2nd: {after[1]}, after the 6th: {after[5]}"


def test_the_checkpoint_managers_step_hook_keeps_no_optimizer_alive(tmp_path):
    """The staging hook on `optimizer.step()` must not close a cycle through the manager: a dropped
    trainer's optimizer (its parameters, its moments) and staging pool go by reference counting."""
    import torch

    from parallel.checkpoint.manager import CheckpointManager

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    ck = CheckpointManager(str(tmp_path), async_save=True)
    ck.save(1, model, opt, state={}, blocking=False, overlap_staging=True)
    opt.step()  # waits for the deferred staging copy through the hook
    ck.flush()
    alive = weakref.ref(opt), weakref.ref(ck)
    gc.disable()
    try:
        del opt, ck
        assert [r() is None for r in alive] == [True, True]
    finally:
        gc.enable()


def test_close_removes_the_step_hook(tmp_path):
    import torch

    from parallel.checkpoint.manager import CheckpointManager

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    ck = CheckpointManager(str(tmp_path), async_save=True)
    ck.save(1, model, opt, state={}, blocking=False, overlap_staging=True)
    assert len(opt._optimizer_step_pre_hooks) == 1
    assert ck.close()
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_a_group_formed_and_destroyed_leaves_the_excepthook_as_it_was(monkeypatch):
    """torch's init_process_group wraps sys.excepthook in a new closure each time; a worker re-forms its
    group at every reconfiguration, so without unwrapping the chain grows by one per group."""
    import sys

    import torch

    from workers.runtime import destroy_process_group, init_process_group

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    before = sys.excepthook
    for _ in range(2):
        init_process_group(torch.device("cpu"), timeout_s=30)
        assert sys.excepthook is not before  # torch's rank prefix while the group lives
        destroy_process_group()
        assert sys.excepthook is before
        for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(var, raising=False)
