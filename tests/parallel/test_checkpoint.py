"""Tier 1: checkpoint format, commit, retention and validation, in one process without a process group.

Resharding across layouts needs spawned ranks: see tests/distributed/test_resume.py.
"""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
import torch

from models.config import model_config
from models.llama import build_model
from parallel.checkpoint import (
    CheckpointError,
    CheckpointManager,
    Manifest,
    ManifestError,
    inspect,
    load_full_model_state,
)
from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
from parallel.checkpoint.state import capture_rng, restore_rng
from parallel.checkpoint.storage import LocalStorage
from parallel.checkpoint.writer import ShardWriter
from parallel.parallelize import materialize

STEP_DIR = "step-{:08d}"


def tiny(dim: int = 32, seed: int = 0):
    cfg = model_config("tiny", n_layers=1, dim=dim, n_heads=2, n_kv_heads=1, ffn_hidden=64, vocab_size=64)
    model = build_model(cfg)
    materialize(model, seed=seed, device=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model, opt, steps: int) -> None:
    g = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 8), generator=g)
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()


def expected(model) -> dict:
    return {n: (tuple(p.shape), "float32") for n, p in model.named_parameters()}


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.fixture
def run(tmp_path):
    """A model trained 2 steps and checkpointed, then 2 more and checkpointed: (root, model, opt, snaps)."""
    root = str(tmp_path / "ckpt")
    model, opt = tiny()
    mgr = CheckpointManager(root, keep_last=5)
    snaps = {}
    for step in (2, 4):
        train(model, opt, 2)
        snaps[step] = snapshot(model, opt)
        mgr.save(step, model, opt, state={"layout": {"tp": 1}, "data": {"consumed_samples": step * 8}})
    mgr.flush()
    return root, model, opt, snaps


def shard_of(root: str, step: int) -> str:
    d = os.path.join(root, STEP_DIR.format(step))
    (name,) = [n for n in os.listdir(d) if n.endswith(".safetensors")]
    return os.path.join(d, name)


# -- manifest ----------------------------------------------------------------------------------------

def test_manifest_round_trip():
    m = Manifest(
        step=7,
        tensors={"model.w": TensorEntry(shape=(4, 2), dtype="float32",
                                        chunks=(Chunk("a.safetensors", (0, 0), (2, 2)),
                                                Chunk("b.safetensors", (2, 0), (2, 2))))},
        files={"a.safetensors": FileEntry(100, "ab"), "b.safetensors": FileEntry(120, "cd")},
        optimizer_steps={"w": 7},
        state={"layout": {"dp_shard": 2, "tp": 1}, "rng": {"torch": "AAAA"}},
    )
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert back.layout == {"dp_shard": 2, "tp": 1}
    assert back.model_tensors() == {"w": m.tensors["model.w"]}
    assert back.structure_problems() == []


@pytest.mark.parametrize("text,needle", [
    ("{not json", "not valid JSON"),
    ('{"format": "other", "format_version": 1}', "format"),
    ('{"format": "elastron-checkpoint", "format_version": 99, "step": 1, "tensors": {}, "files": {}}', "newer"),
    ('{"format": "elastron-checkpoint", "format_version": 1, "step": -1, "tensors": {}, "files": {}}', "step"),
    ('{"format": "elastron-checkpoint", "format_version": 1, "step": 1, "tensors": {}, '
     '"files": {"../x": {"size": 1, "sha256": "a"}}}', "plain file name"),
])
def test_manifest_rejects_malformed(text, needle):
    with pytest.raises(ManifestError, match=needle):
        Manifest.from_json(text)


def test_structure_problems_find_holes_overlaps_and_unlisted_files():
    m = Manifest(step=1, files={"a": FileEntry(1, "x")}, tensors={
        "hole": TensorEntry(shape=(4,), dtype="float32", chunks=(Chunk("a", (0,), (2,)),)),
        "overlap": TensorEntry(shape=(4,), dtype="float32", chunks=(Chunk("a", (0,), (3,)), Chunk("a", (2,), (2,)))),
        "unlisted": TensorEntry(shape=(1,), dtype="float32", chunks=(Chunk("zz", (0,), (1,)),)),
    })
    text = "\n".join(m.structure_problems())
    assert "hole: chunks cover 2 of 4" in text
    assert "overlap: chunks at" in text
    assert "'zz'" in text
    assert "file a: its chunks need 28 bytes but the file has 1" in text  # (2 + 3 + 2) float32 elements


