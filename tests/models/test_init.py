"""Tier 1: initial values are one global tensor, whatever box they are generated in."""

from __future__ import annotations

import math
import random

import pytest
import torch

from models.config import model_config
from models.init import _GOLDEN, _MASK, _mix, hash_index, normal_box
from models.llama import init_into, init_value


@pytest.mark.parametrize("shape", [(1000, 1300), (130,), (64, 512), (7, 3), (300, 40, 3), (65, 513)])
def test_any_box_is_the_slice_of_the_global_value_and_draws_its_own_elements(shape):
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
        assert drawn == math.prod(sizes)


def test_the_tensor_hash_is_splitmix64_of_the_counter():
    """int64 tensor arithmetic wraps as 64-bit unsigned arithmetic does: the bits equal the reference."""
    key = 0x7FEDCBA987654321
    idx = [0, 1, 2, 12345, (1 << 40) + 7, (1 << 62) - 3]
    got = hash_index(key, torch.tensor(idx, dtype=torch.int64)).tolist()
    want = [_mix((key + (i + 1) * _GOLDEN) & _MASK) for i in idx]
    assert [g & _MASK for g in got] == want


def test_values_have_the_requested_spread_and_no_pattern_between_rows():
    out = torch.empty(256, 1024)
    normal_box(out, tuple(out.shape), (0, 0), key=3, std=0.02)
    assert abs(out.std().item() - 0.02) < 0.0005 and abs(out.mean().item()) < 0.0005
    assert abs(torch.corrcoef(torch.stack([out[0], out[1]]))[0, 1].item()) < 0.1  # neighbouring rows
    assert abs(torch.corrcoef(torch.stack([out[:, 0], out[:, 1]]))[0, 1].item()) < 0.2  # neighbouring columns
    other = torch.empty(256, 1024)
    normal_box(other, tuple(other.shape), (0, 0), key=4, std=0.02)
    assert abs(torch.corrcoef(torch.stack([out.flatten(), other.flatten()]))[0, 1].item()) < 0.01


def test_a_box_larger_than_one_pass_is_cut_into_passes_with_the_same_values(monkeypatch):
    import models.init as init

    shape = (50, 7, 3)
    whole = torch.empty(shape)
    normal_box(whole, shape, (0, 0, 0), key=11, std=1.0)
    monkeypatch.setitem(init.CHUNK, "cpu", 40)  # one row of 21 elements per pass
    part = torch.empty(30, 7, 3)
    normal_box(part, shape, (13, 0, 0), key=11, std=1.0)
    assert torch.equal(part, whole[13:43])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_same_bits_and_nearly_the_same_values_as_the_cpu():
    idx = torch.arange(0, 1 << 20, 7, dtype=torch.int64)
    assert torch.equal(hash_index(99, idx.cuda()).cpu(), hash_index(99, idx))
    cpu, gpu = torch.empty(300, 700), torch.empty(300, 700, device="cuda")
    normal_box(cpu, (1000, 700), (200, 0), key=5, std=1.0)
    normal_box(gpu, (1000, 700), (200, 0), key=5, std=1.0)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-5)
