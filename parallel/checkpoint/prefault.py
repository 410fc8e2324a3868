"""Mapping a load's target memory in beside the read, so the copies out of the read buffers find it ready.

Host memory that was allocated but never written (a restarted rank's shards, fresh from `torch.empty`)
is mapped by the kernel only when first written: each 4 KiB page then costs a fault inside the loader's
copies, which stall a reading thread that could be waiting on the disk instead. One thread here asks the
kernel to map the pages the reading threads will write next (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+),
taking each reading thread's targets in turn, in the order that thread writes them, while the reads wait
on the disk. The call maps pages writable without writing to them: no byte changes, so it is harmless on
memory that already holds data (a live model loaded in place) or that is already mapped. Where the call
is not available (another OS, an older kernel) nothing is done and the copies fault as before.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections import deque
from typing import Iterable

import torch

_MADV_POPULATE_WRITE = 23
_PIECE = 8 << 20
"""Bytes mapped per call: small enough to keep just ahead of the readers and to stop soon when told."""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_madvise = None
_available = sys.platform.startswith("linux")


def _populate(start: int, end: int) -> bool:
    """Map [start, end) writable; False if the kernel cannot do it at all (then nothing more is tried)."""
    global _madvise, _available
    if _madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _madvise = fn
    if _madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() in (22, 38):  # EINVAL, ENOSYS: a kernel without MADV_POPULATE_WRITE
        _available = False
        return False
    return True  # e.g. a read-only or unmapped page in the range: those copies fault as before


def byte_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned address ranges the host `tensors` span (views included), merged where adjacent
    and cut into pieces of at most `_PIECE` bytes, in the order given."""
    out: list[list[int]] = []
    for t in tensors:
        if t.device.type != "cpu" or not t.numel():
            continue
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        a = t.data_ptr() // _PAGE * _PAGE
        z = -(-(t.data_ptr() + extent * t.element_size()) // _PAGE) * _PAGE
        if out and out[-1][0] <= a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], z)
        else:
            out.append([a, z])
    return [(x, min(x + _PIECE, z)) for a, z in out for x in range(a, z, _PIECE)]


class Prefaulter:
    """One background thread that maps the targets each reading thread hands it (`add`), a piece of each
    in turn; `close` drops what is left (the copies have written it by then) and waits for the thread."""

    def __init__(self) -> None:
        self._queues: list[deque[tuple[int, int]]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.seconds = 0.0
        """Time the thread spent mapping pages."""

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Queue `tensors`, in the order one reading thread will write them."""
        if not _available:
            return
        ranges = byte_ranges(tensors)
        if not ranges:
            return
        with self._cv:
            if self._closed:
                return
            self._queues.append(deque(ranges))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-prefault", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _next(self) -> tuple[int, int] | None:
        with self._cv:
            while True:
                if self._closed:
                    return None
                self._queues = [q for q in self._queues if q]
                if self._queues:
                    q = self._queues.pop(0)  # round robin: this thread's next piece, then the others'
                    piece = q.popleft()
                    self._queues.append(q)
                    return piece
                self._cv.wait()

    def _run(self) -> None:
        clock = time.perf_counter
        while (piece := self._next()) is not None:
            t = clock()
            ok = _populate(*piece)
            self.seconds += clock() - t
            if not ok:
                return

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._queues.clear()
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
