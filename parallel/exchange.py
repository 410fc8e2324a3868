"""The exchange plan of a live reshard: which slice of which tensor goes from which old rank to which new
rank. Pure: no torch, no process group.

Given the boxes every old rank holds and every new rank needs (`sharding.boxes` of the two layouts,
or boxes read off live DTensors), each needed box is cut along the distinct boxes of the old layout
(replicas hold identical boxes, distinct boxes of one layout never overlap), and each piece gets one
source among the old ranks that hold it, preferring, in order:
  1. the same worker (the new rank is a survivor that already holds the piece: a local copy);
  2. a holder on the same node (no network);
  3. the holder that has been given the fewest bytes to send so far (spreading reads over replicas);
  4. the lowest old rank (determinism).
Every element of every new box is covered exactly once (`check_plan`, and property tests over every
pair of layouts of up to 8 ranks).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from parallel.layout import Layout, MeshAxis
from parallel.sharding import Box


@dataclass(frozen=True, slots=True)
class Transfer:
    key: str
    src: int
    """Old rank that sends."""
    dst: int
    """New rank that receives."""
    box: Box
    """The slice, in global coordinates."""


def plan_exchange(old: dict[int, dict[str, Box]], new: dict[int, dict[str, Box]], *,
                  itemsize: dict[str, int] | None = None,
                  same_worker: dict[int, int] | None = None,
                  old_node: dict[int, str] | None = None,
                  new_node: dict[int, str] | None = None) -> list[Transfer]:
    """Transfers that build every new rank's boxes from the old ranks' boxes.

    `same_worker`: new rank -> old rank of the same process (survivors). `old_node`/`new_node`: rank ->
    node id. `itemsize`: bytes per element of each key (default 4), for spreading bytes over replicas.
    Raises ValueError if some needed element is held by no old rank."""
    same_worker = same_worker or {}
    old_node, new_node = old_node or {}, new_node or {}
    holders: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank in sorted(old):
        for key, box in old[rank].items():
            holders[key][box].append(rank)
    ordered = {key: sorted(d.items(), key=lambda kv: (kv[0].offsets, kv[0].sizes)) for key, d in holders.items()}
    sent: dict[int, int] = defaultdict(int)
    out: list[Transfer] = []
    for dst in sorted(new):
        for key in sorted(new[dst]):
            need = new[dst][key]
            covered = 0
            for held, ranks in ordered.get(key, ()):
                piece = need.intersect(held)
                if piece is None:
                    continue
                covered += piece.numel
                src = _choose(ranks, dst, same_worker, old_node, new_node, sent)
                sent[src] += piece.numel * (itemsize or {}).get(key, 4)
                out.append(Transfer(key=key, src=src, dst=dst, box=piece))
            if covered != need.numel:
                raise ValueError(f"{key}: new rank {dst} needs {need.numel} elements of {need}, the old ranks "
                                 f"hold {covered} of them")
    return out


def _choose(ranks: list[int], dst: int, same_worker: dict[int, int], old_node: dict[int, str],
            new_node: dict[int, str], sent: dict[int, int]) -> int:
    me = same_worker.get(dst)
    if me in ranks:
        return me
    node = new_node.get(dst)
    near = [r for r in ranks if node is not None and old_node.get(r) == node]
    pool = near or ranks
    return min(pool, key=lambda r: (sent[r], r))


def check_plan(plan: list[Transfer], old: dict[int, dict[str, Box]], new: dict[int, dict[str, Box]]) -> list[str]:
    """Problems with `plan`: a source that does not hold what it sends, a piece outside its receiver's
    box, pieces of one receiver that overlap, or a receiver's box not covered exactly."""
    problems: list[str] = []
    got: dict[tuple[int, str], list[Box]] = defaultdict(list)
    for t in plan:
        if t.key not in old.get(t.src, {}) or not old[t.src][t.key].contains(t.box):
            problems.append(f"{t.key}: old rank {t.src} does not hold {t.box}")
        if t.key not in new.get(t.dst, {}) or not new[t.dst][t.key].contains(t.box):
            problems.append(f"{t.key}: {t.box} is outside new rank {t.dst}'s box")
        got[(t.dst, t.key)].append(t.box)
    for dst, keys in new.items():
        for key, need in keys.items():
            pieces = got.get((dst, key), [])
            if sum(p.numel for p in pieces) != need.numel:
                problems.append(f"{key}: new rank {dst} gets {sum(p.numel for p in pieces)} of {need.numel} elements")
            for i, a in enumerate(pieces):
                for b in pieces[i + 1:]:
                    if a.intersect(b) is not None:
                        problems.append(f"{key}: new rank {dst} gets {a} and {b}, which overlap")
    return problems


def survivors_hold_everything(layout: Layout, ranks) -> bool:
    """Whether the ranks `ranks` of `layout` still hold every box of the state between them, so a failure
    can heal from peers. Ranks differing only in their data-parallel replica hold identical boxes; any
    other coordinate (pipeline stage, FSDP shard, TP shard) holds distinct ones."""

    def place(rank: int) -> tuple[int, ...]:
        c = layout.coords(rank)
        return tuple(c[a] for a in (MeshAxis.PP, MeshAxis.DP_SHARD, MeshAxis.TP))

    return {place(r) for r in range(layout.world_size)} <= {place(r) for r in ranks}
