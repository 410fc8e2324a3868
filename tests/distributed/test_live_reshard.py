"""Tier 2: a live reshard (state sent between workers, no storage) gives bitwise what a checkpoint gives.

Each case trains 3 steps under layout A (the run ends with a committed checkpoint, the storage path's
reference), then every worker holds its shards, all workers of A and B form one transfer group and run
the exchange plan, and each rank of B builds two trainers: one fed by the transfer, one resumed from the
checkpoint. Every local shard of the model and AdamW state, the step, the data position and the next
two steps' losses must be bitwise equal. The layout pairs cover dp <-> tp <-> pp, FSDP <-> replicate,
uneven shards, 3 -> 2 and 2 -> 3 ranks.
"""

from __future__ import annotations

import pytest

from tests.multiproc import rank_device, run_ranks
from tests.ports import free_port

pytestmark = pytest.mark.dist

CFG = {
    "model": {"preset": "tiny", "overrides": {"n_layers": 3}},  # 3 layers: pp=2 stages are uneven
    "data": {"source": "synthetic", "seq_len": 16},
    "train": {"steps": 20, "global_batch_size": 12, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 2,
              "seed": 7},
    "checkpoint": {"interval_steps": 1000, "async_save": False},
}


def live_body(cfg_dict: dict, old: str, new: str, ports: list[int], run_dir: str,
              pack_below: int | None = None, all_moved: bool = False, moments_moved: bool = False) -> list[str]:
    import torch
    import torch.distributed as dist

    from parallel import live

    if pack_below is not None:  # the tiny model's pieces are all small: make most travel on their own
        live.PACK_BELOW = pack_below
    from parallel.checkpoint.state import collect, local_box
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.reshard import exchange, hand_over
    from workers.trainer import Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    old_l, new_l = Layout.parse(old), Layout.parse(new)
    cfg = JobConfig.from_dict(cfg_dict)
    device = rank_device()  # the CPU, or this rank's GPU under ELASTRON_TEST_DEVICE=cuda
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # as workers.runtime joins

    def init(port: int, size: int) -> None:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)

    handover = None
    if rank < old_l.world_size:
        init(ports[0], old_l.world_size)
        old_trainer = Trainer(cfg, layout=old_l, device=device, run_dir=run_dir).build()
        old_trainer.fit(3)  # ends with a committed checkpoint at step 3
        handover = hand_over(old_trainer)
        old_trainer.close()
        dist.destroy_process_group()

    init(ports[1], world)  # the transfer group: every worker of either layout
    ident = {r: r for r in range(world)}
    received = exchange(handover, model=cfg.model.build(), old=old_l, new=new_l,
                        old_rank=rank if rank < old_l.world_size else None,
                        new_rank=rank if rank < new_l.world_size else None,
                        old_to_group={r: r for r in range(old_l.world_size)},
                        new_to_group={r: r for r in range(new_l.world_size)}, nodes={r: "n0" for r in ident},
                        device=device)
    dist.destroy_process_group()

    problems: list[str] = []
    if rank < new_l.world_size:
        init(ports[2], new_l.world_size)
        fed = Trainer(JobConfig.from_dict({**cfg_dict, "checkpoint": {"async_save": False}}), layout=new_l,
                      device=device).build(resume=False, init_weights=False)  # as a worker that adopts builds it
        filled = fed.adopt(received.pieces, received.optimizer_steps, received.state)
        if all_moved and (filled.copied or not filled.moved):
            problems.append(f"rank {rank} copied {filled.copied} bytes, moved {filled.moved}: every piece is a "
                            "whole shard here and should have become it without a copy")
        if moments_moved:  # every piece is a whole shard: the moments and plain tensors taken, DTensor params copied
            from torch.distributed.tensor import DTensor

            tensors, _ = collect(fed.model, fed.optimizer)
            nbytes = {k: local_box(t)[0].numel() * t.element_size() for k, t in tensors.items()}
            taken = sum(n for k, n in nbytes.items() if k.startswith("optim.") or not isinstance(tensors[k], DTensor))
            want = (taken, sum(nbytes.values()) - taken)
            if (filled.moved, filled.copied) != want:
                problems.append(f"rank {rank} moved {filled.moved} and copied {filled.copied} bytes, not {want}")
        resumed = Trainer(cfg, layout=new_l, device=device, run_dir=run_dir).build()
        if resumed.resumed_from is None or resumed.step != 3 or fed.step != 3:
            problems.append(f"steps: live {fed.step}, resumed {resumed.step}")
        a, _ = collect(fed.model, fed.optimizer)
        b, _ = collect(resumed.model, resumed.optimizer)
        if a.keys() != b.keys():
            problems.append(f"keys differ: {sorted(a.keys() ^ b.keys())[:3]}")
        for k in sorted(a.keys() & b.keys()):
            (x, ox), (y, oy) = local_box(a[k]), local_box(b[k])
            if ox != oy or not torch.equal(x, y):
                problems.append(f"rank {rank} {k}: live and checkpoint shards differ")
        if fed.loader.state_dict() != resumed.loader.state_dict():
            problems.append("data positions differ")
        la = [fed.train_step().loss for _ in range(2)]
        lb = [resumed.train_step().loss for _ in range(2)]
        if la != lb:
            problems.append(f"losses after the reshard differ: live {la}, checkpoint {lb}")
        resumed.close()
    return problems


