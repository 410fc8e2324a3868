"""Memory allocated now and written in full later (a checkpoint load, a live reshard's `fill`, a Hugging
Face import): never initialised, so a restart does no work that the load then throws away.

`SENTINEL` is a seam for tests: set it (e.g. to NaN) in the process and such memory is filled with it
when allocated, so a test can prove that every element was written by what came after. None otherwise:
the memory stays as `torch.empty` gives it.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

SENTINEL: float | None = None


@torch.no_grad()
def mark_unset(tensors: Iterable[torch.Tensor]) -> None:
    """Fill `tensors` (allocated, not yet written) with `SENTINEL`, if one is set."""
    if SENTINEL is None:
        return
    for t in tensors:
        (t.to_local() if isinstance(t, DTensor) else t).fill_(SENTINEL)
