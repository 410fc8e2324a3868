"""The host buffer a save stages into: one allocation, laid out as a sequence of pieces, and on CUDA
pinned by registering it with the driver range by range.

Why ranges: pinning many GB in one call (`torch.empty(..., pin_memory=True)`) holds the CUDA driver for
the whole call, and every device allocation of a training step running beside it waits (7 s for
13.2 GB on an H200: the first step after a build took 7.1 s instead of 1.0 s). Registered in ranges of
about `RANGE_BYTES`, the step's allocations get in between (longest wait 0.17 s, as with nothing beside
them; benchmarks/first_step.py), and several threads fault the ranges in at once. A copy must not cross
from one registered range into the next (the driver rejects it), so ranges hold whole pieces, and a
layout whose pieces would cross one gets a new pool.
"""

from __future__ import annotations

import bisect
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

ALIGN = 64
"""Each piece starts at a multiple of this many bytes."""
RANGE_BYTES = 256 << 20
"""Registered ranges close at the first piece boundary past this size (a larger piece is a range alone)."""
PIN_THREADS = 8
"""Threads that fault in and register a pinned pool's ranges (at most half the host's cores)."""
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """The byte offset of each piece of `sizes` bytes, and the bytes all of them take."""
    starts, pos = [], 0
    for n in sizes:
        starts.append(pos)
        pos += -(-n // ALIGN) * ALIGN
    return starts, pos


def ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) byte ranges of whole pieces, each closed once it reaches `RANGE_BYTES`."""
    starts, total = layout(sizes)
    out: list[tuple[int, int]] = []
    begin = 0
    for i in range(1, len(sizes)):
        if starts[i] - begin >= RANGE_BYTES:
            out.append((begin, starts[i]))
            begin = starts[i]
    if total > begin or not out:
        out.append((begin, max(total, 1)))
    return out


def _unregister(buf: torch.Tensor, ptrs: list[int]) -> None:
    """Unregister `ptrs`; `buf` is passed only so that the finaliser keeps the memory alive until then."""
    cudart = torch.cuda.cudart()
    for p in ptrs:
        cudart.cudaHostUnregister(p)


class HostPool:
    """A host buffer for pieces of `sizes` bytes, pages faulted in; `pin`: registered with CUDA in
    `ranges(sizes)`, and unregistered when the pool is released or collected."""

    def __init__(self, sizes: list[int], *, pin: bool) -> None:
        self.pinned = pin
        self.ranges = ranges(sizes) if pin else [(0, max(layout(sizes)[1], 1))]
        self.buf = torch.empty(self.ranges[-1][1], dtype=torch.uint8)
        registered: list[int] = []
        self._release = weakref.finalize(self, _unregister, self.buf, registered) if pin else None
        if not pin:
            self.buf.fill_(0)  # fault the pages in now rather than in a save's copies
            return

        def fault_and_register(r: tuple[int, int]) -> int:
            a, b = r
            self.buf[a:b].fill_(0)
            ptr = self.buf.data_ptr() + a
            rc = int(torch.cuda.cudart().cudaHostRegister(ptr, b - a, _PORTABLE))
            if rc == 0:
                registered.append(ptr)
            return rc

        # Faulting pages in is most of the cost (one thread: ~1.8 GB/s on an H200 host), and it scales
        # with threads (8: ~9 GB/s); a GPU host has the cores.
        threads = max(1, min(PIN_THREADS, (os.cpu_count() or 2) // 2))
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-pin") as ex:
            failed = [rc for rc in ex.map(fault_and_register, self.ranges) if rc != 0]
        if failed:
            self.release()
            raise RuntimeError(f"cudaHostRegister of the {self.buf.numel()} bytes of the staging pool failed "
                               f"(CUDA error {failed[0]}); is the host short of lockable memory (ulimit -l)?")

    def fits(self, sizes: list[int]) -> bool:
        """Whether pieces of `sizes` bytes, laid out from the start, fit and none crosses a range."""
        starts, total = layout(sizes)
        if total > self.buf.numel():
            return False
        ends = [b for _, b in self.ranges]
        return all(bisect.bisect_right(ends, a) == bisect.bisect_right(ends, a + max(n, 1) - 1)
                   for a, n in zip(starts, sizes))

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A view of the pool shaped like each of `tensors`, laid out as `layout` says."""
        starts, _ = layout([t.numel() * t.element_size() for t in tensors])
        return [self.buf[a:a + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for a, t in zip(starts, tensors)]

    def release(self) -> None:
        """Unregister now (the memory itself goes when the last view does)."""
        if self._release is not None:
            self._release()
