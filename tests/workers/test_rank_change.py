"""A worker that changes rank between two layouts of the same shape (rank 1 of a 2-rank group, then rank 0
of the next) holds its new rank's box: nothing of the mesh it had before leaks into the new trainer. On the
way, what a group's first step does not need waits until after it: the peer snapshots, and the checkpoint
manager of a group that adopted moved state (its first save sets it up).
DTensor's sharding-propagation caches match meshes by shape and ranks, not by this process's place in
them; kept across the change, they handed the new model the old mesh and its coordinate, so a live
transfer's fill failed ("received 0 of the 65536 elements") and a checkpoint resume loaded the other
rank's rows into the shard (`workers.runtime.forget_meshes`)."""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks
from tests.ports import free_port
from tests.workers.test_survivor_memory import CFG


def boxes(trainer) -> dict[str, tuple]:
    """Offsets of this rank's box of every model tensor, as its parameters report them."""
    from parallel.checkpoint import state as state_mod

    tensors, _ = state_mod.collect(trainer.model, trainer.optimizer)
    return {p.key: tuple(p.offsets) for p in state_mod.pieces(tensors) if p.key.startswith("model.")}


def swap_body(cfg_dict: dict, run_dir: str, ports: list[int]) -> dict:
    """Each rank trains a step as rank r, hands its state over live to the layout where it is rank 1 - r,
    then (after a save) resumes from storage as rank r again. Returns, per phase, the boxes its
    parameters report and the full tensors of the model."""
    import torch.distributed as dist

    from workers.actor import Worker
    from workers.config import JobConfig, job_plan

    import os

    rank = dist.get_rank()
    dist.destroy_process_group()
    os.environ["ELASTRON_NODE_ID"] = f"node{rank}"  # two nodes: each rank's peer snapshots go to the other
    cfg = JobConfig.from_dict(cfg_dict)
    two = job_plan(cfg, 2)
    port = iter(ports)
    addr = "127.0.0.1"
    w = Worker(cfg, run_dir)

    def snapshot() -> dict:
        full = {n: p.full_tensor().clone() for n, p in w.trainer.model.named_parameters()}
        return {"boxes": boxes(w.trainer), "full": full}

    out = {}
    w.join(rank=rank, world_size=2, master_addr=addr, master_port=next(port), plan=two)
    out["joined"] = {"snapshots": w.snapshots is not None, "checkpointer": w.trainer.checkpointer is not None}
    (row,) = w.run(until_step=1000, steps=1).rows
    out["first_row"] = {"set_up_after": row.set_up_after.to_dict(), "snapshots": w.snapshots is not None}
    out["before"] = snapshot()
    w.hand_over()
    w.reshard(rank=rank, world_size=2, master_addr=addr, master_port=next(port), old_plan=two, new_plan=two,
              old_rank=rank, new_rank=1 - rank, old_to_group={0: 0, 1: 1}, new_to_group={0: 1, 1: 0},
              nodes={0: "n", 1: "n"})
    w.join(rank=1 - rank, world_size=2, master_addr=addr, master_port=next(port), plan=two, adopt=True)
    out["adopted"] = {"snapshots": w.snapshots is not None, "checkpointer": w.trainer.checkpointer is not None}
    out["live"] = snapshot()
    w.checkpoint(blocking=True)  # the first save sets up the checkpoint manager the adopting build left
    w.leave()
    w.join(rank=rank, world_size=2, master_addr=addr, master_port=next(port), plan=two)  # from storage
    out["storage"] = snapshot()
    w.leave()
    return out


@pytest.mark.dist
def test_a_worker_that_changes_rank_holds_its_new_ranks_box(tmp_path):
    ports = [free_port() for _ in range(8)]
    got = run_ranks(2, swap_body, CFG, str(tmp_path), ports)
    # where each rank's box starts, by the rank it had: from the first layout, built fresh
    start = {r: got[r]["before"]["boxes"] for r in (0, 1)}
    assert start[0] != start[1]
    for r in (0, 1):  # what the first step does not need is set up after it (docs/recovery.md)
        assert got[r]["joined"] == {"snapshots": False, "checkpointer": True}  # a resume needs its manager
        after = got[r]["first_row"]["set_up_after"]
        assert got[r]["first_row"]["snapshots"] and after["snapshot_bytes"] > 0 and after["snapshots_s"] >= 0
        assert got[r]["adopted"] == {"snapshots": False, "checkpointer": False}
    for r in (0, 1):
        assert got[r]["live"]["boxes"] == start[1 - r], f"worker {r}, rank {1 - r} after the live move"
        assert got[r]["storage"]["boxes"] == start[r], f"worker {r}, rank {r} again after the resume"
        for phase in ("live", "storage"):
            for name, t in got[r]["before"]["full"].items():
                assert got[r][phase]["full"][name].equal(t), f"{name} differs after the {phase} change"