def _random_chunks(rng, n):
    """n random 2-d boxes inside a 12 x 9 tensor, some overlapping, some not."""
    out = []
    for _ in range(n):
        r0, c0 = rng.randrange(12), rng.randrange(9)
        out.append(Chunk("a", (r0, c0), (rng.randint(1, 12 - r0), rng.randint(1, 9 - c0))))
    return out


def _meet(a, b) -> bool:
    return all(x < y + m and y < x + n for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def test_overlaps_and_chunks_meeting_a_box_agree_with_a_full_scan():
    """The sweep of `structure_problems` finds exactly the overlapping pairs a check of every pair finds,
    and `TensorEntry.meeting` exactly the chunks a scan of every chunk finds."""
    import random

    rng = random.Random(41)
    for _ in range(300):
        chunks = _random_chunks(rng, rng.randint(1, 8))
        pairs = sum(_meet(a, b) for i, a in enumerate(chunks) for b in chunks[i + 1:])
        m = Manifest(step=1, files={"a": FileEntry(10**6, "x")},
                     tensors={"t": TensorEntry(shape=(12, 9), dtype="float32", chunks=tuple(chunks))})
        assert sum("overlap" in p for p in m.structure_problems()) == pairs
        box = _random_chunks(rng, 1)[0]
        want = sorted((c.offsets, c.sizes) for c in chunks if _meet(c, box))
        assert sorted((c.offsets, c.sizes) for c in m.tensors["t"].meeting(box.offsets, box.sizes)) == want


# -- save / load ---------------------------------------------------------------------------------------

def test_round_trip_is_exact_and_self_describing(run):
    root, _, _, snaps = run
    d = os.path.join(root, STEP_DIR.format(4))
    # Only safetensors shards and JSON (the manifest and the rank's index): no DCP .metadata pickle.
    assert sorted(os.listdir(d)) == ["index-r00000.json", "manifest.json", "shard-r00000-00.safetensors"]
    text = open(os.path.join(d, "manifest.json")).read()
    doc = json.loads(text)  # format 4: a header and one section per pipeline stage, one JSON object
    manifest = doc["header"]
    assert doc["format_version"] == 4 and manifest["indexes"] == 1 and len(doc["sections"]) == 1
    assert manifest["step"] == 4 and manifest["layout"] == {"tp": 1} and manifest["data"]["consumed_samples"] == 32
    assert doc["sections"][0]["params"]["output.weight"]["shape"] == [64, 32]  # and so its moments'
    assert manifest["optimizer"]["states"] == ["exp_avg", "exp_avg_sq"]
    index = json.loads(open(os.path.join(d, "index-r00000.json")).read())
    assert set(index["optimizer_steps"].values()) == {4}  # step counters live here, not in the files
    assert index["chunks"]["optim.exp_avg.output.weight"]["sizes"] == [64, 32]
    assert set(index["chunks"]) == set(Manifest.from_json(text).tensors)
    assert not [k for k in index["chunks"] if k.endswith("step")]
    for name, f in index["files"].items():
        assert os.path.getsize(os.path.join(d, name)) == f["size"]

    model, opt = tiny(seed=99)
    loaded = CheckpointManager(root).load_latest(model, opt, expected=expected(model))
    assert loaded.step == 4
    assert_same(snapshot(model, opt), snaps[4])


def test_async_save_writes_the_staged_values(tmp_path):
    """What is saved is the state at save() time, even if training changes it before the write ends."""
    model, opt = tiny()
    train(model, opt, 1)
    before = snapshot(model, opt)
    mgr = CheckpointManager(str(tmp_path), async_save=True)
    mgr.save(1, model, opt, state={})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next "training step", racing the background writer
    mgr.flush()
    m2, o2 = tiny(seed=5)
    mgr.load_latest(m2, o2)
    assert_same(snapshot(m2, o2), before)


def test_the_staging_pool_is_reserved_before_the_first_save(tmp_path):
    """`prepare` (before any optimizer step) sizes the pool for the weights and the AdamW moments the first
    step creates; the first async save stages into that pool instead of allocating one, and saves the
    right values. A blocking save on CPU stages nothing, so nothing is reserved for it."""
    from parallel.checkpoint.state import Stager, collect, pieces

    model, opt = tiny()
    assert CheckpointManager(str(tmp_path / "blocking"), async_save=False).prepare(model, opt) == 0
    mgr = CheckpointManager(str(tmp_path / "async"), async_save=True)
    reserved = mgr.prepare(model, opt)
    train(model, opt, 1)
    assert reserved == Stager.pool_bytes(pieces(collect(model, opt)[0])) > 0
    before = snapshot(model, opt)
    mgr.save(1, model, opt, state={})
    mgr.flush()
    assert mgr._stager.allocations == 1  # the reservation, used by the first save
    m2, o2 = tiny(seed=5)
    mgr.load_latest(m2, o2)
    assert_same(snapshot(m2, o2), before)


def test_a_reserved_pool_too_small_is_replaced():
    from parallel.checkpoint.state import Stager
    from parallel.checkpoint.writer import Piece

    items = [Piece(key="a", data=torch.arange(100.0), offsets=(0,))]
    st = Stager()
    st.reserve([64], pin=False)
    staged = st.stage(items)
    assert st.allocations == 2 and torch.equal(staged[0].data, items[0].data)
    st.reserve([p.nbytes for p in items], pin=False)  # large enough already: nothing new
    assert torch.equal(st.stage(items)[0].data, items[0].data) and st.allocations == 2


def _corrupt(kind: str, root: str, step: int) -> None:
    d = os.path.join(root, STEP_DIR.format(step))
    shard = shard_of(root, step)
    if kind == "missing manifest":
        os.remove(os.path.join(d, "manifest.json"))
    elif kind == "bit flip":
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) - 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))
    elif kind == "truncated shard":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 64)
    elif kind == "missing file":
        os.remove(shard)
    else:
        raise AssertionError(kind)


