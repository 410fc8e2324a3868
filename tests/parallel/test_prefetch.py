"""Reading a resuming rank's checkpoint files into the page cache beside its build: which files a rank
needs under its layout, worked out from the manifest alone, and the thread that reads them."""

from __future__ import annotations

import pytest

from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.prefetch import Prefetch, files_for_rank, start_prefetch
from parallel.layout import Layout


def _manifest(tensors: dict[str, tuple[tuple[int, ...], list[tuple[str, tuple, tuple]]]]) -> Manifest:
    files = sorted({f for _, chunks in tensors.values() for f, _, _ in chunks})
    return Manifest(step=3, files={f: FileEntry(size=1, digest="") for f in files},
                    tensors={k: TensorEntry(shape=shape, dtype="float32",
                                            chunks=tuple(Chunk(file=f, offsets=o, sizes=s) for f, o, s in chunks))
                             for k, (shape, chunks) in tensors.items()})


# wq is split on dim 0 under tp; the final norm is whole on every rank. Saved by two tp ranks: rows 0-3 in
# a.safetensors, rows 4-7 in b.safetensors, and the norm (written once) in b.
SAVED = _manifest({
    "model.layers.0.attention.wq.weight": ((8, 4), [("a", (0, 0), (4, 4)), ("b", (4, 0), (4, 4))]),
    "optim.exp_avg.layers.0.attention.wq.weight": ((8, 4), [("a", (0, 0), (4, 4)), ("b", (4, 0), (4, 4))]),
    "model.norm.weight": ((4,), [("b", (0,), (4,))]),
})


def test_each_tp_rank_needs_the_files_of_its_rows_and_of_the_whole_tensors():
    lay = Layout.parse("tp=2")
    assert files_for_rank(SAVED, lay, 0, 1, tied=False) == ["a", "b"]  # its rows in a, the norm in b
    only_rows = _manifest({k: v for k, v in {
        "model.layers.0.attention.wq.weight": ((8, 4), [("a", (0, 0), (4, 4)), ("b", (4, 0), (4, 4))])}.items()})
    assert files_for_rank(only_rows, lay, 0, 1, tied=False) == ["a"]
    assert files_for_rank(only_rows, lay, 1, 1, tied=False) == ["b"]
    assert files_for_rank(only_rows, Layout.parse("dp=1"), 0, 1, tied=False) == ["a", "b"]


def test_a_pipeline_stage_needs_only_its_layers_files():
    m = _manifest({"model.layers.0.attention.wq.weight": ((8, 4), [("a", (0, 0), (8, 4))]),
                   "model.layers.1.attention.wq.weight": ((8, 4), [("b", (0, 0), (8, 4))])})
    lay = Layout.parse("pp=2")
    assert files_for_rank(m, lay, 0, 2, tied=False) == ["a"]
    assert files_for_rank(m, lay, 1, 2, tied=False) == ["b"]


def test_a_name_the_layout_cannot_place_means_every_file():
    m = _manifest({"model.layers.7.attention.wq.weight": ((8, 4), [("a", (0, 0), (8, 4))]),
                   "model.norm.weight": ((4,), [("b", (0,), (4,))])})
    assert files_for_rank(m, Layout.parse("pp=2"), 0, 2, tied=False) == ["a", "b"]  # layer 7 of 2


def test_the_thread_reads_every_byte_of_its_files_and_stops_when_told(tmp_path, monkeypatch):
    import parallel.checkpoint.prefetch as prefetch

    monkeypatch.setattr(prefetch, "BLOCK", 1000)
    paths = []
    for i, n in enumerate((2500, 10, 0)):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes(n))
        paths.append(p)
    p = Prefetch(paths)
    p._thread.join()
    assert p.stop() == 2510
    assert Prefetch([tmp_path / "missing"]).stop() == 0  # a hint only: an unreadable file is no error


def test_nothing_to_prefetch_without_a_local_checkpoint(tmp_path):
    lay = Layout.parse("dp=1")
    assert start_prefetch(None, lay, 0, 1, tied=False) is None
    assert start_prefetch(str(tmp_path), lay, 0, 1, tied=False) is None  # no step directory
    assert start_prefetch("s3://bucket/ckpts", lay, 0, 1, tied=False) is None
    (tmp_path / "step-00000002").mkdir()  # a step directory without a manifest (an interrupted save)
    assert start_prefetch(str(tmp_path), lay, 0, 1, tied=False) is None


@pytest.mark.dist
def test_a_resuming_trainer_prefetches_the_newest_checkpoints_files(tmp_path):
    from tests.multiproc import run_ranks

    cfg = {"model": {"preset": "tiny"}, "data": {"source": "synthetic", "seq_len": 16},
           "train": {"steps": 10, "global_batch_size": 4, "micro_batch_size": 2, "seed": 3},
           "checkpoint": {"dir": str(tmp_path), "interval_steps": 1, "async_save": False}}
    (r,) = run_ranks(1, _resume_body, cfg)
    assert r["step"] == 2 and r["prefetched"] <= r["files_bytes"]
    assert r["planned"] == r["files"] and r["read_all"] == r["files_bytes"] > 0


def _resume_body(cfg: dict) -> dict:
    import os

    import torch

    from workers.config import JobConfig
    from workers.trainer import Trainer

    cpu = torch.device("cpu")
    Trainer(JobConfig.from_dict(cfg), layout=Layout(), device=cpu).build().fit(2)
    tr = Trainer(JobConfig.from_dict(cfg), layout=Layout(), device=cpu).build()
    from parallel.checkpoint.validate import parse_step

    root = cfg["checkpoint"]["dir"]
    newest = os.path.join(root, max((n for n in os.listdir(root) if parse_step(n) is not None), key=parse_step))
    files = sorted(f for f in os.listdir(newest) if f.endswith(".safetensors"))
    p = tr._prefetch()  # again, run to the end: the build's was stopped when its load began
    p._thread.join()
    return {"step": tr.step, "prefetched": tr.prefetched_bytes,
            "files": files, "planned": sorted(q.name for q in p._paths),
            "files_bytes": sum(os.path.getsize(os.path.join(newest, f)) for f in files), "read_all": p.stop()}
