"""Peer snapshots, the pure part: who keeps a copy of whose shards (`pair`), and whether the copies that
survivors hold after a failure cover every shard of one snapshot step (`cover`). No torch.

Pairing. Each rank sends its snapshot to one buddy on another node, so a shard's two copies never share
a node. Ranks are ordered node by node (nodes in the order of their lowest rank, ranks ascending within
a node); with `m` the most ranks any node hosts and `n` the ranks in all:
  - `2m <= n`: rank `order[i]` sends to `order[(i + m) % n]`, a permutation (each rank keeps exactly one
    copy besides its own): a node's ranks are a run of at most `m` in the order, so a shift by `m`
    always leaves it;
  - `2m > n` (one node hosts most ranks): the `k = n - m` ranks elsewhere (`others`, in order) each
    send to the big node's rank of the same index, and the big node's rank `j` sends to
    `others[j % k]`, so some ranks keep several copies (`Pairing.keeps` says how many);
  - one node: no copy can live on another node; `Pairing.why` says so.

Cover. After a failure each survivor says which complete copies it holds: for each old rank whose
shards it has (its own, and those of the ranks whose buddy it is), the snapshot steps. A step counts
when every distinct box of the old layout (a place: pipeline stage, FSDP shard, TP shard; replicas hold
identical ones) is held at that step by some survivor; the newest such step wins. The holder of an old
rank's copy serves it in the exchange: the rank itself if it survived, else the lowest survivor with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from parallel.layout import Layout


@dataclass(frozen=True, slots=True)
class Pairing:
    buddy: tuple[int | None, ...]
    """`buddy[r]`: the rank that keeps rank r's copy (None for every rank when no pairing is possible)."""
    why: str = ""
    """Why there is no pairing ("" when there is one)."""

    @property
    def paired(self) -> bool:
        return not self.why

    def keeps(self, rank: int) -> tuple[int, ...]:
        """The ranks whose copies `rank` keeps, ascending."""
        return tuple(r for r, b in enumerate(self.buddy) if b == rank)


def pair(nodes: Sequence[str]) -> Pairing:
    """The buddy of each rank, `nodes[r]` being rank r's node id (the rule of the module docstring)."""
    n = len(nodes)
    by_node: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        by_node.setdefault(node, []).append(r)
    if len(by_node) < 2:
        why = ("no ranks" if n == 0 else
               f"all {n} ranks are on one node: no copy of a shard can live on another node")
        return Pairing(buddy=(None,) * n, why=why)
    order = [r for ranks in by_node.values() for r in ranks]
    m = max(len(ranks) for ranks in by_node.values())
    buddy: list[int | None] = [None] * n
    if 2 * m <= n:
        for i, r in enumerate(order):
            buddy[r] = order[(i + m) % n]
        return Pairing(buddy=tuple(buddy))
    big = next(ranks for ranks in by_node.values() if len(ranks) == m)
    others = [r for r in order if r not in big]
    for i, r in enumerate(others):
        buddy[r] = big[i]
    for j, r in enumerate(big):
        buddy[r] = others[j % len(others)]
    return Pairing(buddy=tuple(buddy))


@dataclass(frozen=True, slots=True)
class Cover:
    """The survivors' copies cover snapshot `step`: `serve[old rank] = survivor` for every old rank
    whose copy at that step a survivor holds (each box of the old layout among them)."""

    step: int
    serve: dict[int, int]


@dataclass(frozen=True, slots=True)
class NoCover:
    why: str


def cover(layout: Layout, held: Mapping[int, Mapping[int, Sequence[int]]]) -> Cover | NoCover:
    """The newest snapshot step whose every box the survivors hold (the rule of the module docstring).
    `held[survivor][old rank]`: the complete snapshot steps of that old rank's copy the survivor holds
    (survivors are ranks of `layout`, or any other worker id that holds copies)."""
    at: dict[int, dict[int, list[int]]] = {}  # step -> old rank -> survivors holding its copy
    for survivor in sorted(held):
        for old, steps in held[survivor].items():
            for s in steps:
                at.setdefault(s, {}).setdefault(old, []).append(survivor)
    if not at:
        return NoCover("no survivor holds a snapshot")
    for step in sorted(at, reverse=True):
        have = at[step]
        if len({layout.place(r) for r in have}) == layout.places:
            return Cover(step=step, serve={r: (r if r in hs else hs[0]) for r, hs in sorted(have.items())})
    newest = max(at)
    held_places = {layout.place(h) for h in at[newest]}
    lost = sorted(r for r in range(layout.world_size) if layout.place(r) not in held_places)
    return NoCover(f"no survivor holds a copy of old rank(s) {lost} of {layout} at snapshot step {newest} "
                   f"(nor every shard at an older one): a rank and the buddy that kept its copy were both lost")
