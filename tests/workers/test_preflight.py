"""workers.preflight: a job's data and model mistakes are one ConfigError before any worker starts,
from meta.json and file sizes only; a held-out split smaller than one eval batch is a warning."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workers.config import ConfigError, JobConfig
from workers.preflight import preflight

transformers = pytest.importorskip("transformers")


@pytest.fixture
def prepared(tmp_path):
    """A tiny Llama with a tokenizer.json of its own, and token files whose meta.json names a tokenizer."""
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
        intermediate_size=48, max_position_embeddings=64)).save_pretrained(hf)
    (hf / "tokenizer.json").write_text('{"model": "mine"}')
    data = tmp_path / "data"
    data.mkdir()
    np.arange(2000, dtype=np.uint16).__mod__(96).astype(np.uint16).tofile(data / "train.bin")
    np.arange(100, dtype=np.uint16).tofile(data / "val.bin")  # 6 samples of 17
    import hashlib

    meta = {"format": "elastron-tokens", "dtype": "uint16", "vocab_size": 96, "eos_id": 0,
            "tokenizer": str(hf / "tokenizer.json"),
            "tokenizer_sha256": hashlib.sha256((hf / "tokenizer.json").read_bytes()).hexdigest()}
    (data / "meta.json").write_text(json.dumps(meta))
    return hf, data


def job(hf, data_dir, *, data=None, train=None) -> JobConfig:
    d = {"model": {"init_from": str(hf)},
         "data": {"source": "tokens", "path": str(data_dir / "train.bin"), "seq_len": 16, **(data or {})},
         "train": {"global_batch_size": 4, "micro_batch_size": 1, "eval_interval": 10, **(train or {})}}
    return JobConfig.from_dict(d)


def test_a_good_job_passes_with_its_shape_resolved(prepared):
    hf, data = prepared
    ok = preflight(job(hf, data))
    assert ok.cfg.model.build().vocab_size == 96 and ok.warnings == ()


def test_a_wrong_token_dtype_is_one_line(prepared):
    hf, data = prepared
    with pytest.raises(ConfigError, match="set data.token_dtype: uint16"):
        preflight(job(hf, data, data={"token_dtype": "uint32"}))


def test_an_empty_validation_split_is_refused(prepared):
    hf, data = prepared
    (data / "val.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data: token file .*val.bin' has 0 tokens; need at least seq_len \+ 1"):
        preflight(job(hf, data))


def test_another_tokenizer_is_refused_unless_allowed(prepared):
    hf, data = prepared
    (hf / "tokenizer.json").write_text('{"model": "another, same vocabulary size"}')
    with pytest.raises(ConfigError, match=r"tokenised with another tokenizer .* prepare the data again with "
                                          r"--tokenizer .* or set data.allow_tokenizer_mismatch: true"):
        preflight(job(hf, data))
    assert preflight(job(hf, data, data={"allow_tokenizer_mismatch": True})).cfg is not None


def test_a_validation_split_smaller_than_one_eval_batch_is_a_warning_with_the_numbers(prepared):
    hf, data = prepared
    w = preflight(job(hf, data, train={"global_batch_size": 8})).warnings
    assert len(w) == 1 and "holds 6 sample(s) of seq_len + 1 = 17 tokens, fewer than one eval batch of " \
                           "train.global_batch_size=8" in w[0], w


def test_a_sliding_window_shorter_than_seq_len_fails_here_too(tmp_path):
    from tests.hf_families import make_hf

    make_hf("mistral", tmp_path / "m")
    with pytest.raises(ConfigError, match="longer than the model's sliding_window=32"):
        preflight(JobConfig.from_dict({"model": {"init_from": str(tmp_path / "m")},
                                       "data": {"source": "synthetic", "seq_len": 48}}))


def test_elastron_trains_rank_entry_refuses_in_one_line_before_joining(prepared, tmp_path):
    """`elastron train` starts `workers.train` ranks; each runs preflight before any process group."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    hf, data = prepared
    root = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"init_from": str(hf)},
                                   "data": {"source": "tokens", "path": str(data / "train.bin"), "seq_len": 16,
                                            "token_dtype": "uint32"},
                                   "train": {"global_batch_size": 4, "micro_batch_size": 1}}))
    r = subprocess.run([sys.executable, "-m", "workers.train", str(cfg), "--run-dir", str(tmp_path / "run")],
                       cwd=root, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: data: data.token_dtype is uint32 but {data / 'train.bin'} holds "
                                             "uint16 ids (meta.json); set data.token_dtype: uint16"]


def test_elastron_run_and_the_rest_submit_refuse_a_data_mistake_before_anything_starts(prepared, tmp_path,
                                                                                         capsys, monkeypatch):
    """Issue 31 item 3: `elastron run` (and so `ray job submit`) and the REST submit run the same checks
    as `elastron train`: a wrong token_dtype is one line at once, and no Ray is started for it."""
    import yaml

    import api.run
    from api.cli import main
    from service.server.specs import SpecError, validate_spec

    hf, data = prepared
    spec = {"model": {"init_from": str(hf)}, "train": {"global_batch_size": 4, "micro_batch_size": 1},
            "data": {"source": "tokens", "path": str(data / "train.bin"), "seq_len": 16, "token_dtype": "uint32"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(api.run, "connect_ray", lambda *a, **k: pytest.fail("Ray was started"))
    assert main(["run", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "set data.token_dtype: uint16" in err[0]
    with pytest.raises(SpecError) as e:
        validate_spec(spec)
    assert e.value.loc[:2] == ("spec", "data") and "token_dtype" in e.value.msg
