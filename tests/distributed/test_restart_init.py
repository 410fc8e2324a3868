"""Tier 2: a restart does no throw-away initialisation, and a fresh start initialises only each rank's shard.

Memory that a load will fill is allocated unset; with `parallel.unset.SENTINEL` set to NaN (the test
build) it starts as NaN, so after a resume (own run directory or `checkpoint.resume_from`), a
`model.init_from` import, or a live reshard's adopt under dp=2, tp=2 and pp=2, a NaN left in any weight
or AdamW moment is an element the load did not write, and no random value may have been drawn. A fresh
start draws only its shard's values: doubling tp (or dp_shard) halves each rank's count, and the shards
are the slices of the single-process model's weights.
"""

from __future__ import annotations

import shutil

import pytest

from tests.multiproc import run_ranks
from tests.ports import free_port

pytestmark = pytest.mark.dist

CFG = {
    "model": {"preset": "tiny", "overrides": {"n_layers": 3}},  # 3 layers: pp=2 stages are uneven
    "data": {"source": "synthetic", "seq_len": 16},
    "train": {"steps": 20, "global_batch_size": 4, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 1,
              "seed": 3},
    "checkpoint": {"interval_steps": 1000, "async_save": False},
}
LAYOUTS = ["dp=2", "tp=2", "pp=2"]


def _unwritten(trainer) -> dict:
    """Keys of this rank's weights and AdamW moments that still hold a NaN, and how many there are."""
    import torch

    from parallel.checkpoint.state import collect, local_box

    tensors, steps = collect(trainer.model, trainer.optimizer)
    bad = sorted(k for k, t in tensors.items() if torch.isnan(local_box(t)[0]).any())
    return {"nan": bad, "n_model": sum(k.startswith("model.") for k in tensors),
            "n_moments": sum(k.startswith("optim.") for k in tensors), "optimizer_steps": steps}


def train_body(cfg_dict: dict, run_dir: str, steps: int) -> None:
    import torch

    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.trainer import Trainer

    t = Trainer(JobConfig.from_dict(cfg_dict), layout=Layout.parse("dp=1"), device=torch.device("cpu"),
                run_dir=run_dir).build()
    t.fit(steps)  # ends with a committed checkpoint
    t.close()


