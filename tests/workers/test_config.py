"""Tier 1: the job config rejects bad input with a message naming the field."""

from pathlib import Path

import pytest

from parallel.layout import Layout
from parallel.planner import PlanError
from workers.config import ConfigError, JobConfig, job_constraints, job_plan, load_config
from workers.disk_checks import check_data_path
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
    ({"data": {"source": "sql"}}, "data.source: expected one of"),
    ({"parallel": {"min_workers": 3, "max_workers": 2}}, "min_workers=3 is greater"),
    ({"parallel": {"layout": "dp=2,qq=1"}}, "parallel.layout: unknown layout key"),
    ({"parallel": {"layout": "tp=3"}}, "parallel.layout 'tp=3': tp=3 does not divide the model's n_heads=4"),
    ({"parallel": {"layout": "dp=3"}}, "parallel.layout 'dp=3': dp=3 does not divide train.global_batch_size=16"),
    ({"parallel": {"layout": "dp=8,pp=4"}}, "pp=4 needs >= 4 microbatches per step but dp=8 leaves 2 samples"),
    ({"model": {"preset": "70b"}}, "unknown model preset '70b'"),
    ({"model": {"overrides": {"n_heads": 3}}}, "divisible"),
    ({"train": {"global_batch_size": 10, "micro_batch_size": 4}}, "multiple of"),
    ({"checkpoint": {"async_save": "yes"}}, "checkpoint.async_save: expected true or false"),
    ({"train": {"float8": "fp8"}}, r"train.float8: expected one of \['none', 'tensorwise', 'rowwise'\], got 'fp8'"),
    ([1, 2], "expected a mapping"),
])
def test_bad_configs_name_the_field(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        JobConfig.from_dict(bad)


def test_a_missing_data_path_names_the_field_where_it_is_checked_not_when_parsed():
    bad = {"data": {"source": "tokens", "path": "/nonexistent/file.bin"}}
    cfg = JobConfig.from_dict(bad)  # parsing touches no disk: the config travels to nodes without the path
    with pytest.raises(ConfigError, match="does not exist"):
        check_data_path(cfg.data)


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


def test_job_constraints_carry_the_config_and_a_forced_layout_fixes_tp_and_pp():
    cfg = JobConfig.from_dict({"data": {"source": "synthetic", "seq_len": 32},
                               "train": {"global_batch_size": 12, "micro_batch_size": 3},
                               "parallel": {"tp": 2, "max_pp": 2, "gpus_per_node": 4, "memory_budget_gb": 1.5,
                                            "min_workers": 2, "max_workers": 6, "dp_mode": "replicate"}})
    c = job_constraints(cfg)
    assert (c.global_batch_size, c.micro_batch_size, c.seq_len, c.dp_mode) == (12, 3, 32, "replicate")
    assert (c.layout, c.tp, c.pp, c.max_pp, c.gpus_per_node) == (None, 2, None, 2, 4)
    assert (c.memory_budget_bytes, c.min_workers, c.max_workers) == (1.5 * 2**30, 2, 6)
    forced = job_constraints(cfg, layout="dp=2,tp=2", max_workers=9)
    assert forced.layout == Layout(dp_replicate=2, tp=2) and forced.tp is None and forced.max_workers == 9
    assert job_constraints(cfg, layout=Layout(pp=2)).layout == Layout(pp=2)


def test_job_plan_is_the_plan_for_exactly_the_ranks_given():
    cfg = JobConfig.from_dict({"data": {"source": "synthetic", "seq_len": 16},
                               "train": {"global_batch_size": 8, "micro_batch_size": 4}})
    p = job_plan(cfg, 4)
    assert p.world_size == 4 and (p.layout.dp, p.micro_batch_size, p.grad_accum_steps) == (4, 2, 1)
    assert job_plan(cfg, 2, layout="pp=2").layout == Layout(pp=2)
    with pytest.raises(ValueError, match=r"needs 4 ranks .* but there are 2"):
        job_plan(cfg, 2, layout="dp=2,tp=2")
    with pytest.raises(PlanError, match=r"^layout dp=3,tp=1,pp=1: dp=3 does not divide train.global_batch_size=8"):
        job_plan(cfg, 3, layout="dp=3")
    with pytest.raises(ValueError, match=r"cannot use all 7 ranks: .*using 4 of 7 workers offered.*; pass --layout"):
        job_plan(JobConfig.from_dict({**cfg.to_dict(), "parallel": {"max_tp": 1, "max_pp": 1}}), 7)


def test_float8_recipe_is_read_and_defaults_to_none():
    assert JobConfig.from_dict({}).train.float8 == "none"
    assert JobConfig.from_dict({"train": {"float8": "rowwise"}}).train.float8 == "rowwise"
    from workers.config import TrainConfig

    with pytest.raises(ConfigError, match=r"train.float8: expected one of \['none', 'tensorwise', 'rowwise'\], got 'int8'"):
        TrainConfig(float8="int8")  # built in Python, judged as a parsed spec is


def test_seq_len_defaults_to_the_models_context_capped_at_128():
    short = JobConfig.from_dict({"model": {"overrides": {"max_seq_len": 64}}})
    assert short.data.seq_len == 64
    assert JobConfig.from_dict({}).model.build().max_seq_len > 128 and JobConfig.from_dict({}).data.seq_len == 128
    windowed = JobConfig.from_dict({"model": {"overrides": {"sliding_window": 48}}})
    assert windowed.data.seq_len == 48
    assert JobConfig.from_dict({"model": {"overrides": {"max_seq_len": 64}}, "data": {"seq_len": 32}}).data.seq_len == 32
    assert JobConfig.from_dict({"data": {"seq_len": None}}).data.seq_len == 128
    assert job_constraints(short).seq_len == 64


def test_a_seq_len_beyond_the_model_is_refused_in_one_line_naming_both():
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict({"model": {"overrides": {"max_seq_len": 64}}, "data": {"seq_len": 65}})
    assert str(e.value).startswith("data.seq_len=65 exceeds model max_seq_len=64: set data.seq_len <= 64")
    assert "\n" not in str(e.value) and e.value.loc == ("data", "seq_len")


def test_a_defaulted_seq_len_survives_json_and_keeps_the_checkpoint_digest():
    import dataclasses
    import json

    from workers.config import with_steps

    short = JobConfig.from_dict({"model": {"overrides": {"max_seq_len": 64}}})
    back = JobConfig.from_dict(json.loads(json.dumps(short.to_dict())))
    assert back == short and back.data.seq_len == 64 and back.digest() == short.digest()
    assert with_steps(short, 5).data.seq_len == 64
    assert dataclasses.replace(short, name="other").data.seq_len == 64
    # A checkpoint written when 128 was the fixed default resumes with the same config digest.
    assert JobConfig.from_dict({}).digest() == JobConfig.from_dict({"data": {"seq_len": 128}}).digest()
