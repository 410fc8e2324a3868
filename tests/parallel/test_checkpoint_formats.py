"""A format-2 checkpoint (one manifest naming every chunk) still loads, under another layout (tier 1); a
format-3 save whose boxes its placement does not predict falls back and still loads (tier 2).

The fixture under tests/fixtures/checkpoint_format2 was written by the format-2 writer itself (its
`make_fixture.py` says how): four ranks under dp_shard=2,tp=2 after one AdamW step. Here one process
(dp=1) loads it and must hold exactly the full tensors those ranks gathered when they saved.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from models.config import model_config
from models.llama import build_model
from parallel.checkpoint import CheckpointManager, inspect, load_full_model_state
from parallel.checkpoint.state import collect
from parallel.parallelize import materialize

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoint_format2")
KEYED4 = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoint_keyed4")
CONFIG = dict(n_layers=2, dim=16, n_heads=2, n_kv_heads=2, ffn_hidden=32, vocab_size=32)


def test_a_format2_checkpoint_of_four_ranks_loads_into_one(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURE, "step-00000001"), root / "step-00000001")
    want = load_file(os.path.join(FIXTURE, "expected.safetensors"))
    model = build_model(model_config("tiny", **CONFIG))
    materialize(model, seed=99, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = CheckpointManager(str(root)).load_latest(model, opt)
    assert m.format_version == 2 and m.step == 1 and m.layout == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    got, steps = collect(model, opt)
    assert got.keys() == want.keys() and any(k.startswith("optim.exp_avg_sq.") for k in got)
    for k, t in want.items():
        assert torch.equal(got[k], t), f"{k} differs"
    assert set(steps.values()) == {1}
    info = inspect(str(root))
    assert info["valid"] and info["format_version"] == 2
    full, _ = load_full_model_state(str(root))
    assert all(torch.equal(full[k.removeprefix("model.")], t) for k, t in want.items() if k.startswith("model."))


def test_a_checkpoint_with_keyed_indexes_of_version_4_loads_into_one(tmp_path):
    """Keyed indexes whose records carry all their block digests (``format_version`` 4), written by
    that format's writer (the fixture's `make_fixture.py`): a one-process load reads their records
    and verifies every block (several per chunk) against them."""
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(KEYED4, "step-00000001"), root / "step-00000001")
    head = (root / "step-00000001" / "index-r00001.json").read_bytes()[:128]
    assert b'"format_version":4,' in head
    want = load_file(os.path.join(KEYED4, "expected.safetensors"))
    model = build_model(model_config("tiny", **CONFIG))
    materialize(model, seed=99, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = CheckpointManager(str(root)).load_latest(model, opt)
    assert m.format_version == 3 and m.step == 1 and m.placement is not None
    assert max(c.n_blocks for t in m.tensors.values() for c in t.chunks) > 4
    got, steps = collect(model, opt)
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert torch.equal(got[k], t), f"{k} differs"
    assert set(steps.values()) == {1}
    info = inspect(str(root))
    assert info["valid"] and info["format_version"] == 3


@pytest.mark.dist
def test_a_save_whose_boxes_the_placement_does_not_predict_falls_back_and_loads(tmp_path):
    """Four ranks save the same state twice: with the placement of their layout (each rank picks its
    boxes alone; shared norms in shared indexes) and with a wrong one (every rank's boxes gathered, no
    placement recorded). Both load exactly into one process, which reads every index of the second."""
    from tests.bodies import checkpoint_placement_body
    from tests.multiproc import run_ranks

    roots = {n: str(tmp_path / n) for n in ("right", "wrong")}
    results = run_ranks(4, checkpoint_placement_body, roots)
    want = results[0]["full"]
    for name, root in roots.items():
        doc = json.loads((tmp_path / name / "step-00000001" / "manifest.json").read_text())
        top = doc["header"]
        assert doc["format_version"] == 4 and top["indexes"] == 4
        assert (top["placement"] is not None) == (name == "right")
        shared = [f for f in results[0]["files"][name] if f.endswith("-shared.json")]
        assert bool(shared) == (name == "right")  # the TP-replicated norms
        model = build_model(model_config("tiny", **CONFIG))
        materialize(model, seed=99, device=torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        CheckpointManager(root).load_latest(model, opt)
        got, steps = collect(model, opt)
        assert got.keys() == want.keys() and set(steps.values()) == {1}
        for k, t in want.items():
            assert torch.equal(got[k], t), f"{name}: {k} differs"


def test_a_rank_loading_part_of_chunks_reads_and_verifies_only_the_digests_of_their_blocks(tmp_path):
    """The keyed fixture's indexes rewritten by today's writer (block digests apart from the records): a
    rank whose boxes cut chunks in the middle of their blocks reads the digests of the blocks that meet
    its boxes only, loads exactly, and still fails on a corrupt byte inside a block it reads."""
    from parallel.checkpoint.errors import CheckpointError
    from parallel.checkpoint.formats import KEYED_INDEX_VERSION, index_name
    from parallel.checkpoint.index import Index
    from parallel.checkpoint.keys import key_order
    from parallel.checkpoint.manifest import Manifest
    from parallel.checkpoint.placement import index_keys_for
    from parallel.checkpoint.storage import LocalStorage
    from parallel.checkpoint.tensor_io import Target, read_into
    from parallel.checkpoint.validate import read_indexes
    from parallel.sharding import Box

    step = tmp_path / "step-00000001"
    shutil.copytree(os.path.join(KEYED4, "step-00000001"), step)
    top = Manifest.from_json((step / "manifest.json").read_text())
    keys = key_order(top.tensors)
    for p in step.glob("index-*.json"):
        rank, shared = int(p.name[7:12]), p.name.endswith("-shared.json")
        p.write_bytes(Index.from_bytes(p.read_bytes(), rank=rank, step=1, shared=shared, keys=keys).to_bytes(keys))
    assert f'"format_version":{KEYED_INDEX_VERSION},'.encode() in (step / index_name(1)).read_bytes()[:128]
    want = load_file(os.path.join(KEYED4, "expected.safetensors"))
    # Rows 3-10 of every matrix: inside the first FSDP shard's chunks, cutting their first and last blocks.
    boxes = {k: ((3, 0), (8, t.shape[1])) for k, t in top.tensors.items() if len(t.shape) == 2}
    wanted = index_keys_for(top.placement_of().boxmap(top.optimizer_states()),
                            {k: Box(o, s) for k, (o, s) in boxes.items()})
    st = LocalStorage(str(tmp_path))
    indexes, problems = read_indexes(st, str(step), top, wanted, boxes=boxes)
    part, more = top.merged(indexes, whole=False)
    assert problems == more == part.coverage_problems(boxes) == []
    chunks = [c for k in boxes for c in part.tensors[k].chunks]
    assert sum(c.blocks is not None for c in chunks) >= len(boxes)  # cut chunks: some of their digests
    assert 0 < sum(len(c.digests) for c in chunks) < sum(c.n_blocks for c in chunks)
    targets = {k: Target(torch.empty(s), o) for k, (o, s) in boxes.items()}
    read_into(st, str(step), part, targets)
    for k, (o, s) in boxes.items():
        assert torch.equal(targets[k].local, want[k][3:11]), k
    # A flipped byte in row 5 of a chunk (a block this rank reads) fails its checksum.
    key = "model.layers.0.feed_forward.w1.weight"
    c = next(c for c in part.tensors[key].meeting((3, 0), (8, 16)) if c.offsets[0] <= 5 < c.offsets[0] + c.sizes[0])
    path = step / c.file
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start = json.loads(data[8:8 + n])[key]["data_offsets"][0]
    data[8 + n + start + (5 - c.offsets[0]) * c.sizes[1] * 4] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{c.file} fails its xxh3-128 checksum"):
        read_into(st, str(step), part, {key: Target(torch.empty(8, 16), (3, 0))})
    info = inspect(str(tmp_path))  # tools read every index whole, digests included, and find the flip
    assert not info["valid"] and any(c.file in p for p in info["problems"])