def sentinel_build_body(cfg_dict: dict, layout: str, run_dir: str | None, how: str) -> dict:
    """Build a trainer under `layout` with the NaN sentinel on; `how`: resume (its run directory), or
    unset (no resume, no init: what the sentinel alone leaves)."""
    import torch

    from parallel import unset
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.disk_checks import resolve_init_from
    from workers.trainer import Trainer

    unset.SENTINEL = float("nan")
    cfg = resolve_init_from(JobConfig.from_dict(cfg_dict))
    t = Trainer(cfg, layout=Layout.parse(layout), device=torch.device("cpu"), run_dir=run_dir)
    t.build(resume=how == "resume", init_weights=how != "unset")
    out = _unwritten(t)
    out.update(step=t.step, init_elements=t.init_elements,
               resumed_from=t.resumed_from.step if t.resumed_from is not None else None)
    if how == "resume":
        out["loss"] = t.train_step().loss  # and it trains on
    t.close()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A run directory whose checkpoint is at step 2 (AdamW moments included)."""
    d = str(tmp_path_factory.mktemp("trained"))
    run_ranks(1, train_body, CFG, d, 2)
    return d


def test_the_sentinel_marks_every_element_of_an_unset_build():
    """The control: without a load, every weight of an unset build is NaN, so the tests below can fail."""
    (r,) = run_ranks(1, sentinel_build_body, CFG, "dp=1", None, "unset")
    assert r["n_model"] > 0 and len(r["nan"]) == r["n_model"]
    assert r["init_elements"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resume_writes_every_weight_and_moment_and_draws_nothing(trained, tmp_path, layout):
    run_dir = str(tmp_path / "run")
    shutil.copytree(trained, run_dir)
    results = run_ranks(2, sentinel_build_body, CFG, layout, run_dir, "resume")
    for r in results:
        assert r["resumed_from"] == 2 and r["step"] == 2
        assert r["n_moments"] == 2 * r["n_model"] > 0, "AdamW moments were loaded"
        assert r["nan"] == []
        assert r["init_elements"] == 0
    assert len({r["loss"] for r in results}) == 1 and results[0]["loss"] == results[0]["loss"]  # not NaN


def test_resume_from_another_runs_checkpoints_writes_everything(trained, tmp_path):
    cfg = {**CFG, "checkpoint": {**CFG["checkpoint"], "resume_from": f"{trained}/checkpoints"}}
    results = run_ranks(2, sentinel_build_body, cfg, "tp=2", str(tmp_path / "run"), "resume")
    for r in results:
        assert r["resumed_from"] == 2 and r["nan"] == [] and r["init_elements"] == 0
        assert r["n_moments"] == 2 * r["n_model"]


def test_init_from_writes_every_weight_and_draws_nothing(trained, tmp_path):
    from parallel.checkpoint.validate import step_dir_name
    from parallel.export import export_checkpoint

    hf = export_checkpoint(f"{trained}/checkpoints/{step_dir_name(2)}", str(tmp_path / "hf"))
    cfg = {**CFG, "model": {"init_from": str(hf)}}
    results = run_ranks(2, sentinel_build_body, cfg, "pp=2", str(tmp_path / "run"), "resume")
    for r in results:
        assert r["resumed_from"] is None and r["nan"] == [] and r["init_elements"] == 0
        assert r["n_model"] > 0 and r["n_moments"] == 0  # a fresh optimizer: AdamW makes its state at step 1


def adopt_body(cfg_dict: dict, new: str, ports: list[int]) -> dict | None:
    """Rank 0 trains 2 steps as dp=1 and hands its state over; ranks 0-1 adopt it under `new`."""
    import torch
    import torch.distributed as dist

    from parallel import unset
    from parallel.layout import Layout
    from workers.config import JobConfig
    from workers.reshard import exchange, hand_over
    from workers.trainer import Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    old_l, new_l = Layout.parse("dp=1"), Layout.parse(new)
    cfg = JobConfig.from_dict(cfg_dict)
    cpu = torch.device("cpu")

    def init(port: int, size: int) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)

    handover = None
    if rank == 0:
        init(ports[0], 1)
        old = Trainer(cfg, layout=old_l, device=cpu).build()
        old.fit(2)
        handover = hand_over(old)
        dist.destroy_process_group()
    init(ports[1], world)
    received = exchange(handover, model=cfg.model.build(), old=old_l, new=new_l,
                        old_rank=0 if rank == 0 else None, new_rank=rank,
                        old_to_group={0: 0}, new_to_group={r: r for r in range(world)})
    dist.destroy_process_group()
    init(ports[2], world)
    unset.SENTINEL = float("nan")  # the adopting trainer's allocations only
    fed = Trainer(cfg, layout=new_l, device=cpu).build(resume=False, init_weights=False)
    fed.adopt(received.pieces, received.optimizer_steps, received.state)
    out = _unwritten(fed)
    out.update(step=fed.step, init_elements=fed.init_elements)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_adopted_state_fills_every_weight_and_moment(layout):
    ports = [free_port() for _ in range(3)]
    for r in run_ranks(2, adopt_body, CFG, layout, ports):
        assert r["step"] == 2 and r["init_elements"] == 0
        assert r["n_moments"] == 2 * r["n_model"] > 0
        assert r["nan"] == []


# -- a fresh start draws its shard only -------------------------------------------------------------

COUNT_MODEL = dict(dim=1024, n_layers=1, n_heads=8, n_kv_heads=8, vocab_size=256, ffn_hidden=1024,
                   max_seq_len=64)
"""A model whose every shard under tp=2, dp_shard=2 and both is an equal part of each parameter, so
the counts are exact; norms are ones (nothing drawn)."""


def count_body(layout: str, seed: int) -> dict:
    """Materialise under `layout`: the values this rank drew, and the parameters whose shard is not the
    slice of the global initial value."""
    import torch

    from models.config import ModelConfig
    from models.llama import build_model, init_value
    from parallel.checkpoint.state import local_box
    from parallel.layout import Layout
    from parallel.parallelize import materialize, parallelize

    lay, cfg = Layout.parse(layout), ModelConfig(**COUNT_MODEL)
    model = build_model(cfg)
    parallelize(model, layout=lay, mesh=lay.build_mesh("cpu"))
    drawn = materialize(model, seed=seed, device=torch.device("cpu"))
    wrong = []
    for name, p in model.named_parameters():
        local, offsets = local_box(p)
        box = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
        if not torch.equal(local, init_value(cfg, name, tuple(p.shape), seed)[box]):
            wrong.append(name)
    return {"drawn": drawn, "wrong": wrong}


def test_doubling_tp_halves_the_values_each_rank_draws():
    import torch

    from models.config import ModelConfig
    from models.llama import build_model
    from parallel.parallelize import materialize

    cfg = ModelConfig(**COUNT_MODEL)
    whole = materialize(build_model(cfg), seed=5, device=torch.device("cpu"))  # one process, no layout
    assert whole == cfg.num_params() - (2 * cfg.n_layers + 1) * cfg.dim  # every value once; norms are ones
    for layout, parts in (("tp=2", 2), ("dp=2", 2), ("dp_shard=2,tp=2", 4)):
        for r in run_ranks(parts, count_body, layout, 5):
            assert r["drawn"] == whole // parts, (layout, r["drawn"], whole)
            assert r["wrong"] == [], layout  # each shard is its slice of the same global weights
