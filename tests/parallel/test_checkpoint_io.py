"""Tier 1: the streaming shard writer, block checksums, the one-pass verified reader and writer assignment.

Resharding across real layouts (DTensor shards on spawned ranks) is in tests/distributed/test_resume.py;
here the boxes are built by hand, which lets the tests pick awkward ones (uneven, column slices,
blocks smaller than a chunk).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallel.checkpoint import CheckpointError, CheckpointManager, inspect, load_full_model_state
from parallel.checkpoint import writer as writer_mod
from parallel.checkpoint.checksum import ALGORITHMS
from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
from parallel.checkpoint.formats import MANIFEST_NAME
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.state import assign_writers
from parallel.checkpoint.storage import LocalStorage
from parallel.checkpoint.tensor_io import Target, read_into
from parallel.checkpoint.validate import file_problems
from parallel.checkpoint.writer import Piece, ShardWriter, split_files
from tests.parallel.test_checkpoint import assert_same, snapshot, tiny, train


def _write(tmp_path, tensors: dict[str, tuple[torch.Tensor, tuple[int, ...]]], *, algorithm="xxh3-128",
           block_bytes=64, files=1) -> tuple[LocalStorage, str, Manifest]:
    """Write boxes `key -> (data, global offsets)` of full tensors into one checkpoint dir with a manifest."""
    st = LocalStorage(str(tmp_path))
    d = str(tmp_path / "ck")
    os.makedirs(d, exist_ok=True)
    pieces = [Piece(key=k.split("@")[0], data=t, offsets=o) for k, (t, o) in tensors.items()]
    groups = split_files(pieces, files)
    w = ShardWriter(st, d, algorithm=algorithm, block_bytes=block_bytes)
    written = w.write({f"f{i}.safetensors": g for i, g in enumerate(groups)}, threads=2)
    shapes: dict[str, tuple[int, ...]] = {}
    for p in pieces:
        end = tuple(o + s for o, s in zip(p.offsets, p.data.shape))
        shapes[p.key] = tuple(max(a, b) for a, b in zip(shapes.get(p.key, end), end))
    chunks: dict[str, list[Chunk]] = {}
    for wf in written:
        for k, c in wf.chunks.items():
            chunks.setdefault(k, []).append(Chunk(wf.name, c.offsets, c.sizes, c.block_rows, tuple(c.digests)))
    m = Manifest(step=1, files={wf.name: FileEntry(wf.size, wf.header_digest, algorithm, True) for wf in written},
                 tensors={k: TensorEntry(shapes[k], str(pieces[0].data.dtype).removeprefix("torch."),
                                         tuple(chunks[k])) for k in chunks})
    assert m.structure_problems() == []
    return st, d, m


def test_files_are_plain_safetensors(tmp_path):
    a = torch.randn(7, 5)
    b = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    st, d, m = _write(tmp_path, {"a": (a, (0, 0)), "b": (b, (0, 0))})
    (name,) = m.files
    with safe_open(os.path.join(d, name), framework="pt") as f:
        assert torch.equal(f.get_tensor("a"), a) and torch.equal(f.get_tensor("b"), b)
        assert json.loads(f.metadata()["elastron_offsets"]) == {"a": [0, 0], "b": [0, 0]}
    assert os.path.getsize(os.path.join(d, name)) == m.files[name].size
    assert file_problems(st, d, m) == []


def test_block_reads_reshard_and_read_only_what_they_need(tmp_path):
    """Two chunks of rows (an uneven 7 + 5 split); a target that wants rows 3..9 and columns 1..3 gets
    exactly those values, reading only the blocks (here 2 rows each) that hold rows 3..9."""
    full = torch.randn(12, 4)
    st, d, m = _write(tmp_path, {"w@0": (full[:7].clone(), (0, 0)), "w@1": (full[7:].clone(), (7, 0))},
                      block_bytes=2 * 4 * 4, files=2)
    chunks = m.tensors["w"].chunks
    assert [c.block_rows for c in chunks] == [2, 2] and [len(c.digests) for c in chunks] == [4, 3]
    out = torch.zeros(6, 2)
    nbytes = read_into(st, d, m, {"w": Target(out, (3, 1))})
    assert torch.equal(out, full[3:9, 1:3])
    # chunk 0 (rows 0-6): blocks 1-3 hold rows 2-6; chunk 1 (rows 7-11): block 0 holds rows 7-8.
    # 7 rows of 16 bytes, of the 12 rows stored.
    assert nbytes == 7 * 16


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_checksum_algorithm_round_trips_and_catches_a_flip(tmp_path, algorithm):
    full = torch.randn(16, 8)
    st, d, m = _write(tmp_path, {"w": (full, (0, 0))}, algorithm=algorithm, block_bytes=128)
    out = torch.zeros_like(full)
    read_into(st, d, m, {"w": Target(out, (0, 0))})
    assert torch.equal(out, full)
    (name,) = m.files
    path = os.path.join(d, name)
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x10  # last block of the data
    open(path, "wb").write(bytes(data))
    out = torch.zeros_like(full)
    if algorithm == "none":
        read_into(st, d, m, {"w": Target(out, (0, 0))})  # nothing to check: the flip goes unnoticed
        assert not torch.equal(out, full)
        return
    with pytest.raises(CheckpointError, match=f"fails its {algorithm} checksum"):
        read_into(st, d, m, {"w": Target(out, (0, 0))})
    assert torch.equal(out[-2:], torch.zeros(2, 8))  # the corrupt block never reached the target
    assert f"fails its {algorithm} checksum" in file_problems(st, d, m)[0]


def test_corrupt_header_is_refused(tmp_path):
    st, d, m = _write(tmp_path, {"w": (torch.randn(4, 4), (0, 0))})
    (name,) = m.files
    path = os.path.join(d, name)
    data = bytearray(open(path, "rb").read())
    i = data.index(b'"shape":[4,4]')
    data[i + 9] = ord("2")  # still valid JSON, still fits the file: only the digest can tell
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted header"):
        read_into(st, d, m, {"w": Target(torch.zeros(4, 4), (0, 0))})


def test_a_file_never_holds_two_chunks_of_one_tensor(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        _write(tmp_path, {"w@0": (torch.zeros(2, 2), (0, 0)), "w@1": (torch.zeros(2, 2), (2, 0))})


def test_split_files_balances_bytes_and_is_deterministic():
    ps = [Piece(k, torch.zeros(n), (0,)) for k, n in [("a", 100), ("b", 60), ("c", 50), ("d", 10)]]
    groups = split_files(ps, 2)
    assert [[p.key for p in g] for g in groups] == [["a", "d"], ["b", "c"]]  # 110 and 110 bytes x 4
    assert split_files(ps, 8)[0][0].key == "a" and len(split_files(ps, 8)) == 4


def test_assign_writers_writes_each_replica_once_and_shares_the_work():
    # ranks 0 and 1 are data-parallel replicas of two tensors; rank 2 holds a shard of its own
    plan = [("x", (0,), (10,), 40), ("y", (0,), (10,), 40)]
    plans = [plan, plan, [("z", (0,), (5,), 20)]]
    out = assign_writers(plans)
    assert out[2] == {("z", (0,))}
    assert sorted(out[0] | out[1]) == [("x", (0,)), ("y", (0,))] and out[0] and out[1] and not out[0] & out[1]
    assert assign_writers(plans) == out


def test_multi_file_save_and_fresh_optimizer_load_without_a_step(tmp_path, monkeypatch):
    """A rank's shard split over several files (written and read in parallel) loads into a fresh model
    and optimizer bit-exactly; the AdamW state is created directly, never by an optimizer step."""
    monkeypatch.setattr("parallel.checkpoint.manager.MIN_FILE_BYTES", 1024)
    model, opt = tiny()
    train(model, opt, 2)
    mgr = CheckpointManager(str(tmp_path), io_threads=3, checksum="blake3")
    mgr.save(2, model, opt, state={}, blocking=True)
    info = inspect(str(tmp_path))
    assert info["valid"] and len(info["files"]) == 3
    assert {f["algorithm"] for f in info["files"].values()} == {"blake3"}
    fresh, fresh_opt = tiny(seed=3)
    monkeypatch.setattr(type(fresh_opt), "step", lambda *a, **k: pytest.fail("optimizer stepped on load"))
    CheckpointManager(str(tmp_path), io_threads=3).load_latest(fresh, fresh_opt)
    assert_same(snapshot(fresh, fresh_opt), snapshot(model, opt))
    assert mgr.save_timings.bytes > 0 and {"collect", "plan", "write", "commit"} <= set(mgr.save_timings.phases)


def test_format_1_checkpoints_still_load(tmp_path):
    """A checkpoint as the previous code wrote it (DCP HF shards, whole-file sha256 in a format-1 manifest)."""
    model, opt = tiny()
    train(model, opt, 1)
    want = snapshot(model, opt)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    steps = {}
    for p, s in opt.state.items():
        steps[names[id(p)]] = int(s["step"])
        tensors[f"optim.exp_avg.{names[id(p)]}"] = s["exp_avg"].clone()
        tensors[f"optim.exp_avg_sq.{names[id(p)]}"] = s["exp_avg_sq"].clone()
    d = tmp_path / "step-00000001"
    d.mkdir()
    fname = "shard-00001-model-00001-of-00001.safetensors"
    save_file(tensors, str(d / fname))
    m = {"format": "elastron-checkpoint", "format_version": 1, "step": 1, "created": 0.0,
         "optimizer": {"name": "AdamW", "steps": steps},
         "tensors": {k: {"shape": list(t.shape), "dtype": "float32",
                         "chunks": [{"file": fname, "offsets": [0] * t.dim(), "sizes": list(t.shape)}]}
                     for k, t in tensors.items()},
         "files": {fname: {"size": os.path.getsize(d / fname),
                           "sha256": hashlib.sha256((d / fname).read_bytes()).hexdigest()}}}
    (d / MANIFEST_NAME).write_text(json.dumps(m))
    fresh, fresh_opt = tiny(seed=3)
    assert CheckpointManager(str(tmp_path)).load_latest(fresh, fresh_opt).step == 1
    assert_same(snapshot(fresh, fresh_opt), want)
    full, _ = load_full_model_state(str(tmp_path))
    assert torch.equal(full["output.weight"], want["p.output.weight"])
    data = bytearray((d / fname).read_bytes())
    data[-5] ^= 1
    (d / fname).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its sha256 checksum"):
        CheckpointManager(str(tmp_path)).load_latest(fresh, fresh_opt)


def test_written_bytes_match_the_tensors_bf16(tmp_path):
    """Non-numpy dtypes go out as raw bytes too."""
    t = torch.randn(5, 3).to(torch.bfloat16)
    st, d, m = _write(tmp_path, {"w": (t, (0, 0))})
    out = torch.zeros(5, 3, dtype=torch.bfloat16)
    read_into(st, d, m, {"w": Target(out, (0, 0))})
    assert torch.equal(out, t)
    assert writer_mod.ST_DTYPES[torch.bfloat16] == "BF16"


def test_overlapped_staging_saves_the_state_before_the_next_optimizer_step(tmp_path, monkeypatch):
    """With overlap_staging the copy runs in the writer thread; the next optimizer.step() waits for it, so
    the checkpoint holds the state at save() time even though training went on at once."""
    import threading

    from parallel.checkpoint import state as state_mod

    model, opt = tiny()
    train(model, opt, 1)
    before = snapshot(model, opt)
    gate = threading.Event()
    orig = state_mod.Stager.stage

    def slow_stage(self, items, **kw):
        assert gate.wait(10)  # hold the copy until the training thread is inside optimizer.step()
        return orig(self, items, **kw)

    monkeypatch.setattr(state_mod.Stager, "stage", slow_stage)
    # Registered before the manager's hook, so it runs first: the copy is released only once the
    # training thread is inside optimizer.step(), which must then wait for it.
    opt.register_step_pre_hook(lambda *_: threading.Timer(0.2, gate.set).start())
    mgr = CheckpointManager(str(tmp_path), async_save=True)
    mgr.save(1, model, opt, state={}, overlap_staging=True)
    assert mgr.in_flight and not gate.is_set()
    train(model, opt, 1)  # forward/backward run at once; step() blocks until the copy is done
    assert mgr.stage_wait_s >= 0.15
    mgr.flush()
    m2, o2 = tiny(seed=5)
    CheckpointManager(str(tmp_path)).load_latest(m2, o2)
    assert_same(snapshot(m2, o2), before)
    assert not torch.equal(snapshot(model, opt)["p.output.weight"], before["p.output.weight"])


def test_row_runs_widen_to_blocks_merge_and_split():
    from parallel.checkpoint.tensor_io import _row_runs

    # blocks of 4 rows in a 30-row chunk; runs of at most 8 rows
    assert _row_runs([(5, 6), (6, 13), (22, 23)], 4, 30, 8) == [(4, 12), (12, 16), (20, 24)]
    assert _row_runs([(27, 30)], 4, 30, 8) == [(24, 30)]  # the last block is short
    assert _row_runs([(3, 7)], 1, 30, 100) == [(3, 7)] and _row_runs([], 4, 30, 8) == []


def test_regions_join_adjacent_runs_and_read_through_gaps_only_when_asked():
    from parallel.checkpoint.tensor_io import _regions, _Segment

    def seg(offset, nbytes):
        return _Segment(read=None, offset=offset, row_bytes=nbytes, block=1, a=0, z=1)

    segs = [seg(0, 4), seg(4, 4), seg(10, 2), seg(12, 8), seg(20, 4)]
    spans = lambda regions: [(r[0].offset, r[-1].offset + r[-1].nbytes) for r in regions]  # noqa: E731
    assert spans(_regions(segs, limit=16)) == [(0, 8), (10, 24)]  # a gap splits, adjacent runs join
    assert spans(_regions(segs, limit=12)) == [(0, 8), (10, 20), (20, 24)]  # no read above the limit
    assert spans(_regions(segs, gap=2, limit=16)) == [(0, 12), (12, 24)]  # the gap is read through
    assert spans(_regions([seg(0, 40), seg(40, 4)], limit=16)) == [(0, 40), (40, 44)]  # a long run alone


@pytest.mark.parametrize("text,needle", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"format": "elastron-checkpoint", "format_version": 2, "step": 1, "tensors": {}, '
     '"files": {"a": {"size": 1, "algorithm": "md5", "header_digest": "x"}}}', "checksum algorithm"),
])
def test_forged_manifests_are_a_verdict_not_a_crash(text, needle):
    from parallel.checkpoint import ManifestError

    with pytest.raises(ManifestError, match=needle):
        Manifest.from_json(text)


def test_a_deeply_nested_manifest_falls_back_to_the_previous_checkpoint(tmp_path):
    model, opt = tiny()
    mgr = CheckpointManager(str(tmp_path))
    train(model, opt, 1)
    mgr.save(1, model, opt, state={}, blocking=True)
    want = snapshot(model, opt)
    train(model, opt, 1)
    mgr.save(2, model, opt, state={}, blocking=True)
    (tmp_path / "step-00000002" / MANIFEST_NAME).write_text("[" * 100_000 + "]" * 100_000)
    fresh, fresh_opt = tiny(seed=3)
    assert CheckpointManager(str(tmp_path)).load_latest(fresh, fresh_opt).step == 1
    assert_same(snapshot(fresh, fresh_opt), want)


def test_block_digest_count_is_checked():
    m = Manifest(step=1, files={"a": FileEntry(100, "h", "xxh3-128", True)}, tensors={
        "w": TensorEntry((4, 2), "float32", (Chunk("a", (0, 0), (4, 2), block_rows=2, digests=("d0",)),))})
    assert any("1 block digests, expected 2" in p for p in m.structure_problems())


def _two_checkpoints(tmp_path):
    model, opt = tiny()
    mgr = CheckpointManager(str(tmp_path))
    train(model, opt, 1)
    mgr.save(1, model, opt, state={}, blocking=True)
    train(model, opt, 1)
    mgr.save(2, model, opt, state={}, blocking=True)
    return snapshot(model, opt)


def test_a_transient_read_error_is_retried_not_a_rollback(tmp_path, monkeypatch):
    """Issue 15 item 11: an OSError while reading the newest checkpoint used to mark it unloadable,
    move it aside and resume from an older one. Now the same checkpoint is read again."""
    from parallel.checkpoint import loader, tensor_io

    newest = _two_checkpoints(tmp_path)
    monkeypatch.setattr(loader, "RETRY_PAUSE_S", 0.0)
    orig, calls = tensor_io._read_file, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) <= 2:
            raise OSError(5, "Input/output error (simulated)")
        return orig(*a, **k)

    monkeypatch.setattr(tensor_io, "_read_file", flaky)
    fresh, fresh_opt = tiny(seed=3)
    assert CheckpointManager(str(tmp_path)).load_latest(fresh, fresh_opt).step == 2
    assert_same(snapshot(fresh, fresh_opt), newest)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-00000001", "step-00000002"]


def test_a_persistent_read_error_fails_without_moving_or_rolling_back(tmp_path, monkeypatch):
    from parallel.checkpoint import loader, tensor_io

    _two_checkpoints(tmp_path)
    monkeypatch.setattr(loader, "RETRY_PAUSE_S", 0.0)

    def broken(*a, **k):
        raise OSError(5, "Input/output error (simulated)")

    monkeypatch.setattr(tensor_io, "_read_file", broken)
    fresh, fresh_opt = tiny(seed=3)
    before = snapshot(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match="step-00000002 could not be read after 3 attempts.*no progress is lost"):
        CheckpointManager(str(tmp_path)).load_latest(fresh, fresh_opt)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-00000001", "step-00000002"]
    assert torch.equal(snapshot(fresh, fresh_opt)["p.output.weight"], before["p.output.weight"])


def test_in_place_reads_land_in_the_targets_without_the_read_buffer(tmp_path, monkeypatch):
    """`in_place`: blocks that land in a host target unchanged (whole rows, same dtype, contiguous) are
    read straight into it and verified there; any other target (a column slice, another dtype) still
    goes through the read buffer, and every target gets its values either way."""
    from parallel.checkpoint import tensor_io

    a, b = torch.randn(12, 4), torch.randn(5, 3, 2)
    st, d, m = _write(tmp_path, {"a": (a, (0, 0)), "b": (b, (0, 0, 0))}, block_bytes=2 * 4 * 4, files=2)
    used = []
    get = tensor_io._Scratch.get
    monkeypatch.setattr(tensor_io._Scratch, "get", lambda self, n: used.append(n) or get(self, n))
    out_a, out_b = torch.empty(12, 4), torch.empty(5, 3, 2)
    read_into(st, d, m, {"a": Target(out_a, (0, 0)), "b": Target(out_b, (0, 0, 0))}, in_place=True)
    assert torch.equal(out_a, a) and torch.equal(out_b, b) and used == []
    cols, half = torch.empty(12, 2), torch.empty(5, 3, 2, dtype=torch.float64)
    read_into(st, d, m, {"a": Target(cols, (0, 1)), "b": Target(half, (0, 0, 0))}, in_place=True)
    assert torch.equal(cols, a[:, 1:3]) and torch.equal(half, b.double()) and used


def test_in_place_reads_still_refuse_a_corrupt_block(tmp_path):
    full = torch.randn(16, 8)
    st, d, m = _write(tmp_path, {"w": (full, (0, 0))}, block_bytes=128)
    (name,) = m.files
    path = os.path.join(d, name)
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="fails its xxh3-128 checksum"):
        read_into(st, d, m, {"w": Target(torch.empty_like(full), (0, 0))}, in_place=True)
