"""Random initial values drawn by tiles, so any box of a parameter can be generated on its own.

A parameter's global tensor is cut into tiles of `TILE` (rows of dim 0 x columns of dim 1; further dims
whole, a 1-D tensor is cut along its only dim). Each tile is drawn in one call from a generator seeded
by (the parameter's key, the tile's index), on the device of the memory it goes to. So an element's value
is a pure function of (key, global index, global shape), whatever box it is generated in, and a rank that
holds a shard generates only the tiles its box overlaps: init work and memory scale with the shard, not
with the model. A box that cuts a tile still draws the whole tile (values depend on the tile's shape),
so the waste is at most one tile per box edge.

CPU and CUDA generators draw different numbers for one seed: a run starts from the same weights under
every layout on one device type, not across device types.
"""

from __future__ import annotations

import math

import torch

TILE = (64, 512)
"""Rows x columns per tile. Fine enough in rows that FSDP's dim-0 shards at large dp waste little; wide
enough in columns that a large model needs few tens of thousands of draws (one kernel each on a GPU)."""

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads nearby integers (tile indices) over unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def tile_seed(key: int, row_tile: int, col_tile: int) -> int:
    """Seed of one tile of the parameter whose key (a 63-bit seed of its own) is `key`."""
    return _mix(key ^ _mix((row_tile << 32) | col_tile)) & ((1 << 63) - 1)


def _tile_ranges(start: int, size: int, extent: int, tile: int) -> range:
    """Indices of the tiles of a dim of `extent` (tile size `tile`) that [start, start + size) overlaps."""
    return range(start // tile, (start + size - 1) // tile + 1) if size else range(0)


@torch.no_grad()
def normal_box(out: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...], *, key: int, std: float) -> int:
    """Fill `out`, the box of a global tensor of `shape` that starts at `offsets`, with its part of that
    tensor's N(0, std) initial values; returns how many values were drawn (whole tiles)."""
    shape, offsets = tuple(int(s) for s in shape), tuple(int(o) for o in offsets)
    if out.dim() != len(shape) or len(offsets) != len(shape):
        raise ValueError(f"a box of {out.dim()} dims with {len(offsets)} offsets for a tensor of shape {list(shape)}")
    if out.numel() == 0:
        return 0
    g = torch.Generator(device=out.device)
    if not shape:  # a scalar is one tile
        g.manual_seed(tile_seed(key, 0, 0))
        out.copy_(torch.empty((), dtype=torch.float32, device=out.device).normal_(0.0, std, generator=g))
        return 1
    rows_t = TILE[0]
    cols_t = TILE[1] if len(shape) > 1 else 1
    rest = shape[2:]
    trailing = tuple(slice(o, o + n) for o, n in zip(offsets[2:], out.shape[2:]))  # dims a tile holds whole
    drawn = 0
    r_off, c_off = offsets[0], offsets[1] if len(shape) > 1 else 0
    r_n, c_n = out.shape[0], out.shape[1] if len(shape) > 1 else 1
    n_cols = shape[1] if len(shape) > 1 else 1
    for ti in _tile_ranges(r_off, r_n, shape[0], rows_t):
        t_r0 = ti * rows_t
        t_rows = min(rows_t, shape[0] - t_r0)
        r_lo, r_hi = max(t_r0, r_off), min(t_r0 + t_rows, r_off + r_n)
        for tj in _tile_ranges(c_off, c_n, n_cols, cols_t):
            t_c0 = tj * cols_t
            t_cols = min(cols_t, n_cols - t_c0)
            c_lo, c_hi = max(t_c0, c_off), min(t_c0 + t_cols, c_off + c_n)
            tile_shape = (t_rows, t_cols, *rest) if len(shape) > 1 else (t_rows,)
            dst = out[r_lo - r_off:r_hi - r_off]
            if len(shape) > 1:
                dst = dst[:, c_lo - c_off:c_hi - c_off]
            g.manual_seed(tile_seed(key, ti, tj))
            if tuple(dst.shape) == tile_shape and dst.is_contiguous() and dst.dtype == torch.float32:
                dst.normal_(0.0, std, generator=g)  # the whole tile, in place: the same draws as a fresh one
            else:
                tile = torch.empty(tile_shape, dtype=torch.float32, device=out.device).normal_(0.0, std, generator=g)
                box = (slice(r_lo - t_r0, r_hi - t_r0), slice(c_lo - t_c0, c_hi - t_c0), *trailing)
                dst.copy_(tile[box[:len(shape)]])
            drawn += math.prod(tile_shape)
    return drawn


def drawn_for_box(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """How many values `normal_box` draws for the box (`offsets`, `sizes`) of a tensor of `shape`: the
    whole tiles it overlaps. Pure arithmetic, for sizing init work without doing it."""
    if not shape:
        return 1
    if any(s == 0 for s in sizes):
        return 0

    def along(dim: int, tile: int) -> int:
        n, a, k = shape[dim], offsets[dim], sizes[dim]
        return sum(min(tile, n - i * tile) for i in _tile_ranges(a, k, n, tile))

    rows = along(0, TILE[0])
    cols = along(1, TILE[1]) if len(shape) > 1 else 1
    return rows * cols * math.prod(shape[2:])
