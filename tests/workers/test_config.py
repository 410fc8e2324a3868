"""Tier 1: the job config rejects bad input with a message naming the field."""

from pathlib import Path

import pytest

from workers.config import ConfigError, JobConfig, load_config
from workers.lr import lr_at

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_loads():
    cfg = load_config(ROOT / "examples" / "tiny.yaml")
    assert cfg.model.build().num_params() < 2_000_000
    assert cfg.data.source == "corpus"


@pytest.mark.parametrize("bad,needle", [
    ({"train": {"steps": "ten"}}, "train.steps: expected an integer"),
    ({"train": {"steps": 0}}, "train.steps must be > 0"),
    ({"trainn": {}}, "unknown field 'trainn'"),
    ({"data": {"seq_len": 4096}}, "data.seq_len=4096 exceeds model max_seq_len"),
    ({"data": {"source": "tokens", "path": "/nonexistent/file.bin"}}, "does not exist"),
    ({"data": {"source": "sql"}}, "data.source: expected one of"),
    ({"parallel": {"min_workers": 3, "max_workers": 2}}, "min_workers=3 is greater"),
    ({"parallel": {"layout": "dp=2,qq=1"}}, "parallel.layout: unknown layout key"),
    ({"model": {"preset": "70b"}}, "unknown model preset '70b'"),
    ({"model": {"overrides": {"n_heads": 3}}}, "divisible"),
    ({"train": {"global_batch_size": 10, "micro_batch_size": 4}}, "multiple of"),
    ({"checkpoint": {"async_save": "yes"}}, "checkpoint.async_save: expected true or false"),
    ([1, 2], "expected a mapping"),
])
def test_bad_configs_name_the_field(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        JobConfig.from_dict(bad)


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_digest_changes_with_content():
    a = JobConfig.from_dict({"train": {"lr": 1e-3}})
    b = JobConfig.from_dict({"train": {"lr": 2e-3}})
    assert a.digest() != b.digest() and a.digest() == JobConfig.from_dict({"train": {"lr": 1e-3}}).digest()


def test_lr_schedule_is_a_function_of_the_step_alone():
    t = JobConfig.from_dict({"train": {"steps": 100, "lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1}}).train
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.55)  # half way down the cosine: (1 + 0.1) / 2
    assert lr_at(100, t) == pytest.approx(0.1) and lr_at(500, t) == pytest.approx(0.1)
    decaying = [lr_at(s, t) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(decaying, decaying[1:]))
    longer = JobConfig.from_dict({"train": {"steps": 100, "decay_steps": 200, "lr": 1.0, "warmup_steps": 10}}).train
    assert lr_at(100, longer) > lr_at(100, t)
