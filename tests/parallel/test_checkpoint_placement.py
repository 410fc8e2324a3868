"""Tier 1: the format-3 writer rule and index reads (`parallel.checkpoint.placement`), pure.

Every distinct box of every tensor must be written by exactly one of its holders, and the written boxes
must tile each tensor; a loading rank's index reads must be exactly the indexes (saved rank, shared or
not) describing a box that meets one of its own, and of each the keys of those boxes (found here by
scanning every saved rank, which the rule avoids).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from models.config import model_config
from models.llama import build_model
from parallel.checkpoint.placement import Placement, index_keys_for, indexes_for, shared, writer, writes
from parallel.layout import Layout

STATES = ("exp_avg", "exp_avg_sq")


def _params(tied: bool) -> dict:
    # Uneven everywhere: 3 layers over pp=2, vocab 37 and ffn 45 over tp=2/4 and dp_shard=3 (empty boxes).
    cfg = model_config("tiny", n_layers=3, dim=24, n_heads=4, n_kv_heads=2, ffn_hidden=45, vocab_size=37,
                       tie_embeddings=tied)
    return {n: (tuple(p.shape), "float32") for n, p in build_model(cfg).named_parameters()}


PARAMS = {tied: _params(tied) for tied in (False, True)}


def layouts(limit: int) -> list[Layout]:
    out = []
    for r, s, t, p in itertools.product((1, 2, 3), (1, 2, 3, 8), (1, 2, 4), (1, 2, 3)):
        if r * s * t * p <= limit:
            out.append(Layout(dp_replicate=r, dp_shard=s, tp=t, pp=p))
    return out


def placement(layout: Layout, tied: bool) -> Placement:
    return Placement(layout=layout, n_layers=3, tied=tied, params=PARAMS[tied])


@pytest.mark.parametrize("tied", [False, True])
def test_the_writer_rule_writes_every_box_exactly_once_for_layouts_up_to_64_ranks(tied):
    checked = 0
    for layout in layouts(64):
        if tied and layout.pp == 1:  # a tied table is shared between stages only with several
            continue
        bm = placement(layout, tied).boxmap(STATES)
        held: dict[str, dict] = {}  # key -> box -> holders
        written: dict[str, list] = {}
        per_rank = [0] * layout.world_size
        for rank in range(layout.world_size):
            for key, box in bm.held(rank).items():
                held.setdefault(key, {}).setdefault(box, []).append(rank)
                if writes(bm, rank, key):
                    written.setdefault(key, []).append(box)
                    per_rank[rank] += 1
        for key, boxes in held.items():
            assert sorted(written.get(key, []), key=lambda b: b.offsets) == sorted(boxes, key=lambda b: b.offsets), \
                f"{layout} {key}: written {written.get(key)} but held {list(boxes)}"
            shape = PARAMS[tied][key.split(".", 2)[-1] if key.startswith("optim.") else key[len("model."):]][0]
            assert sum(b.numel for b in boxes) == math.prod(shape), f"{layout} {key}: boxes do not tile"
        if layout.dp_replicate > 1:  # replicas share the writing rather than one replica writing all
            assert all(n > 0 for n in per_rank), f"{layout}: some rank writes nothing ({per_rank})"
        checked += 1
    assert checked >= (25 if tied else 70)


def test_a_rank_reads_only_the_indexes_of_the_ranks_whose_boxes_meet_its_own():
    rng = random.Random(7)
    pool = layouts(64)
    pairs = [(a, b) for a in layouts(8) for b in layouts(8)]
    pairs = rng.sample(pairs, 40) + [(rng.choice(pool), rng.choice(pool)) for _ in range(12)]
    for old, new in pairs:
        tied = rng.random() < 0.5
        saved = placement(old, tied).boxmap(STATES)
        loading = placement(new, tied).boxmap(STATES)
        wrote = [(w, key, box, shared(saved, key, saved.tile_of(w, key)))
                 for w in range(old.world_size) for key, box in saved.held(w).items() if writes(saved, w, key)]
        for rank in range(new.world_size):
            mine = loading.held(rank)
            meeting: dict = {}  # index -> the keys of its chunks that meet a box of this rank
            for w, key, box, s in wrote:
                if key in mine and mine[key].intersect(box) is not None:
                    meeting.setdefault((w, s), set()).add(key)
            assert index_keys_for(saved, mine) == meeting, f"{old} -> {new}, rank {rank}"
            assert indexes_for(saved, mine) == set(meeting)


def test_the_writer_is_one_of_the_holders_and_spreads_over_replicas():
    layout = Layout(dp_replicate=3, dp_shard=2, tp=2)
    bm = placement(layout, False).boxmap(STATES)
    counts = [0] * layout.dp_replicate
    for rank in range(4):  # the first replica's boxes; each is held by one rank of every replica
        for key in bm.held(rank):
            tile = bm.tile_of(rank, key)
            w = writer(bm, key, tile)
            assert w in bm.holders(key, tile)
            counts[w // 4] += 1
    assert min(counts) > 0.2 * sum(counts), counts
