"""Tier 1: checkpoints on an S3-compatible object store (moto's server on loopback, through s3fs).

On object stores there is no atomic rename: shards are written in place and the manifest, one PUT
written last, is the commit. These tests check that this gives the same guarantees as local disks.
Skipped when moto[server] or s3fs is not installed (they are test-only dependencies).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs 'moto[server]')")
moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")

from parallel.checkpoint import CheckpointManager, inspect, load_full_model_state  # noqa: E402
from parallel.checkpoint.writer import ShardWriter  # noqa: E402
from tests.parallel.test_checkpoint import assert_same, expected, snapshot, tiny, train  # noqa: E402

_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """An S3 endpoint on 127.0.0.1 and an s3fs client for it; AWS_ENDPOINT_URL points every boto client
    (ours and the checkpoint code's) at it."""
    import s3fs

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in [*_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(_ENV, AWS_ENDPOINT_URL=f"http://{host}:{port}")
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("ckpt-bucket")
        yield fs
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def root(s3, request):
    prefix = f"ckpt-bucket/{request.node.name.replace('[', '_').replace(']', '')}"
    return f"s3://{prefix}/checkpoints"


def _shard(s3, root: str, step: int) -> str:
    d = f"{root[len('s3://'):]}/step-{step:08d}"
    s3.invalidate_cache()
    (name,) = [p for p in s3.ls(d) if p.endswith(".safetensors")]
    return name


def test_round_trip_retention_and_tools(s3, root):
    model, opt = tiny()
    mgr = CheckpointManager(root, keep_last=2)
    for step in (1, 2, 3):
        train(model, opt, 1)
        mgr.save(step, model, opt, state={"layout": {"tp": 1}})
    mgr.flush()
    want = snapshot(model, opt)
    s3.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in s3.ls(root[len("s3://"):]))
    assert names == ["latest", "step-00000002", "step-00000003"]
    assert s3.cat_file(f"{root[len('s3://'):]}/latest").decode().strip() == "step-00000003"

    fresh, fresh_opt = tiny(seed=7)
    assert CheckpointManager(root).load_latest(fresh, fresh_opt, expected=expected(fresh)).step == 3
    assert_same(snapshot(fresh, fresh_opt), want)
    info = inspect(root)
    assert info["valid"] and info["step"] == 3 and info["path"].startswith("s3://")
    full, manifest = load_full_model_state(root)
    assert manifest["step"] == 3 and torch.equal(full["output.weight"], want["p.output.weight"])


def test_corruption_and_interrupted_save_fall_back(s3, root, monkeypatch, caplog):
    model, opt = tiny()
    mgr = CheckpointManager(root, keep_last=5)
    train(model, opt, 1)
    mgr.save(1, model, opt, state={}, blocking=True)
    good = snapshot(model, opt)
    train(model, opt, 1)
    mgr.save(2, model, opt, state={}, blocking=True)

    shard = _shard(s3, root, 2)
    data = bytearray(s3.cat_file(shard))
    data[-10] ^= 0xFF
    s3.pipe_file(shard, bytes(data))

    orig = ShardWriter.write

    def dies_after_writing(self, files, **kw):
        orig(self, files, **kw)
        raise RuntimeError("simulated kill")

    monkeypatch.setattr(ShardWriter, "write", dies_after_writing)
    train(model, opt, 1)
    with pytest.raises(Exception, match="simulated kill"):
        mgr.save(3, model, opt, state={}, blocking=True)
    monkeypatch.undo()
    # A writer killed outright leaves shards and no manifest: never loaded.
    s3.pipe_file(f"{root[len('s3://'):]}/step-00000004/shard-r00000-00.safetensors", b"partial")

    fresh, fresh_opt = tiny(seed=7)
    with caplog.at_level(logging.WARNING, logger="parallel.checkpoint"):
        assert CheckpointManager(root).load_latest(fresh, fresh_opt).step == 1
    assert "step-00000004" in caplog.text and "no manifest.json" in caplog.text
    assert "step-00000002" in caplog.text and "xxh3-128 checksum" in caplog.text
    assert_same(snapshot(fresh, fresh_opt), good)
    assert not inspect(f"{root}/step-00000002")["valid"]