@pytest.mark.parametrize("old,new", [
    ("dp=2", "tp=2"),                 # FSDP -> TP
    ("tp=2", "pp=2"),                 # TP -> pipeline
    ("pp=2", "dp=3"),                 # 2 -> 3 ranks, uneven FSDP shards
    ("dp=3", "dp_replicate=2"),       # 3 -> 2 ranks, FSDP -> replicate
    ("dp_shard=2,tp=2", "dp=1"),      # 4 -> 1: strided FSDP x TP shards into one process
])
def test_live_reshard_equals_the_checkpoint_path(tmp_path, old, new):
    from parallel.layout import Layout

    world = max(Layout.parse(old).world_size, Layout.parse(new).world_size)
    ports = [free_port() for _ in range(3)]
    problems = [p for r in run_ranks(world, live_body, CFG, old, new, ports, str(tmp_path)) for p in r]
    assert problems == []


@pytest.mark.parametrize("old,new,pack_below", [
    ("dp=2", "tp=2", 4096),           # FSDP row shards cut into TP columns: non-contiguous pieces, copied
    ("pp=2", "dp=3", 4096),           # uneven FSDP shards, contiguous runs sent as views; norms packed
    ("dp_shard=2,tp=2", "dp=1", 0),   # every piece its own message
])
def test_live_reshard_with_pieces_sent_one_by_one(tmp_path, old, new, pack_below):
    from parallel.layout import Layout

    world = max(Layout.parse(old).world_size, Layout.parse(new).world_size)
    ports = [free_port() for _ in range(3)]
    problems = [p for r in run_ranks(world, live_body, CFG, old, new, ports, str(tmp_path), pack_below)
                for p in r]
    assert problems == []


def test_join_of_a_replica_takes_the_pieces_as_shards(tmp_path):
    """2 -> 3 replicas (a join): the joiner receives whole tensors and the survivors keep their own, so
    every byte becomes a shard as it is (nothing copied), and the result is still bitwise the checkpoint's."""
    ports = [free_port() for _ in range(3)]
    problems = [p for r in run_ranks(3, live_body, CFG, "dp_replicate=2", "dp_replicate=3", ports, str(tmp_path),
                                     None, True) for p in r]
    assert problems == []



def fill_body(cfg_dict: dict, layout: str) -> dict:
    """Train one step under `layout`, hand the state over as a worker that is then dropped does, and fill
    a fresh trainer (built as a worker that adopts builds it) with each tensor's whole shard. Returns
    what `fill` moved and copied, what it should have by kind, and whether every shard and the next
    step's loss equal the old trainer's."""
    import torch
    from torch.distributed.tensor import DTensor

    from parallel.checkpoint.state import collect, local_box
    from parallel.layout import Layout
    from parallel.live import Got
    from workers.config import JobConfig
    from workers.reshard import hand_over
    from workers.trainer import Trainer

    cfg = JobConfig.from_dict({**cfg_dict, "checkpoint": {"async_save": False}})
    old = Trainer(cfg, layout=Layout.parse(layout), device=torch.device("cpu")).build(resume=False)
    old.train_step()
    before, _ = collect(old.model, old.optimizer)
    before = {k: local_box(t)[0].clone() for k, t in before.items()}
    held = hand_over(old).held
    state = old.checkpoint_state()
    pieces = {k: [Got(held.boxes[k], t, held.movable)] for k, t in held.tensors.items()}
    new = Trainer(cfg, layout=Layout.parse(layout), device=torch.device("cpu")).build(resume=False, init_weights=False)
    filled = new.adopt(pieces, held.optimizer_steps, state)
    after, _ = collect(new.model, new.optimizer)
    nbytes = {k: local_box(t)[0].numel() * t.element_size() for k, t in after.items()}
    taken = sum(n for k, n in nbytes.items() if k.startswith("optim.") or not isinstance(after[k], DTensor))
    moment = next(k for k in after if k.startswith("optim.") and isinstance(after[k], DTensor))
    return {"filled": (filled.moved, filled.copied), "want": (taken, sum(nbytes.values()) - taken),
            "equal": all(torch.equal(local_box(after[k])[0], before[k]) for k in before) and before.keys() == after.keys(),
            "shares": local_box(after[moment])[0].data_ptr() == held.tensors[moment].data_ptr()}


def test_a_whole_shard_of_an_optimizer_moment_becomes_the_moment():
    """FSDP's moments are DTensors the optimizer alone holds: a whole movable piece becomes the moment
    (a DTensor of the same spec over the piece's memory), no copy; the parameters, whose shards FSDP keeps
    in storage of its own, are copied in. Every shard ends bitwise as it was."""
    for got in run_ranks(2, fill_body, CFG, "dp_shard=2"):
        assert got["filled"] == got["want"] and got["want"][0] > 0 and got["want"][1] > 0
        assert got["equal"] and got["shares"]
