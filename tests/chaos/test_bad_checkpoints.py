"""Bad checkpoints (issue #8 item 3): a truncated shard, a flipped bit in tensor data, a manifest that names
a missing file, a checkpoint of another model's shape. `elastron ckpt inspect` names the file and the
problem in one line; a resumed `elastron train` falls back to the newest good checkpoint, says which it
skipped and why, and sets the bad ones aside instead of deleting or overwriting them; another model's
checkpoint is a one-line error that touches nothing (never a silent start from scratch).

One run trained by `elastron train` (tiny preset, synthetic data, 8 steps, a checkpoint every 2) is shared
by the module; tests corrupt copies of it. The other bad inputs: tests/chaos/test_bad_inputs.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from api.cli import main
from models.config import model_config
from models.llama import build_model
from parallel.checkpoint import CheckpointManager
from parallel.checkpoint.manifest import Manifest
from parallel.parallelize import materialize
from tests.chaos.test_bad_inputs import CFG, elastron, one_line, patched, tree, write_cfg

STEP = "step-{:08d}"
SHARD = "shard-r00000-00.safetensors"  # one rank, small state: one file per checkpoint


# The three ways a committed checkpoint goes bad on disk; each returns (what the problem says, shard name).

def truncate(ckpt: Path) -> str:
    shard = ckpt / SHARD
    os.truncate(shard, shard.stat().st_size // 2)
    return "truncated"


def flipped(data: bytes) -> bytes:
    out = bytearray(data)
    header = 8 + struct.unpack("<Q", out[:8])[0]  # safetensors: u64 header length, JSON header, tensor data
    out[header + (len(out) - header) // 2] ^= 0x01  # in the tensor data: only the checksum can tell
    return bytes(out)


def flip_bit(ckpt: Path) -> str:
    (ckpt / SHARD).write_bytes(flipped((ckpt / SHARD).read_bytes()))
    return "fails its xxh3-128 checksum"


def remove_shard(ckpt: Path) -> str:
    (ckpt / SHARD).unlink()  # the manifest still names it
    return "is missing"


CORRUPTIONS = {"truncated shard": truncate, "flipped bit": flip_bit, "manifest names a missing file": remove_shard}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run directory trained 8 steps by `elastron train`, with checkpoints at steps 2, 4, 6 and 8."""
    d = tmp_path_factory.mktemp("trained")
    r = elastron("train", write_cfg(d / "cfg.yaml", CFG), "--run-dir", str(d / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in (d / "run" / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert names == [STEP.format(s) for s in (2, 4, 6, 8)]
    return d / "run"


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


# -- 1-3: corrupted checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_ckpt_inspect_names_the_bad_file_in_one_line(trained, tmp_path, capsys, kind):
    bad = tmp_path / STEP.format(8)
    shutil.copytree(trained / "checkpoints" / STEP.format(8), bad)
    needle = CORRUPTIONS[kind](bad)
    before = tree(bad)
    for argv in (["ckpt", "inspect", str(bad)], ["ckpt", "inspect", str(bad), "--json"]):
        assert main(argv) == 1
        err = one_line(capsys.readouterr().err)
        assert err.startswith(f"elastron: error: checkpoint {bad} cannot be loaded: file {SHARD} ")
        assert needle in err and "falls back to an older checkpoint" in err, err
    assert tree(bad) == before  # inspecting changes nothing


def test_resume_skips_each_bad_checkpoint_says_why_and_keeps_it(run_copy, tmp_path):
    """Steps 8, 6 and 4 are broken three different ways: `elastron train` resumes from step 2, warns once per
    bad checkpoint naming the file and the problem, and sets each aside (its bytes intact) instead of
    overwriting it when it saves that step again (step 4 here); the good checkpoint stays."""
    ck = run_copy / "checkpoints"
    needles = {8: truncate(ck / STEP.format(8)), 6: flip_bit(ck / STEP.format(6)), 4: remove_shard(ck / STEP.format(4))}
    bad_before = {s: tree(ck / STEP.format(s)) for s in needles}
    good_before = tree(ck / STEP.format(2))

    r = elastron("train", write_cfg(tmp_path / "cfg.yaml", CFG), "--run-dir", str(run_copy), "--steps", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ck} step 2 " in r.stdout
    warnings = [line for line in r.stderr.splitlines() if "cannot be loaded" in line]
    assert len(warnings) == 3, r.stderr
    for (step, needle), line in zip(sorted(needles.items(), reverse=True), warnings):
        aside = ck / f"{STEP.format(step)}.unloadable"
        assert f"checkpoint {ck / STEP.format(step)} cannot be loaded: file {SHARD} " in line and needle in line
        assert f"moved to {aside}" in line, line
        assert tree(aside) == bad_before[step]  # kept byte for byte, for inspection
    assert tree(ck / STEP.format(2)) == good_before
    assert main(["ckpt", "inspect", str(ck / STEP.format(4)), "--json"]) == 0  # saved again, valid
    assert sorted(p.name for p in ck.iterdir()) == [
        "latest", STEP.format(2), STEP.format(4), *(f"{STEP.format(s)}.unloadable" for s in (4, 6, 8))]
    rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6, 7, 8, 3, 4]  # the old rows are kept


def tiny_model(seed: int = 0):
    model = build_model(model_config("tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_hidden=64,
                                     vocab_size=64))
    materialize(model, seed=seed, device=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("storage", ["local", "memory"])
def test_a_bad_checkpoint_never_crowds_good_ones_out_of_retention(tmp_path, storage):
    """keep_last=1 after falling back past a corrupt step 4: the new step 3 is the one kept. Before the fix,
    retention counted the corrupt step 4 as the newest committed checkpoint, kept only it, and deleted
    steps 3 and 2: nothing loadable was left. On object stores (no cheap rename) it stays in place."""
    root = str(tmp_path / "ck") if storage == "local" else f"memory://bad-inputs-{uuid.uuid4().hex}/ck"
    model, opt = tiny_model()
    first = CheckpointManager(root, keep_last=5)
    for step in (2, 4):
        first.save(step, model, opt, state={}, blocking=True)
    fs = fsspec.filesystem("memory") if storage == "memory" else fsspec.filesystem("file")
    shard = f"{root.removeprefix('memory://')}/{STEP.format(4)}/{SHARD}"
    fs.pipe_file(shard, flipped(fs.cat_file(shard)))
    try:
        again = CheckpointManager(root, keep_last=1)
        assert again.load_latest(*tiny_model(seed=1)).step == 2
        again.save(3, model, opt, state={}, blocking=True)
        again.flush()  # a blocking save returns at the commit; retention finishes in the writer thread
        fresh = CheckpointManager(root, keep_last=1)
        assert fresh.load_latest(*tiny_model(seed=2)).step == 3
        left = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root.removeprefix("memory://"), detail=False))
        bad = f"{STEP.format(4)}.unloadable" if storage == "local" else STEP.format(4)  # object stores: in place
        assert left == ["latest", STEP.format(3), bad]
    finally:
        if storage == "memory":
            fs.rm(root.removeprefix("memory://"), recursive=True)


# -- 4: a checkpoint of another model shape -----------------------------------------------------------------

def test_a_checkpoint_of_another_model_shape_is_a_one_line_error_and_stays_untouched(run_copy, tmp_path):
    before = tree(run_copy)
    other = patched(CFG, model={"preset": "tiny", "overrides": {"dim": 64}})
    r = elastron("train", write_cfg(tmp_path / "cfg.yaml", other), "--run-dir", str(run_copy), "--steps", "10")
    assert r.returncode != 0
    err = one_line(r.stderr)
    assert err.startswith(f"error: no loadable checkpoint under {run_copy / 'checkpoints'}: {STEP.format(8)}: ")
    m = re.search(r"model parameter (\S+) has shape \[([\d, ]+)\] in the checkpoint but \[([\d, ]+)\] in the "
                  r"model \(different model shape\)", err)
    assert m, err
    saved = Manifest.from_json((run_copy / "checkpoints" / STEP.format(8) / "manifest.json").read_bytes())
    assert list(saved.model_tensors()[m[1]].shape) == [int(x) for x in m[2].split(", ")] != \
        [int(x) for x in m[3].split(", ")]
    assert "use the job config these checkpoints were saved with" in err
    assert "step" not in r.stdout  # no training step ran, not even from scratch
    assert tree(run_copy) == before  # checkpoints and metrics untouched, nothing set aside