CORRUPTIONS = [
    ("missing manifest", "no manifest.json"),
    ("bit flip", "fails its xxh3-128 checksum"),
    ("truncated shard", "truncated"),
    ("missing file", "is missing"),
]


@pytest.mark.parametrize("kind,reason", CORRUPTIONS)
def test_bad_newest_checkpoint_falls_back_with_reason(run, caplog, kind, reason):
    root, _, _, snaps = run
    _corrupt(kind, root, 4)
    model, opt = tiny(seed=5)
    with caplog.at_level(logging.WARNING, logger="parallel.checkpoint"):
        loaded = CheckpointManager(root).load_latest(model, opt, expected=expected(model))
    assert loaded.step == 2
    assert_same(snapshot(model, opt), snaps[2])
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert STEP_DIR.format(4) in warning and reason in warning


def test_a_fresh_load_past_a_bad_newest_checkpoint_overwrites_what_it_read(run):
    """`fresh=True` reads blocks straight into the shards, so the newest checkpoint's good blocks land
    there before its bit flip is found; the older checkpoint's load must then overwrite every one."""
    root, _, _, snaps = run
    _corrupt("bit flip", root, 4)
    model, opt = tiny(seed=5)
    loaded = CheckpointManager(root).load_latest(model, opt, expected=expected(model), fresh=True)
    assert loaded.step == 2
    assert_same(snapshot(model, opt), snaps[2])


@pytest.mark.parametrize("kind,reason", CORRUPTIONS)
def test_no_loadable_checkpoint_fails_with_reason(run, kind, reason):
    root, *_ = run
    _corrupt(kind, root, 4)
    _corrupt(kind, root, 2)
    model, opt = tiny(seed=5)
    with pytest.raises(CheckpointError, match=reason) as e:
        CheckpointManager(root).load_latest(model, opt, expected=expected(model))
    assert STEP_DIR.format(4) in str(e.value) and STEP_DIR.format(2) in str(e.value)


