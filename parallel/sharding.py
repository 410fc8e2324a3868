"""Which box of every tensor each rank holds under a Layout: pure, no torch.distributed.

`parallelize()` places parameters; this module predicts the same placement from the layout and the
global shapes alone, so a resize can be planned before any process group exists (`parallel/exchange.py`):

- pipeline: a rank of stage s holds the layers `pipeline.stage_layers` gives s, the embedding on the
  first stage, the final norm and output projection on the last;
- tensor parallel: the dim in `TP_SHARD_DIM` (column-parallel weights and the vocab-parallel embedding
  and output on dim 0, row-parallel weights on dim 1; norms replicated), split as DTensor's `Shard`
  splits it: `torch.chunk` semantics, chunks of ceil(n / tp), trailing ranks possibly short or empty;
- FSDP (dp_shard): dim 0 of the TP-local box, split the same way (FSDP2's `fully_shard`);
- dp_replicate: whole replicas.
Optimizer moments have the box of their parameter. `tests/distributed/test_sharding_boxes.py` checks
these boxes against the DTensors `parallelize()` builds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parallel.layout import Layout, MeshAxis

TP_BLOCK_SHARD_DIM: dict[str, int] = {
    "attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
    "feed_forward.w1": 0, "feed_forward.w3": 0, "feed_forward.w2": 1,
}
"""Per transformer block: module -> dim its weight is split on under TP (0: column-parallel, 1: row-
parallel). `tensor_parallel.apply_tp` builds its plan from this table."""
TP_TOP_SHARD_DIM: dict[str, int] = {"tok_embeddings": 0, "output": 0}
"""Outside the blocks: the vocab-parallel embedding and the column-parallel output projection."""

_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class Box:
    """The slab [offsets, offsets + sizes) of a global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def contains(self, other: "Box") -> bool:
        return all(a <= b and b + m <= a + n for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes))


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of piece `index` of `n` split into `parts` as torch.chunk does (size may be 0)."""
    c = -(-n // parts)
    start = min(index * c, n)
    return start, max(0, min(c, n - start))


def tp_shard_dim(name: str) -> int | None:
    """The dim parameter `name` (canonical) is split on under TP; None if it is replicated."""
    m = _LAYER.fullmatch(name)
    if m:
        d = TP_BLOCK_SHARD_DIM.get(m.group(2))
        # A column-parallel bias is split with its rows; a row-parallel one is added after the reduction.
        return d if m.group(3) == "weight" or d == 0 else None
    return TP_TOP_SHARD_DIM.get(name.removesuffix(".weight")) if name.endswith(".weight") else None


def stage_of(name: str, n_layers: int, pp: int) -> int:
    """The pipeline stage that holds parameter `name`."""
    from parallel.pipeline import stage_layers

    m = re.match(r"layers\.(\d+)\.", name)
    if m:
        layer = int(m.group(1))
        for s, layers in enumerate(stage_layers(n_layers, pp)):
            if layer in layers:
                return s
        raise ValueError(f"{name}: layer {layer} is not among the model's {n_layers} layers")
    if name.startswith("tok_embeddings."):
        return 0
    return pp - 1  # final norm and output projection


def param_box(name: str, shape: tuple[int, ...], layout: Layout, rank: int, n_layers: int, *,
              tied: bool = False) -> Box | None:
    """The box of parameter `name` that `rank` holds under `layout`; None if it holds none of it. `tied`:
    the embedding table is also the output projection, so the last stage holds it too (split the same
    way: both are vocab-parallel on dim 0)."""
    c = layout.coords(rank)
    stages = {stage_of(name, n_layers, layout.pp)}
    if tied and name == "tok_embeddings.weight":
        stages.add(layout.pp - 1)
    if c[MeshAxis.PP] not in stages:
        return None
    offsets, sizes = [0] * len(shape), list(shape)
    d = tp_shard_dim(name)
    if d is not None and layout.tp > 1:
        offsets[d], sizes[d] = chunk(shape[d], layout.tp, c[MeshAxis.TP])
    if layout.dp_shard > 1 and shape:
        start, sizes[0] = chunk(sizes[0], layout.dp_shard, c[MeshAxis.DP_SHARD])
        offsets[0] += start
    if any(s == 0 for s in sizes):
        return None
    return Box(tuple(offsets), tuple(sizes))


def boxes(layout: Layout, shapes: dict[str, tuple[int, ...]], n_layers: int,
          optimizer_states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), *, tied: bool = False) -> dict[int, dict[str, Box]]:
    """rank -> checkpoint key (`model.<name>`, `optim.<state>.<name>`) -> the box it holds, for every
    rank of `layout` and every parameter in `shapes` (canonical name -> global shape)."""
    out: dict[int, dict[str, Box]] = {}
    for rank in range(layout.world_size):
        mine: dict[str, Box] = {}
        for name, shape in shapes.items():
            b = param_box(name, tuple(shape), layout, rank, n_layers, tied=tied)
            if b is not None:
                mine[f"model.{name}"] = b
                for st in optimizer_states:
                    mine[f"optim.{st}.{name}"] = b
        out[rank] = mine
    return out
