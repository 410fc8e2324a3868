"""Rank bodies for tests/multiproc.run_ranks (importable by name in spawned children)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.layout import Layout
from parallel.parallelize import full_params
from tests.multiproc import rank_device
from workers.config import JobConfig


def train_body(cfg_dict: dict, layout: str, steps: int, run_dir: str | None = None,
               return_params: bool = True, record_samples: bool = False) -> dict:
    """Train until step `steps` under `layout` (resuming from RUN_DIR/checkpoints when `run_dir` holds
    any); return per-step losses/grad norms of the steps run, the step resumed from, this rank's
    gathered parameters (for its pipeline stage) and, optionally, the sample ids this rank consumed."""
    from workers.trainer import Trainer

    cfg = JobConfig.from_dict(cfg_dict)
    lay = Layout.parse(layout, dp_mode=cfg.parallel.dp_mode)
    trainer = Trainer(cfg, layout=lay, device=rank_device(), run_dir=run_dir).build()
    samples: list[list[int]] = []
    if record_samples:
        trainer.on_batch = lambda b: samples.append(list(b.sample_ids))
    metrics = trainer.fit(steps)
    out = {
        "losses": [m.loss for m in metrics],
        "grad_norms": [m.grad_norm for m in metrics],
        "val_losses": [m.val_loss for m in metrics],
        "steps": [m.step for m in metrics],
        "dp_rank": trainer.dp_rank,
        "samples": samples,
        "resumed_from": trainer.resumed_from.step if trainer.resumed_from is not None else None,
    }
    if return_params:
        out["params"] = full_params(trainer.model)
    return out


def worker_plan_body(cfg_dict: dict, plan_dict: dict, run_dir: str) -> dict:
    """Join a one-rank group through the worker actor's body with the plan of `plan_dict` (sent whole, as
    WorkerGroup.form sends it) and train one step; return the micro batches the trainer fed the model."""
    from parallel.planner import Plan
    from tests.ports import free_port
    from workers.actor import Worker
    from workers.config import JobConfig

    worker = Worker(JobConfig.from_dict(cfg_dict), run_dir)
    worker.join(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), plan=Plan.from_dict(plan_dict))
    shapes: list[list[tuple[int, ...]]] = []
    worker.trainer.on_batch = lambda b: shapes.append([tuple(x.shape) for x in b.inputs])
    rows = worker.run(until_step=1, steps=1)
    out = {"micro_batch_size": worker.trainer.micro_batch_size, "n_microbatches": worker.trainer.n_microbatches,
           "shapes": shapes, "steps": [r.step for r in rows.rows]}
    worker.leave()
    return out


def checkpoint_placement_body(roots: dict[str, str]) -> dict:
    """Under dp_shard=2,tp=2 after one AdamW step, save step 1 into `roots["right"]` with the placement of
    that layout and into `roots["wrong"]` with one that says tp=4 (its boxes are not the rank's: the save
    must fall back to gathering boxes). Returns the full tensors and, per root, this rank's index names."""
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from models.config import model_config
    from models.llama import build_model
    from parallel.checkpoint.manager import CheckpointManager
    from parallel.checkpoint.placement import Placement
    from parallel.checkpoint.state import collect
    from parallel.parallelize import materialize, parallelize

    cfg = model_config("tiny", n_layers=2, dim=16, n_heads=2, n_kv_heads=2, ffn_hidden=32, vocab_size=32)
    params = {n: (tuple(p.shape), "float32") for n, p in build_model(cfg).named_parameters()}
    layout = Layout.parse("dp_shard=2,tp=2")
    model = build_model(cfg)
    parallelize(model, layout=layout, mesh=layout.build_mesh("cpu"))
    materialize(model, seed=3, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank() // 2))
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    for name, lay in (("right", layout), ("wrong", Layout(tp=4))):
        placement = Placement(layout=lay, n_layers=cfg.n_layers, params=params)
        CheckpointManager(roots[name], async_save=False, placement=placement).save(1, model, opt, state={}, blocking=True)
    tensors, _ = collect(model, opt)
    full = {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for k, t in tensors.items()}
    return {"full": full, "files": {n: sorted(os.listdir(os.path.join(r, "step-00000001"))) for n, r in roots.items()}}


def snapshot_rounds_body(nodes: list[str], steps: int) -> dict:
    """Take `steps` peer-snapshot rounds of a small fake shard (values rank * 100 + step) with ranks on
    `nodes`; return what this rank holds and the values of every copy it keeps."""
    import torch

    from parallel.live import Held
    from parallel.sharding import Box
    from workers.snapshots import PeerSnapshots

    rank = dist.get_rank()
    snaps = PeerSnapshots.start(nodes[rank], shard_bytes=1 << 10, available_bytes=None)
    committed, costs = [], []
    for step in range(1, steps + 1):
        w = torch.full((4, 3), float(rank * 100 + step))
        held = Held(tensors={"model.w": w, "optim.exp_avg.model.w": w[:2]},
                    boxes={"model.w": Box((rank * 4, 0), (4, 3)), "optim.exp_avg.model.w": Box((rank * 2, 0), (2, 3))},
                    optimizer_steps={"model.w": step})
        taken = snaps.take(step, held, {"lr_schedule": {"step": step}})
        snaps.settle()  # as the optimizer's step pre-hook does (`guard`)
        w.fill_(-1.0)  # the live shard moves on: the copy must not
        committed.append(snaps.committed)
        costs.append((taken.committed, taken.wait_s, taken.agree_s, taken.copy_s))
    snaps.wait()
    kept = {}
    for r in snaps.kept:
        helds, _ = snaps.handover(steps, [r])
        h = helds[r]
        kept[r] = {k: (h.tensors[k].flatten().tolist()[0], tuple(h.boxes[k].offsets)) for k in h.tensors}
    own, state = snaps.handover(steps, [rank])
    return {"holdings": snaps.holdings(), "committed": committed, "costs": costs, "kept": kept, "state": state,
            "own": own[rank].tensors["model.w"].flatten().tolist()[0], "steps": own[rank].optimizer_steps}


def snapshot_guard_body(numel: int) -> dict:
    """Two ranks on two nodes: take a snapshot of a live AdamW parameter of `numel` floats and step the
    optimizer straight after (the copy runs in the background, here starting 0.5 s late; `guard` makes
    the step wait for it).
    Returns whether the own and the kept copy equal the parameter as it was at the take, and whether
    the step changed it."""
    import time

    import torch

    import workers.snapshots
    from parallel.live import Held
    from parallel.sharding import Box
    from workers.snapshots import PeerSnapshots

    fill = workers.snapshots._fill

    def late_fill(*args) -> None:  # a copy that starts well after the step would, unless the step waits
        time.sleep(0.5)
        fill(*args)

    workers.snapshots._fill = late_fill
    rank = dist.get_rank()
    snaps = PeerSnapshots.start("ab"[rank], shard_bytes=numel * 4, available_bytes=None)
    w = torch.nn.Parameter(torch.full((numel,), float(rank + 1)))
    opt = torch.optim.AdamW([w], lr=0.5)
    snaps.guard(opt)
    before = w.detach().clone()
    held = Held(tensors={"model.w": w.detach()}, boxes={"model.w": Box((rank * numel,), (numel,))}, optimizer_steps={})
    snaps.take(1, held, {})
    w.grad = torch.ones_like(w)
    opt.step()  # right after the take: the pre-hook waits for the copy
    snaps.wait()
    own, _ = snaps.handover(1, [rank])
    kept, _ = snaps.handover(1, [1 - rank])
    snaps.close()
    return {"own_as_taken": bool(torch.equal(own[rank].tensors["model.w"], before)),
            "kept_whole": bool(torch.all(kept[1 - rank].tensors["model.w"] == float(2 - rank))),
            "stepped": not torch.equal(w.detach(), before), "guards_left": len(opt._optimizer_step_pre_hooks)}


def snapshot_peer_silent_body(timeout_s: float, slack_s: float, wait_s: float) -> dict:
    """Two ranks on two nodes take one snapshot round (group timeout `timeout_s`, a round's slack
    `slack_s`); in the second, rank 1 stops answering (its round sends and receives nothing, as a peer
    that died or hangs). Rank 0 reports whether its round ended within `wait_s`, and, after `close()`,
    how many of its snapshot buffers are still alive and which round threads still run."""
    import gc
    import threading
    import time
    import weakref

    import torch

    from parallel.live import Held
    from parallel.sharding import Box
    import workers.snapshots
    from workers.snapshots import PeerSnapshots

    workers.snapshots.ROUND_SLACK_S = workers.snapshots.ROUND_MIN_S = slack_s
    rank = dist.get_rank()
    snaps = PeerSnapshots.start(["a", "b"][rank], shard_bytes=1 << 18, available_bytes=None, timeout_s=timeout_s)
    w = torch.ones(256, 256)
    held = Held(tensors={"model.w": w}, boxes={"model.w": Box((rank * 256, 0), (256, 256))}, optimizer_steps={})
    snaps.take(1, held, {})
    snaps.wait()
    if rank == 1:
        snaps._round = lambda own: None  # round 2: this rank neither sends nor receives
    snaps.take(2, held, {})
    out: dict = {}
    if rank == 0:
        t0 = time.monotonic()
        out["ended"] = snaps.wait(timeout_s=wait_s)
        out["ended_s"] = time.monotonic() - t0
        out["failed"] = snaps.last_error is not None
        bufs = [weakref.ref(c.buf) for slot in (snaps.own, *snaps.kept.values()) for c in slot.copies
                if c.buf is not None]
        out["buffers"] = len(bufs)
        snaps.close()
        gc.collect()
        out["alive_buffers"] = sum(1 for r in bufs if r() is not None)
        out["round_threads"] = sum(1 for t in threading.enumerate() if t.name == "peer-snapshot")
    dist.barrier()  # rank 1 stays until rank 0 is done
    return out


def snapshot_buddy_silent_body(slack_s: float, poll_s: float) -> dict:
    """Three ranks on three nodes (buddies 0 -> 1 -> 2 -> 0) take a round of 16 MiB shards; in the second,
    rank 2 stops answering (it neither sends nor receives). Rank 1 still receives rank 0's copy, while its
    send to rank 2 cannot end (16 MiB does not fit the socket's buffers). Rank 1 reports whether rank 0's
    copy of step 2 counts among its holdings within `poll_s` (well inside the round's bound, `slack_s`),
    and whether its round was still waiting then."""
    import time

    import torch

    import workers.snapshots
    from parallel.live import Held
    from parallel.sharding import Box
    from workers.snapshots import PeerSnapshots

    workers.snapshots.ROUND_SLACK_S = workers.snapshots.ROUND_MIN_S = slack_s
    rank = dist.get_rank()
    snaps = PeerSnapshots.start("abc"[rank], shard_bytes=1 << 24, available_bytes=None)
    w = torch.ones(2048, 2048)  # 16 MiB
    held = Held(tensors={"model.w": w}, boxes={"model.w": Box((rank * 2048, 0), (2048, 2048))}, optimizer_steps={})
    snaps.take(1, held, {})
    snaps.wait()
    if rank == 2:
        snaps._round = lambda own: None  # round 2: this rank neither sends nor receives
    snaps.take(2, held, {})
    out: dict = {}
    if rank == 1:
        t0 = time.monotonic()
        while 2 not in snaps.holdings().get(0, ()) and time.monotonic() - t0 < poll_s:
            time.sleep(0.01)
        out["holdings"] = snaps.holdings()
        out["round_waiting"] = snaps._thread is not None and snaps._thread.is_alive()
    snaps.wait()  # the rounds that wait on rank 2 end at their bound
    dist.barrier()  # rank 2 stays until the others are done
    return out


def snapshot_off_body(nodes: list[str], available: list[int | None] | None = None):
    """Start peer snapshots with ranks on `nodes`, rank r having `available[r]` bytes of memory free;
    return the buddy it got, or None when they are off."""
    from workers.snapshots import PeerSnapshots

    rank = dist.get_rank()
    snaps = PeerSnapshots.start(nodes[rank], shard_bytes=1 << 10, available_bytes=(available or [None] * 8)[rank])
    return None if snaps is None else snaps.buddy
