"""The staging pool's layout: pinned in ranges of whole pieces, since a copy may not cross two ranges."""

import pytest
import torch

from parallel.checkpoint import host_pool
from parallel.checkpoint.host_pool import HostPool, layout, ranges


def test_ranges_hold_whole_pieces_and_cover_the_layout(monkeypatch):
    monkeypatch.setattr(host_pool, "RANGE_BYTES", 1000)
    sizes = [300, 500, 2500, 10, 700, 700, 64, 1]
    starts, total = layout(sizes)
    rs = ranges(sizes)
    assert rs[0][0] == 0 and rs[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(rs, rs[1:]))  # contiguous, no gaps
    for s, n in zip(starts, sizes):  # every piece inside exactly one range
        assert sum(a <= s and s + n <= b for a, b in rs) == 1
    assert [b - a for a, b in rs] == [3392, 1472, 128]  # closed at the first boundary past 1000 bytes


def test_a_layout_whose_piece_crosses_a_range_does_not_fit(monkeypatch):
    monkeypatch.setattr(host_pool, "RANGE_BYTES", 1000)
    pool = HostPool([640, 640, 640], pin=False)
    assert pool.fits([640, 640, 640]) and pool.fits([100]) and not pool.fits([640, 640, 704])
    pool.ranges = ranges([640, 640, 640])  # as a pinned pool's: [0, 1280), [1280, 1920)
    assert pool.ranges == [(0, 1280), (1280, 1920)]
    assert pool.fits([1280, 640]) and not pool.fits([640, 1280])  # the second would cross at 1280


def test_views_are_laid_out_like_the_pieces():
    tensors = [torch.arange(10.0), torch.ones(3, 2, dtype=torch.bfloat16)]
    pool = HostPool([t.numel() * t.element_size() for t in tensors], pin=False)
    views = pool.views(tensors)
    for v, t in zip(views, tensors):
        v.copy_(t)
        assert v.shape == t.shape and v.dtype == t.dtype and torch.equal(v, t)
    assert views[1].data_ptr() - pool.buf.data_ptr() == layout([40, 12])[0][1] == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_a_pinned_pool_is_pinned_in_every_range_and_copies_at_each_boundary(monkeypatch):
    monkeypatch.setattr(host_pool, "RANGE_BYTES", 1 << 20)
    src = [torch.randn(n, device="cuda") for n in (300_000, 200_000, 700_000, 5)]
    pool = HostPool([t.numel() * 4 for t in src], pin=True)
    assert len(pool.ranges) > 1 and pool.buf.is_pinned()
    views = pool.views(src)
    for v, t in zip(views, src):
        v.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert all(torch.equal(v, t.cpu()) for v, t in zip(views, src))
    pool.release()
