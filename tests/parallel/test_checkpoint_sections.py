"""Tier 1: the format-4 top manifest (`Manifest.to_json` split into a header and one section per
pipeline stage, `validate.read_manifest_text(head=True)` + `validate.read_sections`), pure: no
torch.distributed, files in a temporary directory.

A loading rank of pipeline stage s must read the preamble, the header and exactly the sections holding
its stage's parameters (found here by parsing the whole file), never the whole file; the keyed indexes
must read the same against the keys it knows as against every key; the shapes check must see a wrong
shape in its sections; a damaged section must be a clear error; a format-3 top manifest still loads.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import replace

import pytest
import torch

from models.config import model_config
from models.llama import build_model
from parallel.checkpoint import CheckpointManager
from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
from parallel.checkpoint.errors import CheckpointError, ManifestError
from parallel.checkpoint.formats import FORMAT, MANIFEST_NAME, PREAMBLE_BYTES, index_name, shard_prefix
from parallel.checkpoint.index import Index
from parallel.checkpoint.keys import KeyOrder, key_order
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.placement import Placement, index_keys_for, shared, writes
from parallel.checkpoint.state import collect
from parallel.checkpoint.validate import read_indexes, read_manifest_text, read_sections
from parallel.layout import Layout
from parallel.parallelize import materialize
from parallel.sharding import stage_of
from tests.parallel.test_checkpoint_keyed import CountingStorage

STATES = ("exp_avg", "exp_avg_sq")
CFG = model_config("tiny", n_layers=5, dim=24, n_heads=4, n_kv_heads=2, ffn_hidden=45, vocab_size=37,
                   tie_embeddings=True)
PARAMS = {n: (tuple(p.shape), "float32") for n, p in build_model(CFG).named_parameters()}


def top(layout: Layout, params=PARAMS) -> Manifest:
    keys = {f"{p}{n}": s for n, (s, _) in params.items() for p in ("model.", *(f"optim.{st}." for st in STATES))}
    placement = Placement(layout=layout, n_layers=CFG.n_layers, tied=True, params=params)
    return Manifest(step=5, tensors={k: TensorEntry(shape=s, dtype="float32", chunks=()) for k, s in keys.items()},
                    files={}, format_version=4, placement=placement.to_dict(), indexes=layout.world_size,
                    scope="top", state={"layout": layout.to_dict()})


def listed_in(section: dict) -> set[str]:
    """The parameter names a section of the raw JSON holds: listed one by one, and spelled by its repeats
    (a run of layers with the same entries, written once)."""
    return set(section["params"]) | {f"{r['prefix']}{n}{rest}" for r in section.get("repeats", [])
                                     for n in range(r["first"], r["first"] + r["count"]) for rest in r["entries"]}


def stage_params(layout: Layout, stage: int) -> list[str]:
    """What a rank of `stage` holds (its model's `named_state`): the tied table on the first and last."""
    return [n for n in PARAMS if stage_of(n, CFG.n_layers, layout.pp) == stage
            or (n == "tok_embeddings.weight" and stage == layout.pp - 1)]


@pytest.mark.parametrize("saved,loaded", [("pp=3", "pp=3"), ("pp=3", "pp=2"), ("dp_shard=2,pp=2", "pp=4")])
def test_a_rank_of_stage_s_reads_the_header_and_exactly_the_sections_of_its_parameters(tmp_path, saved, loaded):
    old, new = Layout.parse(saved), Layout.parse(loaded)
    raw = top(old).to_json().encode()
    (tmp_path / MANIFEST_NAME).write_bytes(raw)
    doc = json.loads(raw)  # the whole file, parsed by a plain JSON reader: every section and its parameters
    assert doc["format"] == FORMAT and doc["format_version"] == 4
    assert len(doc["sections"]) == old.pp + 1  # one per stage and the tied table
    whole = Manifest.from_json(raw)
    for stage in range(new.pp):
        names = stage_params(new, stage)
        st = CountingStorage(str(tmp_path))
        text, why = read_manifest_text(st, str(tmp_path), head=True)
        head = Manifest.from_json(text)
        assert why is None and head.tensors == {} and head.layout == old.to_dict()
        part, problems = read_sections(st, str(tmp_path), head, names)
        assert problems == [] and st.whole == []
        # The sections that list one of its parameters, found by scanning the whole file.
        want = {i for i, s in enumerate(doc["sections"]) if listed_in(s) & set(names)}
        assert part.sections.read == want
        spans = [part.sections.spans[i] for i in sorted(want)]
        got = sorted((a, len(data)) for _, a, data in st.ranges)
        header = doc["header"]
        assert got[:2] == [(0, PREAMBLE_BYTES), (PREAMBLE_BYTES, len(json.dumps(header, separators=(",", ":"))))]
        assert sum(n for _, n in got[2:]) == sum(n for _, n, _ in spans)  # those sections, nothing else
        assert all(any(a <= x < a + n for a, n, _ in spans) for x, _ in got[2:])
        assert len(want) < len(doc["sections"]) and sum(n for _, n in got) < len(raw)
        # Its tensors: every key of the parameters of those sections, as the whole file has them.
        listed = {n for i in want for n in listed_in(doc["sections"][i])}
        assert set(part.model_tensors()) == listed >= set(names)
        assert {k: (t.shape, t.dtype) for k, t in part.tensors.items()} == {
            k: (whole.tensors[k].shape, whole.tensors[k].dtype) for k in part.tensors}
        assert part.model_problems(PARAMS) == []


def test_keyed_indexes_read_against_the_keys_a_rank_knows_as_against_every_key(tmp_path):
    layout = Layout.parse("dp_shard=2,tp=2,pp=2")
    m = top(layout)
    (tmp_path / MANIFEST_NAME).write_text(m.to_json())
    order = key_order(m.tensors)
    bm = Placement(layout=layout, n_layers=CFG.n_layers, tied=True, params=PARAMS).boxmap(STATES)
    for w in range(layout.world_size):
        for sh in (False, True):
            boxes = {k: b for k, b in bm.held(w).items() if writes(bm, w, k) and shared(bm, k, bm.tile_of(w, k)) == sh}
            if boxes:
                name = f"{shard_prefix(w)}00.safetensors"
                index = Index(rank=w, step=5, shared=sh, optimizer_steps={n: 5 for n in PARAMS},
                              files={name: FileEntry(size=1 << 20, digest="cd" * 16, algorithm="xxh3-128",
                                                     blockwise=True)},
                              chunks={k: Chunk(file=name, offsets=b.offsets, sizes=b.sizes, block_rows=1,
                                               digests=("ab" * 16,) * b.sizes[0]) for k, b in boxes.items()})
                (tmp_path / index_name(w, sh)).write_bytes(index.to_bytes(order))
    st = CountingStorage(str(tmp_path))
    whole = Manifest.from_json((tmp_path / MANIFEST_NAME).read_bytes())
    for rank in (0, 5):  # the first stage, the last (which holds the tied table too)
        part, _ = read_sections(st, str(tmp_path), Manifest.from_json(read_manifest_text(st, str(tmp_path), head=True)[0]),
                                [whole_name for whole_name in PARAMS if any(
                                    k.endswith("." + whole_name) or k == "model." + whole_name for k in bm.held(rank))])
        keys = part.keys_in_order()
        assert isinstance(keys, KeyOrder) and keys.count == len(order) and len(keys.at) < len(order)
        mine = bm.held(rank)
        wanted = index_keys_for(bm, mine)
        boxes = {k: (b.offsets, b.sizes) for k, b in mine.items()}
        got, problems = read_indexes(st, str(tmp_path), part, wanted, boxes=boxes)
        want, more = read_indexes(st, str(tmp_path), whole, wanted, boxes=boxes)
        assert problems == more == [] and [ix.chunks for ix in got] == [ix.chunks for ix in want]
        merged, more = part.merged(got, whole=False)
        assert more == merged.coverage_problems(boxes) == []


def test_the_shapes_check_of_a_rank_sees_its_sections_and_the_number_of_parameters(tmp_path):
    layout = Layout.parse("pp=3")
    wrong = dict(PARAMS, **{"layers.4.feed_forward.w1.weight": ((46, 24), "float32")})  # a layer of stage 2
    (tmp_path / MANIFEST_NAME).write_text(top(layout, wrong).to_json())
    st = CountingStorage(str(tmp_path))
    head = Manifest.from_json(read_manifest_text(st, str(tmp_path), head=True)[0])
    assert head.model_problems(PARAMS) == []  # the header alone: the number of parameters agrees
    first, _ = read_sections(st, str(tmp_path), head, stage_params(layout, 0))
    last, _ = read_sections(st, str(tmp_path), head, stage_params(layout, 2))
    assert first.model_problems(PARAMS) == []
    assert last.model_problems(PARAMS) == [
        "model parameter layers.4.feed_forward.w1.weight has shape [46, 24] in the checkpoint but [45, 24] in the "
        "model (different model shape)"]
    more = dict(PARAMS, **{"layers.5.ffn_norm.weight": ((24,), "float32")})  # a sixth layer: not in the checkpoint
    assert head.model_problems(more)[0].startswith(f"the checkpoint has {len(PARAMS)} parameters but the model "
                                                   f"{len(PARAMS) + 1}")
    assert "model parameter layers.5.ffn_norm.weight is missing from the checkpoint" in first.model_problems(more)


def test_a_damaged_or_newer_manifest_is_a_one_line_error(tmp_path):
    raw = top(Layout.parse("pp=2")).to_json().encode()
    (tmp_path / MANIFEST_NAME).write_bytes(raw)
    st = CountingStorage(str(tmp_path))
    head = Manifest.from_json(read_manifest_text(st, str(tmp_path), head=True)[0])
    a, n, _ = head.sections.spans[1]
    flipped = raw[:a + 5] + bytes([raw[a + 5] ^ 1]) + raw[a + 6:]
    (tmp_path / MANIFEST_NAME).write_bytes(flipped)
    _, problems = read_sections(st, str(tmp_path), head, stage_params(Layout.parse("pp=2"), 1))
    assert problems == [f"{MANIFEST_NAME} section 1 fails its crc32 check: the checkpoint is corrupted"]
    with pytest.raises(ManifestError, match="section 1 fails its crc32"):
        Manifest.from_json(flipped)
    with pytest.raises(ManifestError, match="truncated or corrupted"):
        Manifest.from_json(raw[:-10])
    with pytest.raises(ManifestError, match="header fails its crc32"):
        Manifest.from_json(raw[:PREAMBLE_BYTES + 3] + b"9" + raw[PREAMBLE_BYTES + 4:])
    newer = raw.replace(b'"format_version":4', b'"format_version":5', 1)
    (tmp_path / MANIFEST_NAME).write_bytes(newer)
    text, _ = read_manifest_text(st, str(tmp_path), head=True)
    with pytest.raises(ManifestError, match=r"format_version 5 is newer than this code reads \(4\)"):
        Manifest.from_json(text)
    # What a format-3 reader checks first (`json.loads`, then `format` and `format_version`): one JSON
    # object of this format, whose version it refuses as newer than its own.
    d = json.loads(raw)
    assert d["format"] == FORMAT and d["format_version"] == 4 > 3


# -- repeats: a run of layers with the same entries, written once ----------------------------------------

def top_of(params: dict, layout: Layout, n_layers: int, tied: bool = True) -> Manifest:
    keys = {f"{p}{n}": (s, d) for n, (s, d) in params.items() for p in ("model.", *(f"optim.{st}." for st in STATES))}
    placement = Placement(layout=layout, n_layers=n_layers, tied=tied, params=params)
    return Manifest(step=5, tensors={k: TensorEntry(shape=s, dtype=d, chunks=()) for k, (s, d) in keys.items()},
                    files={}, format_version=4, placement=placement.to_dict(), indexes=layout.world_size,
                    scope="top", state={"layout": layout.to_dict()})


def same_as_written(m: Manifest, back: Manifest) -> None:
    """`back`, read from `m`'s bytes with every section, is `m` as a format-3 reader would have it."""
    three = Manifest.from_json(Manifest(**{**{f: getattr(m, f) for f in m.__slots__}, "format_version": 3}).to_json())
    assert back.tensors == m.tensors == three.tensors
    assert (back.state, back.placement, back.indexes, back.step) == (three.state, three.placement, three.indexes, 5)
    assert back.keys_in_order() == key_order(m.tensors)


@pytest.mark.parametrize("layout", ["pp=1", "pp=3"])
def test_a_run_of_layers_with_the_same_entries_is_written_once_and_reads_back_the_same_manifest(tmp_path, layout):
    lay = Layout.parse(layout)
    m = top(lay)
    raw = m.to_json().encode()
    doc = json.loads(raw)
    for stage, s in enumerate(doc["sections"][:lay.pp]):
        held = sorted({int(n.split(".")[1]) for n in stage_params(lay, stage) if n.startswith("layers.")})
        # Its layers in one repeat; a stage of one layer lists it (a repeat is two or more).
        assert [(r["first"], r["count"]) for r in s.get("repeats", [])] == (
            [(held[0], len(held))] if len(held) > 1 else [])
        assert {n for n in s["params"] if n.startswith("layers.")} == (
            set() if len(held) > 1 else {n for n in PARAMS if n.startswith(f"layers.{held[0]}.")})
    assert lay.pp == 1 or any(len(s.get("repeats", [])) == 0 for s in doc["sections"][:lay.pp])
    same_as_written(m, Manifest.from_json(raw))
    # A rank reading some sections gets the same entries and key places as the whole file gives.
    (tmp_path / MANIFEST_NAME).write_bytes(raw)
    for stage in range(lay.pp):
        text, _ = read_manifest_text(CountingStorage(str(tmp_path)), str(tmp_path), head=True)
        part, problems = read_sections(CountingStorage(str(tmp_path)), str(tmp_path), Manifest.from_json(text),
                                       stage_params(lay, stage))
        assert problems == [] and part.tensors == {k: m.tensors[k] for k in part.tensors}
        order = key_order(m.tensors)
        assert part.sections.positions == {k: order.index(k) for k in part.tensors}


def test_layers_that_differ_end_a_run_and_are_listed_one_by_one():
    params = dict(PARAMS)
    params["layers.2.feed_forward.w1.weight"] = ((46, 24), "float32")  # another shape
    params["layers.4.attention_norm.weight"] = ((24,), "bfloat16")  # another dtype
    del params["layers.1.ffn_norm.weight"]  # another parameter set
    params["layers.3.extra.7.bias"] = ((5,), "float32")  # a second number in a name: the first one counts
    assert {"layers.2.feed_forward.w1.weight", "layers.4.attention_norm.weight"} <= set(PARAMS)
    m = top_of(params, Layout.parse("pp=1"), CFG.n_layers)
    doc = json.loads(m.to_json())
    (section,) = doc["sections"]
    assert section.get("repeats", []) == []  # 0 | 1 | 2 | 3 | 4: no two neighbours alike
    assert listed_in(section) == set(params)
    same_as_written(m, Manifest.from_json(m.to_json()))
    # Layers 0, 3 and 4 alike but 4 in bfloat16: 0 alone, then 1-3 would need 1 and 2 alike too.
    params = dict(PARAMS, **{"layers.0.attention.wq.weight": ((24, 24), "bfloat16")})
    m = top_of(params, Layout.parse("pp=1"), CFG.n_layers)
    (section,) = json.loads(m.to_json())["sections"]
    assert [(r["first"], r["count"]) for r in section["repeats"]] == [(1, 4)]
    assert {n for n in section["params"] if n.startswith("layers.")} == {
        n for n in params if n.startswith("layers.0.")}
    same_as_written(m, Manifest.from_json(m.to_json()))


def test_the_top_manifest_of_the_8b_no_longer_grows_with_its_layer_count():
    sizes = {}
    for n_layers in (8, 32):
        params = {n: (tuple(p.shape), "float32")
                  for n, p in build_model(model_config("8b", n_layers=n_layers)).named_parameters()}
        m = top_of(params, Layout.parse("dp_shard=512,tp=8"), n_layers, tied=False)
        raw = m.to_json().encode()
        (section,) = json.loads(raw)["sections"]
        sizes[n_layers] = (len(raw), len(json.dumps(section, separators=(",", ":"))))
        assert [(r["first"], r["count"]) for r in section["repeats"]] == [(0, n_layers)]
        same_as_written(m, Manifest.from_json(raw))
    # One layer's 9 entries and the 3 others, whatever the layer count (21 kB for 32 layers listed one
    # by one); the header's counts and crcs differ by a few digits.
    assert sizes[32][1] < 1200 and abs(sizes[32][1] - sizes[8][1]) <= 4
    assert abs(sizes[32][0] - sizes[8][0]) <= 32 and sizes[32][0] < 1600


def test_a_forged_repeat_is_a_one_line_error(tmp_path):
    m = top(Layout.parse("pp=1"))
    raw = m.to_json().encode()
    head = Manifest.from_json(raw[:PREAMBLE_BYTES + json.loads(raw[:PREAMBLE_BYTES].rstrip()[:-len(b',"header":')]
                                                                          + b"}")["header_bytes"]])
    (section,) = json.loads(raw)["sections"]
    (rep,) = section["repeats"]

    def read(s: dict) -> Manifest:
        b = json.dumps(s, separators=(",", ":")).encode()
        a = head.sections.spans[0][0]
        return replace(head, sections=replace(head.sections, spans=((a, len(b), zlib.crc32(b)),))).with_sections({0: b})

    assert read(section).tensors == m.tensors
    with pytest.raises(ManifestError, match=r"holds 9000000\d+ entries, more than the \d+ its header counts"):
        read({**section, "repeats": [{**rep, "count": 10 ** 9}]})
    with pytest.raises(ManifestError, match=r"gives layers\.0\.attention\.wq\.weight twice"):
        # In place of norm.weight (the header's count holds): a name the repeat gives too.
        read({**section, "params": {**{n: e for n, e in section["params"].items() if n != "norm.weight"},
                                    "layers.0.attention.wq.weight": {"shape": [24, 24], "dtype": "float32"}}})
    with pytest.raises(ManifestError, match=r"'repeats' must be objects with a prefix, first >= 0, count > 0"):
        read({**section, "repeats": [{**rep, "count": 0}]})


def _saved(tmp_path):
    """A one-process save under today's writer, and a model and optimizer to load it into."""
    cfg = model_config("tiny", n_layers=2, dim=16, n_heads=2, n_kv_heads=2, ffn_hidden=32, vocab_size=32)

    def fresh(seed):
        model = build_model(cfg)
        materialize(model, seed=seed, device=torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt

    model, opt = fresh(1)
    model(torch.randint(0, 32, (2, 8))).float().pow(2).mean().backward()
    opt.step()
    CheckpointManager(str(tmp_path / "ckpt")).save(1, model, opt, state={"layout": {"tp": 1}}, blocking=True)
    return model, opt, fresh


def test_a_checkpoint_whose_top_manifest_is_of_format_3_still_loads(tmp_path):
    model, opt, fresh = _saved(tmp_path)
    want, _ = collect(model, opt)
    step = tmp_path / "ckpt" / "step-00000001"
    m = Manifest.from_json((step / MANIFEST_NAME).read_bytes())
    assert m.format_version == 4
    m.format_version, m.sections = 3, None
    (step / MANIFEST_NAME).write_text(m.to_json())  # what the format-3 writer wrote: one JSON document
    assert json.loads((step / MANIFEST_NAME).read_text())["format_version"] == 3
    model2, opt2 = fresh(2)
    back = CheckpointManager(str(tmp_path / "ckpt")).load_latest(model2, opt2)
    assert back.format_version == 3 and back.step == 1
    got, steps = collect(model2, opt2)
    assert got.keys() == want.keys() and set(steps.values()) == {1}
    assert all(torch.equal(got[k], t) for k, t in want.items())


@pytest.mark.dist
def test_the_loader_of_each_stage_reads_its_sections_of_a_pipeline_save(tmp_path):
    """Two ranks train under pp=2 with a tied table and save; the loader's own `my_part`, given each
    stage's model, reads of manifest.json the header (as rank 0 shares it) and the sections of its stage
    and of the tied table, checks their shapes, and finds its indexes and files without a problem."""
    from parallel.checkpoint.loader import my_part
    from parallel.checkpoint.validate import check_manifest
    from parallel.pipeline import split_stage
    from tests.bodies import train_body
    from tests.multiproc import run_ranks

    cfg = {"model": {"preset": "tiny", "overrides": {"n_layers": 2, "tie_embeddings": True}},
           "data": {"source": "synthetic", "seq_len": 16, "num_samples": 64},
           "train": {"steps": 2, "global_batch_size": 2, "micro_batch_size": 1, "seed": 3, "lr": 1e-2,
                     "warmup_steps": 0},
           "checkpoint": {"async_save": False, "interval_steps": 2}}
    run_ranks(2, train_body, cfg, "pp=2", 2, str(tmp_path), return_params=False)
    step = str(tmp_path / "checkpoints" / "step-00000002")
    mcfg = model_config("tiny", n_layers=2, tie_embeddings=True)
    expected = {n: (tuple(p.shape), "float32") for n, p in build_model(mcfg).named_parameters()}
    for stage, sections in ((0, {0, 2}), (1, {1, 2})):
        st = CountingStorage(step)
        text, why = read_manifest_text(st, step, head=True)
        check = check_manifest(step, text, why, expected)
        assert check.problems == [] and check.manifest.sections.read == frozenset()
        model = split_stage(build_model(mcfg), stage, 2)
        part, problems = my_part(st, step, check.manifest, model, expected=expected)
        assert problems == [] and part.sections.read == sections and st.whole == []
        spans = check.manifest.sections.spans
        got = sorted((a, len(data)) for name, a, data in st.ranges if name == MANIFEST_NAME)
        assert got[:2] == [(0, PREAMBLE_BYTES), (PREAMBLE_BYTES, spans[0][0] - PREAMBLE_BYTES - len(b',"sections":['))]
        assert sum(n for _, n in got[2:]) == sum(spans[i][1] for i in sections) < sum(n for _, n, _ in spans)
