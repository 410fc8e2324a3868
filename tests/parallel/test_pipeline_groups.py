"""Tier 1: the tied-embedding group of a pipeline line, on torch's fake backend (no process)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel.layout import Layout, MeshAxis
from parallel.pipeline import tied_group


@pytest.mark.parametrize("text", ["dp_shard=32,pp=2", "dp_shard=64,pp=4", "dp_shard=16,tp=4,pp=4"])
def test_only_the_first_and_last_stage_of_a_line_make_its_tied_group(monkeypatch, text):
    """One `new_group` on the line's ends, of those two ranks, none on the stages between. (Before, every
    rank called `new_group` for each of the world / pp lines: 32 per rank at dp_shard=32,pp=2, 64 at
    dp_shard=64,pp=4.)"""
    lay = Layout.parse(text)
    made: list[list[int]] = []
    make = c10d._new_group_with_tag

    def counted(ranks=None, *args, **kw):
        made.append(list(ranks))
        return make(ranks, *args, **kw)

    for rank in (0, lay.world_size // 2, lay.world_size - 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
        try:
            mesh = lay.build_mesh("cpu")
            line = mesh[MeshAxis.PP.value].mesh.tolist()
            monkeypatch.setattr(c10d, "_new_group_with_tag", counted)
            made.clear()
            group = tied_group(mesh, lay)
            monkeypatch.setattr(c10d, "_new_group_with_tag", make)
            ends = rank in (line[0], line[-1])
            assert made == ([[line[0], line[-1]]] if ends else []), (rank, made[:3])
            assert (group is not None) == ends
            if ends:
                assert dist.get_process_group_ranks(group) == [line[0], line[-1]]
        finally:
            dist.destroy_process_group()
