"""Random initial values as a pure function of (parameter key, global index), so any box of a parameter
can be generated on its own, in a few elementwise kernels.

Element i (its flat index in the global tensor) of the parameter whose key is `key` is a normal value
made by Box-Muller from the 64 bits of splitmix64(key, i): a counter-based generator, computed with
integer tensor ops on the device of the memory it goes to. A rank that holds a shard computes exactly its
own elements, whatever the layout cuts: init work and memory scale with the shard, and every layout
starts from the same global weights. There is no generator state and no per-tile call: on a GPU a whole
shard is a handful of kernels per chunk of `CHUNK` elements, instead of one random draw per tile.

CPU and CUDA compute the same integers; their float `log`/`cos` may differ in the last bits.
"""

from __future__ import annotations

import math

import torch

CHUNK = {"cpu": 1 << 16, "cuda": 1 << 24}
"""Elements generated per pass, by device type: on a CPU the int64 temporaries stay in cache (fresh
memory per op would cost more in page faults than the arithmetic); on a GPU few launches, and a few
times 128 MiB of temporaries."""

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """`c` (64 bits) as the int64 torch holds it: int64 arithmetic wraps, so the low 64 bits agree."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (the reference the tensor version must agree with)."""
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logical right shift of int64 `x` (torch's `>>` is arithmetic)."""
    out = torch.bitwise_right_shift(x, k, out=out) if out is not None else x >> k
    return out.bitwise_and_((1 << (64 - k)) - 1)


def hash_index(key: int, idx: torch.Tensor) -> torch.Tensor:
    """splitmix64 of the counter `key + (idx + 1) * golden` (int64, wrapping): 64 random bits per index.
    In place where it can be: two int64 buffers the size of `idx`."""
    x = idx.add(1).mul_(_signed(_GOLDEN)).add_(_signed(key & _MASK))
    t = torch.empty_like(x)
    x.bitwise_xor_(_shr(x, 30, t)).mul_(_signed(_M1))
    x.bitwise_xor_(_shr(x, 27, t)).mul_(_signed(_M2))
    return x.bitwise_xor_(_shr(x, 31, t))


def _normal(bits: torch.Tensor, std: float) -> torch.Tensor:
    """N(0, std) from 64 random bits each (two 24-bit uniforms, Box-Muller), fp32."""
    u1 = (_shr(bits, 40) + 1).to(torch.float32).mul_(2.0 ** -24)  # (0, 1]: the log is finite
    u2 = (bits & 0xFFFFFF).to(torch.float32).mul_(2.0 ** -24)
    return u1.log_().mul_(-2.0).sqrt_().mul_(torch.cos(u2.mul_(2 * math.pi))).mul_(std)


def _indices(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
             device: torch.device) -> torch.Tensor:
    """Flat global indices (int64) of the box (`offsets`, `sizes`) of a row-major tensor of `shape`."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        along = torch.arange(offsets[d], offsets[d] + sizes[d], dtype=torch.int64, device=device) * stride
        idx = along.view(-1, *([1] * idx.dim())) + idx
        stride *= shape[d]
    return idx


@torch.no_grad()
def normal_box(out: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], *, key: int, std: float) -> int:
    """Fill `out`, the box of a global tensor of `shape` that starts at `offsets`, with its part of that
    tensor's N(0, std) initial values; returns how many values were generated (the box's elements)."""
    shape, offsets = tuple(int(s) for s in shape), tuple(int(o) for o in offsets)
    if out.dim() != len(shape) or len(offsets) != len(shape):
        raise ValueError(f"a box of {out.dim()} dims with {len(offsets)} offsets for a tensor of shape {list(shape)}")
    if out.numel() == 0:
        return 0
    if not shape:
        out.copy_(_normal(hash_index(key, torch.zeros((), dtype=torch.int64, device=out.device)), std))
        return 1
    sizes = tuple(out.shape)
    row = math.prod(sizes[1:])
    step = max(1, CHUNK.get(out.device.type, CHUNK["cpu"]) // max(row, 1))
    for r in range(0, sizes[0], step):
        n = min(step, sizes[0] - r)
        idx = _indices(shape, (offsets[0] + r, *offsets[1:]), (n, *sizes[1:]), out.device)
        out[r:r + n].copy_(_normal(hash_index(key, idx), std))
    return out.numel()
