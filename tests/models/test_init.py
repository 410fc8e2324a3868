"""Tier 1: initial values drawn by tiles are one global tensor, whatever box they are generated in."""

from __future__ import annotations

import random

import pytest
import torch

from models.config import model_config
from models.init import TILE, drawn_for_box, normal_box
from models.llama import init_into, init_value


@pytest.mark.parametrize("shape", [(1000, 1300), (130,), (TILE[0], TILE[1]), (7, 3), (300, 40, 3), (65, 513)])
def test_any_box_is_the_slice_of_the_global_value_and_draws_its_tiles_only(shape):
    cfg = model_config("tiny")
    name = "layers.0.attention.wq.weight"
    full = init_value(cfg, name, shape, 5)
    rng = random.Random(0)
    for _ in range(25):
        offsets = tuple(rng.randrange(0, s) for s in shape)
        sizes = tuple(rng.randrange(1, s - o + 1) for s, o in zip(shape, offsets))
        out = torch.empty(sizes)
        drawn = init_into(cfg, name, shape, 5, out, offsets)
        assert torch.equal(out, full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
        assert drawn == drawn_for_box(shape, offsets, sizes) <= full.numel()


def test_a_shard_on_tile_bounds_draws_exactly_its_own_values():
    shape = (4 * TILE[0], 4 * TILE[1])
    half = torch.empty(2 * TILE[0], shape[1])
    assert normal_box(half, shape, (2 * TILE[0], 0), key=9, std=1.0) == half.numel()
    cols = torch.empty(shape[0], TILE[1])
    assert normal_box(cols, shape, (0, 3 * TILE[1]), key=9, std=1.0) == cols.numel()


def test_values_have_the_requested_spread_and_differ_between_tiles():
    out = torch.empty(4 * TILE[0], 2 * TILE[1])
    normal_box(out, tuple(out.shape), (0, 0), key=3, std=0.02)
    assert abs(out.std().item() - 0.02) < 0.001 and abs(out.mean().item()) < 0.001
    a, b = out[:TILE[0], :TILE[1]], out[TILE[0]:2 * TILE[0], :TILE[1]]
    assert not torch.equal(a, b) and not torch.equal(a, out[:TILE[0], TILE[1]:])
