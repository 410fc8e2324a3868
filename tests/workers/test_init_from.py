"""model.init_from: the spec parse never touches the directory; its edges read config.json once, and a bad
directory is one line (ConfigError, a 4xx SpecError naming model.init_from, a non-zero exit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.config import ConfigError, JobConfig, job_constraints
from workers.disk_checks import resolve_init_from

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]

HF = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
          intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    import torch

    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).float().save_pretrained(path)
    return path


def spec(path, **model) -> dict:
    return {"model": {"init_from": str(path), **model}, "data": {"source": "synthetic", "seq_len": 16},
            "train": {"global_batch_size": 4, "micro_batch_size": 2}}


def test_the_parse_touches_no_disk_and_the_model_waits_to_be_read():
    cfg = JobConfig.from_dict(spec("/nowhere/at/all"))  # no such directory: fine until an edge reads it
    assert not cfg.model.is_resolved
    with pytest.raises(ConfigError, match="has not been read"):
        cfg.model.build()


def test_resolve_reads_the_shape_from_config_json(hf_dir):
    cfg = resolve_init_from(JobConfig.from_dict(spec(hf_dir)))
    mc = cfg.model.build()
    assert (mc.dim, mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.vocab_size, mc.ffn_hidden, mc.max_seq_len) == \
        (32, 2, 4, 2, 96, 48, 64)
    assert JobConfig.from_dict(cfg.to_dict()) == cfg  # travels whole: workers need not read config.json
    longer = resolve_init_from(JobConfig.from_dict(spec(hf_dir, overrides={"max_seq_len": 128})))
    assert longer.model.build().max_seq_len == 128
    plain = JobConfig.from_dict({"data": {"source": "synthetic"}})
    assert resolve_init_from(plain) is plain


def test_overrides_that_change_the_shape_are_refused():
    with pytest.raises(ConfigError, match=r"model.overrides \['dim'\] cannot change"):
        JobConfig.from_dict(spec("/x", overrides={"dim": 64}))
    with pytest.raises(ConfigError, match="set init_from instead"):
        JobConfig.from_dict({"model": {"resolved": {"dim": 8, "n_layers": 1, "n_heads": 1, "n_kv_heads": 1,
                                                    "vocab_size": 8, "ffn_hidden": 8}}})


def test_job_checks_run_on_the_resolved_shape(hf_dir):
    s = spec(hf_dir)
    s["data"]["seq_len"] = 65
    cfg = JobConfig.from_dict(s)  # max_seq_len unknown yet
    with pytest.raises(ConfigError, match="exceeds model max_seq_len=64"):
        resolve_init_from(cfg)


def _broken(hf_dir: Path, tmp_path: Path, how: str) -> Path:
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(hf_dir, d)
    if how == "missing":
        return tmp_path / "nope"
    if how == "weights":
        (d / "model.safetensors").unlink()
    if how == "shape":
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "intermediate_size": 40}))
    return d


@pytest.mark.parametrize("how,needle", [("missing", "config.json does not exist"),
                                        ("weights", "has no *.safetensors"), ("shape", "config.json implies")])
def test_a_bad_directory_is_one_line_at_every_edge(hf_dir, tmp_path, how, needle):
    from service.server.specs import SpecError, validate_spec

    d = _broken(hf_dir, tmp_path, how)
    with pytest.raises(ConfigError, match="model.init_from") as e:
        resolve_init_from(JobConfig.from_dict(spec(d)))
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecError) as e:
        validate_spec(spec(d))
    assert e.value.loc == ("spec", "model", "init_from") and needle in e.value.msg
    if how != "shape":
        return  # one process start is enough to show the trainer's edge
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps(spec(d)))
    r = subprocess.run([sys.executable, "-m", "workers.train", str(cfg), "--run-dir", str(tmp_path / "run")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.init_from") and needle in lines[0], r.stderr


def test_the_server_refuses_an_init_from_outside_its_data_roots(tmp_path):
    from service.server.admission import check_paths
    from service.server.specs import SpecError

    with pytest.raises(SpecError) as e:
        check_paths(spec("/etc"), run_dir=None, runs_root=tmp_path / "runs", data_roots=[tmp_path / "data"])
    assert e.value.loc == ("spec", "model", "init_from") and "outside the server's data roots" in e.value.msg


def test_seq_len_defaults_from_config_json_once_it_is_read(hf_dir):
    s = spec(hf_dir)
    del s["data"]["seq_len"]
    cfg = JobConfig.from_dict(s)
    assert cfg.data.seq_len is None  # the model's context is not known yet
    with pytest.raises(ConfigError, match="has not been read, so data.seq_len's default is unknown"):
        job_constraints(cfg)
    resolved = resolve_init_from(cfg)
    assert resolved.data.seq_len == 64  # config.json's max_position_embeddings
    assert JobConfig.from_dict(resolved.to_dict()) == resolved
    assert resolve_init_from(resolved).data.seq_len == 64  # a rank resolving again finds the same
    from service.server.specs import validate_spec
    assert validate_spec(s).data.seq_len == 64  # the REST submit's edge resolves it the same way
    s["model"]["overrides"] = {"max_seq_len": 256}
    assert resolve_init_from(JobConfig.from_dict(s)).data.seq_len == 128
