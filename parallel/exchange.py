"""The exchange plan of a live reshard: which slice of which tensor goes from which old rank to which new
rank. Pure: no torch, no process group.

Each needed box is cut along the distinct boxes of the old layout (replicas hold identical boxes,
distinct boxes of one layout never overlap), and each piece gets one source among the old ranks that
hold it, by a rule that depends only on the piece, its receiver and the ranks' places (`choose`):
  1. the same worker (the new rank is a survivor that already holds the piece: a local copy);
  2. else, among the holders on the receiver's node (no network) if there are any, or else among all
     of them, the one at position (receiver + sum of the held box's offsets) mod their number: the
     replicas' reads spread over the receivers and over the pieces, with no global order.
Because the rule needs nothing but the piece, every rank evaluates it alone: `plan_rank` gives one
rank's transfers (those it sends or receives) from the two layouts' `BoxMap`s, finding the boxes that
meet its own by arithmetic on the chunk ranges, in time proportional to its share. `plan_exchange`
gives the whole plan from explicit box maps (any boxes, e.g. read off live DTensors), with the same
rule, so the union of every rank's `plan_rank` is `plan_exchange` of the two layouts' `boxes`. Every
element of every new box is covered exactly once (`check_plan`, and property tests over every pair of
layouts of up to 8 ranks, and of per-rank plans up to 64).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

from parallel.layout import Layout
from parallel.sharding import Box, BoxMap


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
                  same_worker: dict[int, int] | None = None,
                  old_node: dict[int, str] | None = None,
                  new_node: dict[int, str] | None = None) -> list[Transfer]:
    """Transfers that build every new rank's boxes from the old ranks' boxes, in `plan_order`.

    `same_worker`: new rank -> old rank of the same process (survivors). `old_node`/`new_node`: rank ->
    node id. Raises ValueError if some needed element is held by no old rank."""
    same_worker = same_worker or {}
    old_node, new_node = old_node or {}, new_node or {}
    holders: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank in sorted(old):
        for key, box in old[rank].items():
            holders[key][box].append(rank)
    ordered = {key: sorted(d.items(), key=lambda kv: (kv[0].offsets, kv[0].sizes)) for key, d in holders.items()}
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
                src = choose(ranks, dst, held, same_worker, old_node, new_node)
                out.append(Transfer(key=key, src=src, dst=dst, box=piece))
            if covered != need.numel:
                raise ValueError(f"{key}: new rank {dst} needs {need.numel} elements of {need}, the old ranks "
                                 f"hold {covered} of them")
    out.sort(key=plan_order)
    return out


def plan_order(t: Transfer) -> tuple:
    """The order of a plan: by sender, receiver, key, offsets. The transfers of one (sender, receiver)
    pair come in the same order in either rank's `plan_rank` and in `plan_exchange`, so both sides
    post the pair's messages alike."""
    return t.src, t.dst, t.key, t.box.offsets


def choose(holders: list[int], dst: int, held: Box, same_worker: dict[int, int], old_node: dict[int, str],
           new_node: dict[int, str]) -> int:
    """The old rank among `holders` (ascending, each holding the box `held`) that sends new rank `dst`
    its piece of `held` (the rule of the module docstring)."""
    me = same_worker.get(dst)
    if me is not None and me in holders:
        return me
    node = new_node.get(dst)
    pool = holders
    if node is not None and old_node:
        pool = [r for r in holders if old_node.get(r) == node] or holders
    return pool[(dst + sum(held.offsets)) % len(pool)]


def plan_rank(old: BoxMap, new: BoxMap, *, old_rank: int | None, new_rank: int | None,
              alive: Collection[int] | None = None, same_worker: dict[int, int] | None = None,
              old_node: dict[int, str] | None = None, new_node: dict[int, str] | None = None) -> list[Transfer]:
    """The transfers of one worker, `old_rank` in the old layout and `new_rank` in the new (either may be
    None): every piece it receives and every piece the rule (`choose`) has it send, in `plan_order`.
    `alive`: the old ranks still present (all of them if None); the other arguments as in
    `plan_exchange`. Work is proportional to this worker's boxes and their overlaps, not to the world.
    Raises ValueError if some element this worker needs is held by no live old rank."""
    same_worker = same_worker or {}
    old_node, new_node = old_node or {}, new_node or {}
    live = (lambda hs: hs) if alive is None else (lambda hs: [h for h in hs if h in alive])
    out: list[Transfer] = []
    if new_rank is not None:
        done: dict[str, list[tuple[int, Box]]] = {}  # parameter -> (source, piece): its moments get the same
        for key, need in new.held(new_rank).items():
            got = done.get(new.param(key))
            if got is None:
                got = done[new.param(key)] = []
                covered = 0
                for tile in old.tiles(key, need):
                    ranks = live(old.holders(key, tile))
                    piece = need.intersect(tile.box)
                    if piece is None or not ranks:
                        continue
                    covered += piece.numel
                    got.append((choose(ranks, new_rank, tile.box, same_worker, old_node, new_node), piece))
                if covered != need.numel:
                    raise ValueError(f"{key}: new rank {new_rank} needs {need.numel} elements of {need}, the "
                                     f"live old ranks hold {covered} of them")
            out += [Transfer(key=key, src=src, dst=new_rank, box=piece) for src, piece in got]
    if old_rank is not None and (alive is None or old_rank in alive):
        sent: dict[str, list[tuple[int, Box]]] = {}  # parameter -> (receiver, piece)
        for key in old.held(old_rank):
            if key not in new:
                continue
            give = sent.get(old.param(key))
            if give is None:
                give = sent[old.param(key)] = []
                mine = old.tile_of(old_rank, key)
                ranks = live(old.holders(key, mine))
                for tile in new.tiles(key, mine.box):
                    piece = mine.box.intersect(tile.box)
                    if piece is None:
                        continue
                    give += [(dst, piece) for dst in new.holders(key, tile) if dst != new_rank and
                             choose(ranks, dst, mine.box, same_worker, old_node, new_node) == old_rank]
            out += [Transfer(key=key, src=old_rank, dst=dst, box=piece) for dst, piece in give]
    out.sort(key=plan_order)
    return out


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
    other coordinate (pipeline stage, FSDP shard, TP shard) holds distinct ones (`Layout.place`): the
    survivors' distinct places must number all of the layout's. One look at each survivor, none at the
    ranks that are gone."""
    return len({layout.place(r) for r in ranks}) == layout.places
