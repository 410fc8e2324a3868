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

from tests.multiproc import run_ranks
from tests.ports import free_port

pytestmark = pytest.mark.dist

CFG = {
    "model": {"preset": "tiny", "overrides": {"n_layers": 3}},  # 3 layers: pp=2 stages are uneven
    "data": {"source": "synthetic", "seq_len": 16},
    "train": {"steps": 20, "global_batch_size": 12, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 2,
              "seed": 7},
    "checkpoint": {"interval_steps": 1000, "async_save": False},
}


def live_body(cfg_dict: dict, old: str, new: str, ports: list[int], run_dir: str) -> list[str]:
    import torch
    import torch.distributed as dist

    from models.llama import build_model
    from parallel import live
    from parallel.checkpoint.state import collect, local_box
    from parallel.exchange import plan_exchange
    from parallel.layout import Layout
    from parallel.sharding import boxes
    from workers.config import JobConfig
    from workers.trainer import Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    old_l, new_l = Layout.parse(old), Layout.parse(new)
    cfg = JobConfig.from_dict(cfg_dict)
    cpu = torch.device("cpu")

    def init(port: int, size: int) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)

    held, state = None, None
    if rank < old_l.world_size:
        init(ports[0], old_l.world_size)
        old_trainer = Trainer(cfg, layout=old_l, device=cpu, run_dir=run_dir).build()
        old_trainer.fit(3)  # ends with a committed checkpoint at step 3
        held = live.hold(old_trainer.model, old_trainer.optimizer)
        state = old_trainer._checkpoint_state()
        old_trainer.close()
        dist.destroy_process_group()

    init(ports[1], world)  # the transfer group: every worker of either layout
    meta = build_model(cfg.model.build())
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    n_layers = len(meta.layers)
    old_b, new_b = boxes(old_l, shapes, n_layers), boxes(new_l, shapes, n_layers)
    survivors = {r: r for r in range(min(old_l.world_size, new_l.world_size))}
    plan = plan_exchange(old_b, new_b, same_worker=survivors)
    steps: dict[str, int] = {}
    for part in _all_gather(held.optimizer_steps if held else {}, world):
        steps.update(part)
    box = [state]
    dist.broadcast_object_list(box, src=0)
    state = box[0]
    ident = {r: r for r in range(world)}
    pieces = live.transfer(plan, old_rank=rank if rank < old_l.world_size else None,
                           new_rank=rank if rank < new_l.world_size else None, held=held,
                           dtypes={k: torch.float32 for b in new_b.values() for k in b} | {
                               k: torch.float32 for b in old_b.values() for k in b},
                           old_to_group=ident, new_to_group=ident)
    dist.destroy_process_group()

    problems: list[str] = []
    if rank < new_l.world_size:
        init(ports[2], new_l.world_size)
        fed = Trainer(JobConfig.from_dict({**cfg_dict, "checkpoint": {"async_save": False}}), layout=new_l,
                      device=cpu).build()
        fed.adopt(pieces, steps, state)
        resumed = Trainer(cfg, layout=new_l, device=cpu, run_dir=run_dir).build()
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


def _all_gather(obj, world: int) -> list:
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


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