def test_different_model_shape_is_never_loaded(run, caplog):
    root, _, _, snaps = run
    big, big_opt = tiny(dim=48)
    train(big, big_opt, 1)
    CheckpointManager(root, keep_last=5).save(6, big, big_opt, state={}, blocking=True)
    model, opt = tiny(seed=5)
    with caplog.at_level(logging.WARNING, logger="parallel.checkpoint"):
        loaded = CheckpointManager(root).load_latest(model, opt, expected=expected(model))
    assert loaded.step == 4
    assert_same(snapshot(model, opt), snaps[4])
    assert "different model shape" in caplog.text and STEP_DIR.format(6) in caplog.text
    with pytest.raises(CheckpointError, match="different model shape"):
        CheckpointManager(root).load_latest(big, big_opt, expected={**expected(big), "extra.weight": ((1,), "float32")})


def test_no_checkpoint_returns_none(tmp_path):
    model, opt = tiny()
    assert CheckpointManager(str(tmp_path / "empty")).load_latest(model, opt) is None


def test_load_path_never_unpickles(run, monkeypatch):
    root, _, _, snaps = run

    def refuse(*a, **k):
        raise AssertionError("the load path unpickled something")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    model, opt = tiny(seed=5)
    assert CheckpointManager(root).load_latest(model, opt).step == 4
    assert_same(snapshot(model, opt), snaps[4])
    full, _ = load_full_model_state(root)
    assert torch.equal(full["output.weight"], snaps[4]["p.output.weight"])


# -- commit, latest, retention -----------------------------------------------------------------------------

def test_retention_keeps_the_newest(tmp_path):
    root = str(tmp_path)
    model, opt = tiny()
    os.makedirs(os.path.join(root, STEP_DIR.format(1)))  # an uncommitted leftover older than what follows
    mgr = CheckpointManager(root, keep_last=2)
    for step in (2, 3, 4, 5):
        train(model, opt, 1)
        mgr.save(step, model, opt, state={})
    mgr.flush()
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == [STEP_DIR.format(4), STEP_DIR.format(5)]
    assert open(os.path.join(root, "latest")).read().strip() == STEP_DIR.format(5)
    one = CheckpointManager(root, keep_last=1)
    one.save(6, model, opt, state={}, blocking=True)  # returns once committed; retention runs after it
    one.flush()
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == [STEP_DIR.format(6)]
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(root, keep_last=0)


def test_latest_moves_only_after_commit(run, monkeypatch):
    root, model, opt, _ = run
    events: list[str] = []
    orig_write, orig_commit = LocalStorage.write_bytes, LocalStorage.commit_dir

    def write_bytes(self, path, data):
        name = os.path.basename(path)
        if name == "latest":
            # At this point the new checkpoint must already be complete under its final name.
            assert os.path.exists(os.path.join(root, STEP_DIR.format(6), "manifest.json"))
        events.append(name)
        orig_write(self, path, data)

    def commit_dir(self, staging, final):
        events.append("commit")
        orig_commit(self, staging, final)

    monkeypatch.setattr(LocalStorage, "write_bytes", write_bytes)
    monkeypatch.setattr(LocalStorage, "commit_dir", commit_dir)
    CheckpointManager(root, keep_last=5).save(6, model, opt, state={}, blocking=True)
    assert events == ["index-r00000.json", "manifest.json", "commit", "latest"]  # the manifest after every index

    def failing_commit(self, staging, final):
        raise OSError("disk full")

    monkeypatch.setattr(LocalStorage, "commit_dir", failing_commit)
    with pytest.raises(CheckpointError, match="disk full"):
        CheckpointManager(root, keep_last=5).save(8, model, opt, state={}, blocking=True)
    assert open(os.path.join(root, "latest")).read().strip() == STEP_DIR.format(6)
    assert not os.path.exists(os.path.join(root, STEP_DIR.format(8)))


