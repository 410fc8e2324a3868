"""Where a checkpoint's boxes were and who wrote each: the rule a format-3-4 checkpoint is written and read by.

A `Placement` is what a save knows of the layout it runs under: the degrees, the model's layer count,
whether the embedding is tied, and the global shape and dtype of every parameter. From it
`parallel.sharding.BoxMap` gives the box of every checkpoint key on every rank by arithmetic, so:

- on save, each rank decides alone which of its boxes it writes (`writes`): a box held by several ranks
  is written by one of its holders, `writer`. Data-parallel replicas take turns: the replica at
  position (crc32(key) + shard + tp coordinate) mod their number writes, which spreads the writing
  over them key by key with no exchange of boxes. A box held beyond the replicas (a TP-replicated norm
  on every TP rank, the tied table on the first and last stage) is *shared*: it is written by a
  replica of its first holder (lowest stage, lowest TP coordinate), and described in that rank's
  shared index, apart from its main one, so that a rank at another TP coordinate or stage that loads
  the norm reads a few records, not the index of every matrix that rank wrote;
- on load, a rank finds which saved ranks' indexes describe the tiles that meet its own boxes, and
  the keys of those tiles in each (`index_keys_for`), and reads only those records of those indexes.

Pure: no torch, no process group.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from parallel.layout import Layout
from parallel.sharding import Box, BoxMap, Tile, stage_of


@dataclass(frozen=True, slots=True)
class Placement:
    """The layout a checkpoint is saved under, as much as `BoxMap` needs to place every box."""

    layout: Layout
    n_layers: int
    tied: bool = False
    params: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    """Canonical parameter name -> (global shape, dtype name) of the whole model."""

    def boxmap(self, states: tuple[str, ...]) -> BoxMap:
        """The boxes of every key (``model.<p>`` and ``optim.<state>.<p>`` for `states`) under the layout."""
        return BoxMap(self.layout, {n: s for n, (s, _) in self.params.items()}, self.n_layers, tuple(states),
                      tied=self.tied)

    @property
    def n_sections(self) -> int:
        """How many sections a format-4 top manifest splits its parameters into under this placement: one
        per pipeline stage, and one more for the tied table when two stages hold it."""
        return self.layout.pp + (1 if self.tied and self.layout.pp > 1 else 0)

    def section(self, name: str) -> int | None:
        """The section of a format-4 top manifest that holds parameter `name`: its pipeline stage's, or
        the last one for the tied table when two stages hold it; None for a name no stage holds (a
        layer beyond the model's)."""
        try:
            stage = stage_of(name, self.n_layers, self.layout.pp)
        except ValueError:
            return None
        if self.tied and self.layout.pp > 1 and name == "tok_embeddings.weight":
            return self.layout.pp
        return stage

    def to_dict(self) -> dict[str, Any]:
        """The top manifest's ``placement``; the parameters' shapes are the manifest's tensors."""
        return {"layout": self.layout.to_dict(), "n_layers": self.n_layers, "tied": self.tied}

    @classmethod
    def from_dict(cls, d: Any, params: dict[str, tuple[tuple[int, ...], str]]) -> "Placement":
        """Raises ValueError saying what is malformed."""
        if not isinstance(d, dict) or not isinstance(d.get("layout"), dict):
            raise ValueError("placement must be an object with a layout")
        n = d.get("n_layers")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"placement n_layers must be an integer >= 0, got {n!r}")
        return cls(layout=Layout.from_dict(d["layout"]), n_layers=n, tied=bool(d.get("tied", False)),
                   params=dict(params))


def shared(bm: BoxMap, key: str, tile: Tile) -> bool:
    """Whether `tile` of `key` is held beyond its data-parallel replicas (several TP ranks or stages)."""
    return len(bm.holders(key, tile)) > bm.layout.dp_replicate


def writer(bm: BoxMap, key: str, tile: Tile) -> int:
    """The rank that writes `tile` of `key`: one of its holders, chosen from the key and the tile alone.
    `holders` lists stages, then replicas, then TP ranks: the first stage's ranks at the lowest TP
    coordinate, one per replica, are every `nt`-th of the first R * nt."""
    holders = bm.holders(key, tile)
    R = bm.layout.dp_replicate
    nt = bm.layout.tp if tile.tp is None else 1
    first = holders[:R * nt:nt]
    return first[(zlib.crc32(key.encode()) + tile.shard + (tile.tp or 0)) % len(first)]


def writes(bm: BoxMap, rank: int, key: str) -> bool:
    """Whether `rank` writes its box of `key` (False if it holds none)."""
    tile = bm.tile_of(rank, key)
    return tile is not None and writer(bm, key, tile) == rank


def index_keys_for(bm: BoxMap, boxes: dict[str, Box]) -> dict[tuple[int, bool], set[str]]:
    """The indexes, (saved rank, shared), that describe a chunk meeting `boxes` (key -> box to load),
    each with the keys of those chunks: the records a loader reads of it."""
    out: dict[tuple[int, bool], set[str]] = {}
    for key, box in boxes.items():
        if key in bm:
            for tile in bm.tiles(key, box):
                out.setdefault((writer(bm, key, tile), shared(bm, key, tile)), set()).add(key)
    return out


def indexes_for(bm: BoxMap, boxes: dict[str, Box]) -> set[tuple[int, bool]]:
    """The indexes, (saved rank, shared), that describe every chunk meeting `boxes` (key -> box to load)."""
    return set(index_keys_for(bm, boxes))
