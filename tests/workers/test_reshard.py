"""Tier 1: a worker's side of the live reshard that needs no peer: the step counters' agreement."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import workers.reshard as reshard
from models.config import model_config
from models.llama import build_model

NAMES = [n for n, _ in build_model(model_config("8b")).named_parameters()]


class _Wire:
    """`torch.distributed` as one rank of `world` sees it: the collectives made and the elements they
    deliver to this rank, counted; any other collective fails the test (AttributeError). The all-reduce
    leaves the tensor as the other ranks (holding nothing) would: unchanged by a max."""

    ReduceOp = dist.ReduceOp

    def __init__(self, world: int) -> None:
        self.world, self.received, self.calls = world, 0, 0

    def get_world_size(self) -> int:
        return self.world

    def all_reduce(self, tensor: torch.Tensor, op=None) -> None:
        self.calls += 1
        self.received += tensor.numel()


@pytest.mark.parametrize("world", [64, 256, 1024])
def test_agreeing_the_step_counters_receives_one_counter_per_parameter_whatever_the_world(monkeypatch, world):
    """One collective of len(names) counters per worker at any world size. Before, every worker gathered
    every worker's {name: step} dict (`all_gather_object`): world x 291 entries for the 8B model, 10 kB
    pickled each, so 10 MB received and unpickled per worker at 1,024 ranks, 10 GB over the group."""
    wire = _Wire(world)
    monkeypatch.setattr(reshard, "dist", wire)
    mine = {n: 7 for n in NAMES[:40]}  # a pipeline stage's parameters

    got = reshard.agree_steps(mine, NAMES)

    assert got == mine
    assert wire.calls == 1 and wire.received == len(NAMES) == 291


def test_the_agreed_counters_are_the_members_counters_by_name(tmp_path):
    """On a real one-rank gloo group: names held map to their counters, names nobody holds are absent, a
    counter for a name the model does not have is refused with what to do."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert reshard.agree_steps({"b": 3, "c": 0}, ["a", "b", "c"]) == {"b": 3, "c": 0}
        assert reshard.agree_steps({}, ["a", "b"]) == {}
        with pytest.raises(ValueError, match=r"\['zz'\] \(of 1\) name no parameter of the model"):
            reshard.agree_steps({"zz": 1}, ["a"])
    finally:
        dist.destroy_process_group()
