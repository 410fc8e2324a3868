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


def overlapping(n: int, parts: int, lo: int, hi: int) -> range:
    """Indices of the non-empty pieces of `n` split into `parts` (`chunk`) that meet [lo, hi)."""
    lo, hi = max(lo, 0), min(hi, n)
    if hi <= lo:
        return range(0)
    c = -(-n // parts)
    return range(lo // c, (hi - 1) // c + 1)


@dataclass(frozen=True, slots=True)
class Tile:
    """One distinct box of a tensor under a layout, and which coordinates hold it: every rank of one of
    `stages` whose dp_shard coordinate is `shard` and whose tp coordinate is `tp` (any, if None: the
    tensor is not split by TP), whatever its dp_replicate coordinate."""

    box: Box
    tp: int | None
    shard: int


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    stages: tuple[int, ...]
    tp_dim: int | None
    """The dim TP splits, None when TP does not split this tensor (or tp == 1)."""


class BoxMap:
    """The boxes of every checkpoint key under one layout, computed on demand by arithmetic on the chunk
    ranges: what one rank holds (`held`), the distinct boxes that meet a given box (`tiles`) and the
    ranks that hold one (`holders`), each in time proportional to its answer, never to the world size
    or the number of boxes. `boxes()` is the same map spelled out for every rank."""

    def __init__(self, layout: Layout, shapes: dict[str, tuple[int, ...]], n_layers: int,
                 optimizer_states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), *, tied: bool = False) -> None:
        from parallel.pipeline import stage_layers

        self.layout = layout
        stage = {layer: s for s, layers in enumerate(stage_layers(n_layers, layout.pp)) for layer in layers}
        self._params: dict[str, _Param] = {}
        self._keys: dict[int, list[tuple[str, _Param]]] = {s: [] for s in range(layout.pp)}
        """Pipeline stage -> the keys its ranks hold, in the order `boxes()` lists them."""
        for name, shape in shapes.items():
            m = re.match(r"layers\.(\d+)\.", name)
            if m:
                if int(m.group(1)) not in stage:
                    raise ValueError(f"{name}: layer {m.group(1)} is not among the model's {n_layers} layers")
                stages = {stage[int(m.group(1))]}
            else:
                stages = {0 if name.startswith("tok_embeddings.") else layout.pp - 1}
            if tied and name == "tok_embeddings.weight":
                stages.add(layout.pp - 1)
            d = tp_shard_dim(name)
            par = _Param(name, tuple(shape), tuple(sorted(stages)), d if layout.tp > 1 else None)
            for key in (f"model.{name}", *(f"optim.{st}.{name}" for st in optimizer_states)):
                self._params[key] = par
                for s in par.stages:
                    self._keys[s].append((key, par))

    def __contains__(self, key: str) -> bool:
        return key in self._params

    def param(self, key: str) -> str:
        """The parameter `key` belongs to: keys of one parameter (its moments) have the same boxes."""
        return self._params[key].name

    def _coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp_shard, tp) coordinates of `rank` (as `Layout.coords`, without the dict)."""
        lay = self.layout
        if not 0 <= rank < lay.world_size:
            raise ValueError(f"rank {rank} is outside world_size {lay.world_size} of layout {lay}")
        return rank // (lay.tp * lay.dp_shard * lay.dp_replicate), rank // lay.tp % lay.dp_shard, rank % lay.tp

    def held(self, rank: int) -> dict[str, Box]:
        """Checkpoint key -> the box `rank` holds (keys it holds nothing of are left out)."""
        p, s, t = self._coords(rank)
        out: dict[str, Box] = {}
        cache: dict[int, Box | None] = {}
        for key, par in self._keys[p]:
            b = cache.get(id(par), ...)
            if b is ...:
                b = cache[id(par)] = self._box(par, t, s)
            if b is not None:
                out[key] = b
        return out

    def tile_of(self, rank: int, key: str) -> Tile | None:
        """The tile `rank` holds of `key`, None if it holds none of it."""
        p, s, t = self._coords(rank)
        par = self._params[key]
        if p not in par.stages:
            return None
        b = self._box(par, t, s)
        return None if b is None else Tile(b, t if par.tp_dim is not None else None, s)

    def _box(self, par: _Param, t: int, s: int) -> Box | None:
        shape, lay = par.shape, self.layout
        offsets, sizes = [0] * len(shape), list(shape)
        if par.tp_dim is not None:
            offsets[par.tp_dim], sizes[par.tp_dim] = chunk(shape[par.tp_dim], lay.tp, t)
        if lay.dp_shard > 1 and shape:
            start, sizes[0] = chunk(sizes[0], lay.dp_shard, s)
            offsets[0] += start
        if 0 in sizes:
            return None
        return Box(tuple(offsets), tuple(sizes))

    def tiles(self, key: str, box: Box) -> list[Tile]:
        """The distinct boxes of `key` under this layout that meet `box` (each is held by `holders`)."""
        par = self._params.get(key)
        if par is None:
            return []
        shape, lay = par.shape, self.layout
        if not shape:
            return [Tile(Box((), ()), None, 0)]
        S, T = lay.dp_shard, lay.tp
        lo0, hi0 = box.offsets[0], box.offsets[0] + box.sizes[0]
        rows: list[tuple[int, int, int | None, int]] = []  # (start, size, tp, shard) along dim 0
        if par.tp_dim == 0:
            for t in overlapping(shape[0], T, lo0, hi0):
                a, m = chunk(shape[0], T, t)
                for s in overlapping(m, S, lo0 - a, hi0 - a):
                    b, k = chunk(m, S, s)
                    rows.append((a + b, k, t, s))
        else:
            for s in overlapping(shape[0], S, lo0, hi0):
                b, k = chunk(shape[0], S, s)
                rows.append((b, k, None, s))
        cols: list[tuple[int, int, int | None]] = [(0, shape[1], None)] if len(shape) > 1 else []
        if par.tp_dim == 1:
            lo1, hi1 = box.offsets[1], box.offsets[1] + box.sizes[1]
            cols = [(*chunk(shape[1], T, t), t) for t in overlapping(shape[1], T, lo1, hi1)]
        rest_o, rest_s = (0,) * max(0, len(shape) - 2), tuple(shape[2:])
        out: list[Tile] = []
        for r0, n0, t0, s in rows:
            if len(shape) == 1:
                out.append(Tile(Box((r0,), (n0,)), t0, s))
                continue
            for c0, n1, t1 in cols:
                out.append(Tile(Box((r0, c0, *rest_o), (n0, n1, *rest_s)), t0 if t1 is None else t1, s))
        return out

    def holders(self, key: str, tile: Tile) -> list[int]:
        """The ranks that hold `tile` of `key`, ascending."""
        lay = self.layout
        R, S, T = lay.dp_replicate, lay.dp_shard, lay.tp
        tps = range(T) if tile.tp is None else (tile.tp,)
        return [((p * R + r) * S + tile.shard) * T + t
                for p in self._params[key].stages for r in range(R) for t in tps]


def boxes(layout: Layout, shapes: dict[str, tuple[int, ...]], n_layers: int,
          optimizer_states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), *, tied: bool = False) -> dict[int, dict[str, Box]]:
    """rank -> checkpoint key (`model.<name>`, `optim.<state>.<name>`) -> the box it holds, for every
    rank of `layout` and every parameter in `shapes` (canonical name -> global shape)."""
    m = BoxMap(layout, shapes, n_layers, optimizer_states, tied=tied)
    return {rank: m.held(rank) for rank in range(layout.world_size)}
