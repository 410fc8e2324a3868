"""train.eval_interval's held-out split: which one, and the one-line refusals when there is none."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workers.config import ConfigError, JobConfig
from workers.disk_checks import check_data_path
from workers.data import build_val_source


def test_corpus_evaluation_needs_a_val_path():
    with pytest.raises(ConfigError, match="train.eval_interval needs a held-out split: set data.val_path"):
        JobConfig.from_dict({"train": {"eval_interval": 10}})
    with pytest.raises(ConfigError, match="train.eval_batches must be > 0"):
        JobConfig.from_dict({"data": {"source": "synthetic"}, "train": {"eval_batches": 0}})


def test_a_missing_val_path_is_named(tmp_path):
    cfg = JobConfig.from_dict({"data": {"val_path": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="data.val_path .* does not exist"):
        check_data_path(cfg.data)


def _tokens(path, n, value):
    np.full(n, value, dtype=np.uint16).tofile(path)


def test_tokens_evaluate_the_val_bin_that_prepare_wrote(tmp_path):
    _tokens(tmp_path / "train.bin", 100, 1)
    _tokens(tmp_path / "val.bin", 40, 2)
    data = JobConfig.from_dict({"data": {"source": "tokens", "path": str(tmp_path / "train.bin"), "seq_len": 8}}).data
    with pytest.raises(ValueError, match="needs a held-out split"):  # no meta.json: not prepare's output
        build_val_source(data, seed=0, vocab_size=16)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 16, "dtype": "uint16"}))
    src = build_val_source(data, seed=0, vocab_size=16)
    assert len(src) == 39 // 8 and set(src.sample(0)) == {2}


def test_synthetic_held_out_samples_differ_from_training_ones():
    from workers.data import build_source

    data = JobConfig.from_dict({"data": {"source": "synthetic", "seq_len": 8}}).data
    train, val = build_source(data, seed=3, vocab_size=50), build_val_source(data, seed=3, vocab_size=50)
    assert not np.array_equal(train.sample(0), val.sample(0))