def test_kill_mid_save_leaves_previous_checkpoint(run, monkeypatch):
    root, model, opt, snaps = run
    orig = ShardWriter.write

    def dies_after_writing(self, files, **kw):
        orig(self, files, **kw)  # the shards are on disk, the manifest is not
        raise RuntimeError("simulated kill")

    monkeypatch.setattr(ShardWriter, "write", dies_after_writing)
    mgr = CheckpointManager(root, keep_last=5)
    train(model, opt, 1)
    mgr.save(5, model, opt, state={}, blocking=False)  # async: the failure surfaces at the next call...
    with pytest.raises(CheckpointError, match="simulated kill"):
        mgr.save(6, model, opt, state={})  # ...which therefore does not start
    mgr.flush()  # nothing left in flight
    with pytest.raises(CheckpointError, match="simulated kill"):
        mgr.save(6, model, opt, state={}, blocking=True)  # a blocking save reports its own failure
    assert sorted(n for n in os.listdir(root) if "step-" in n) == [STEP_DIR.format(2), STEP_DIR.format(4)]
    assert open(os.path.join(root, "latest")).read().strip() == STEP_DIR.format(4)

    # A process killed outright leaves its staging directory behind: it is never loaded, and removed.
    stale = os.path.join(root, ".step-00000007.tmp")
    os.makedirs(stale)
    open(os.path.join(stale, "shard-r00000-00.safetensors"), "wb").write(b"partial")
    monkeypatch.undo()
    fresh, fresh_opt = tiny(seed=5)
    assert CheckpointManager(root).load_latest(fresh, fresh_opt).step == 4
    assert not os.path.exists(stale)
    assert_same(snapshot(fresh, fresh_opt), snaps[4])
    mgr.save(6, model, opt, state={}, blocking=True)  # a failed step can be saved again once storage recovers
    assert mgr.last_committed_step == 6 and inspect(root)["step"] == 6


# -- offline tools -------------------------------------------------------------------------------------------

def test_inspect_and_full_model_state(run):
    root, _, _, snaps = run
    info = inspect(root)
    assert info["valid"] and info["problems"] == [] and info["step"] == 4
    assert info["layout"] == {"tp": 1}
    assert info["tensors"]["model.output.weight"] == {"shape": [64, 32], "dtype": "float32"}
    assert info["total_bytes"] == sum(f["size"] for f in info["files"].values()) > 0
    full, manifest = load_full_model_state(os.path.join(root, STEP_DIR.format(4)))
    assert manifest["step"] == 4
    assert full.keys() == {k[2:] for k in snaps[4] if k.startswith("p.")}
    for name, t in full.items():
        assert torch.equal(t, snaps[4][f"p.{name}"])

    _corrupt("bit flip", root, 4)
    bad = inspect(root)
    assert not bad["valid"] and "xxh3-128 checksum" in bad["problems"][0]
    with pytest.raises(CheckpointError, match="xxh3-128 checksum"):
        load_full_model_state(os.path.join(root, STEP_DIR.format(4)))
    full, manifest = load_full_model_state(root)  # a root falls back to the newest valid checkpoint
    assert manifest["step"] == 2 and torch.equal(full["output.weight"], snaps[2]["p.output.weight"])


def test_rng_round_trip():
    import random

    import numpy as np

    saved = json.loads(json.dumps(capture_rng()))  # must survive JSON
    a = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(saved)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
    with pytest.raises(ValueError, match="malformed RNG"):
        restore_rng({"python": [3, [1, 2], None]})


def test_a_format3_top_manifest_round_trips_in_either_spelling():
    def top(tensors):
        return Manifest(step=3, tensors={k: TensorEntry(shape=s, dtype=d, chunks=()) for k, (s, d) in tensors.items()},
                        files={}, format_version=3, indexes=4, scope="top",
                        placement={"layout": {"dp_shard": 2, "tp": 2}, "n_layers": 1, "tied": False})

    same = {"model.w": ((4, 2), "float32"), "optim.exp_avg.w": ((4, 2), "float32"), "optim.exp_avg_sq.w": ((4, 2), "float32")}
    odd = {**same, "optim.exp_avg.w": ((4, 2), "bfloat16")}  # a moment unlike its parameter: spelled out
    for tensors, field in ((same, "params"), (odd, "tensors")):
        m = top(tensors)
        d = json.loads(m.to_json())
        assert field in d and "files" not in d and "chunks" not in m.to_json()
        back = Manifest.from_json(m.to_json())
        assert back.scope == "top" and back.indexes == 4 and back.placement_of().layout.tp == 2
        assert {k: (t.shape, t.dtype) for k, t in back.tensors.items()} == tensors
