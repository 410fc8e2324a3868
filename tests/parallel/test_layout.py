"""Tier 1: Layout parsing, validation and coordinates."""

import itertools
import subprocess
import sys

import pytest

from parallel.layout import AXIS_ORDER, Layout, MeshAxis


def test_parse_forms():
    assert Layout.parse("dp=2,tp=2,pp=1") == Layout(dp_shard=2, tp=2)
    assert Layout.parse("dp=2", dp_mode="replicate") == Layout(dp_replicate=2)
    assert Layout.parse("dp_replicate=2,dp_shard=3,pp=2") == Layout(dp_replicate=2, dp_shard=3, pp=2)
    assert Layout.parse(" tp = 4 ") == Layout(tp=4)


@pytest.mark.parametrize("text,needle", [
    ("dp=0", "dp_shard must be an integer >= 1"),
    ("dp=2,dp_shard=2", "either dp= or"),
    ("xp=2", "unknown layout key 'xp'"),
    ("tp=two", "bad layout item"),
    ("tp=2,tp=2", "given twice"),
    ("", "empty layout"),
])
def test_parse_errors_say_what_is_wrong(text, needle):
    with pytest.raises(ValueError, match=needle):
        Layout.parse(text)


def test_world_size_check_shows_the_numbers():
    with pytest.raises(ValueError, match=r"needs 8 ranks .*dp_shard=2 x tp=2 x pp=2.* but there are 6"):
        Layout(dp_shard=2, tp=2, pp=2).check_world_size(6)


def test_str_round_trips_and_dict_round_trips():
    for lay in [Layout(), Layout(dp_shard=4), Layout(dp_replicate=2, tp=2), Layout(dp_replicate=2, dp_shard=2, pp=3)]:
        assert Layout.parse(str(lay)) == lay
        assert Layout.from_dict(lay.to_dict()) == lay


def test_coords_are_row_major_with_tp_innermost():
    lay = Layout(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    seen = set()
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert list(c) == list(AXIS_ORDER)
        seen.add(tuple(c.values()))
    assert len(seen) == lay.world_size
    assert lay.coords(1)["tp"] == 1 and lay.coords(1)["dp_shard"] == 0  # adjacent ranks share a TP group
    assert [lay.dp_rank(r) for r in range(0, 8, 2)] == [0, 1, 2, 3]


def test_place_is_the_pipeline_stage_fsdp_shard_and_tp_shard_of_coords():
    for dims in itertools.product((1, 2, 3), repeat=4):
        lay = Layout(**dict(zip(("dp_replicate", "dp_shard", "tp", "pp"), dims)))
        places = set()
        for r in range(lay.world_size):
            c = lay.coords(r)
            assert lay.place(r) == (c[MeshAxis.PP], c[MeshAxis.DP_SHARD], c[MeshAxis.TP]), (lay, r)
            places.add(lay.place(r))
        assert len(places) == lay.places
    with pytest.raises(ValueError, match="outside world_size 4"):
        Layout(dp_shard=4).place(4)


def test_importing_layout_does_not_import_torch_distributed():
    code = "import sys, parallel.layout, parallel.planner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("text", ["dp=64", "dp=256", "dp_shard=16,tp=4,pp=4", "dp_replicate=2,dp_shard=64,tp=2"])
def test_a_rank_makes_only_its_own_group_on_each_axis(monkeypatch, text):
    """`build_mesh` on a fake group of the layout's size, as its first and last rank: at most one
    `new_group` per axis, each naming the rank's own line of the mesh. (torch's `init_device_mesh` has
    every rank call `new_group` for every group of every axis: 192 calls at dp=64, 768 at dp=256.)"""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    made: list[list[int]] = []
    make = c10d._new_group_with_tag  # what every `new_group` call runs, whoever imported the name

    def counted(ranks=None, *args, **kw):
        made.append(list(ranks))
        return make(ranks, *args, **kw)

    monkeypatch.setattr(c10d, "_new_group_with_tag", counted)
    lay = Layout.parse(text)
    for rank in (0, lay.world_size - 1):
        made.clear()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
        try:
            mesh = lay.build_mesh("cpu")
            at = lay.coords(rank)
            assert list(mesh.get_coordinate()) == [at[a] for a in AXIS_ORDER]
            lines = {a: mesh[a.value].mesh.tolist() for a in AXIS_ORDER}
        finally:
            dist.destroy_process_group()
        assert len(made) <= len(AXIS_ORDER) and all(rank in g for g in made)
        for a in AXIS_ORDER:  # the line through `rank` along `a`: the ranks differing from it only there
            want = [r for r in range(lay.world_size)
                    if all(lay.coords(r)[b] == at[b] for b in AXIS_ORDER if b is not a)]
            assert lines[a] == want, (a, lines[a][:8])
