"""Tier 1: mapping a load's target memory in beside the read (parallel.checkpoint.prefault)."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from parallel.checkpoint import prefault
from parallel.checkpoint.prefault import Prefaulter, byte_ranges

PAGE = prefault._PAGE


def test_byte_ranges_are_page_aligned_merged_and_cut_into_pieces(monkeypatch):
    monkeypatch.setattr(prefault, "_PIECE", 4 * PAGE)
    big = torch.empty(10 * PAGE, dtype=torch.uint8)
    a, b = big[:3 * PAGE], big[3 * PAGE:]  # adjacent views: one range, cut into pieces
    ranges = byte_ranges([a, b])
    start = big.data_ptr() // PAGE * PAGE
    end = -(-(big.data_ptr() + big.numel()) // PAGE) * PAGE
    assert ranges[0][0] == start and ranges[-1][1] == end
    assert all(x % PAGE == 0 and z % PAGE == 0 and 0 < z - x <= 4 * PAGE for x, z in ranges)
    assert all(z == x2 for (_, z), (x2, _) in zip(ranges, ranges[1:]))  # contiguous, no overlap
    # A column slice spans its rows' whole extent; empty tensors and meta tensors add nothing.
    m = torch.empty(8, PAGE // 4)
    r = byte_ranges([m[:, 1:2]])
    assert r[0][0] <= m.data_ptr() + 4 and r[-1][1] >= m.data_ptr() + (7 * (PAGE // 4) + 2) * 4
    assert byte_ranges([torch.empty(0), torch.empty(4, device="meta")]) == []


def _faults_to_fill(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t.fill_(1)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populated_memory_is_written_without_faults_and_keeps_its_bytes():
    n = 64 << 20
    fresh = torch.empty(n, dtype=torch.uint8)
    fresh_faults = _faults_to_fill(fresh)
    mapped = torch.empty(n, dtype=torch.uint8)
    for piece in byte_ranges([mapped]):
        prefault._populate(*piece)
    if not prefault._available:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    # The premise: fresh memory faults on first write. With transparent huge pages ("always", as on CI's
    # machines) part of it comes in 2 MiB pages and faults less (8191 of 16384 pages seen once); what
    # matters is that there are enough faults for the ratio below to mean something.
    if fresh_faults < 256:
        pytest.skip(f"fresh memory faulted only {fresh_faults} times (huge pages): nothing to compare")
    assert _faults_to_fill(mapped) < fresh_faults // 10
    # Memory that holds data keeps every byte.
    data = torch.arange(1 << 20, dtype=torch.int64)
    expect = data.clone()
    for piece in byte_ranges([data]):
        prefault._populate(*piece)
    assert torch.equal(data, expect)


def test_a_prefaulter_changes_no_byte_and_stops_when_closed():
    data = [torch.randn(1 << 18) for _ in range(4)]
    expect = [t.clone() for t in data]
    p = Prefaulter()
    p.add(data[:2])
    p.add(reversed(data[2:]))
    p.close()
    p.add(data)  # after close: nothing is queued, no thread starts again
    assert not p._queues
    assert all(torch.equal(t, e) for t, e in zip(data, expect))
    assert p._thread is None or not p._thread.is_alive()
