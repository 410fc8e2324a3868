"""parallel.dp_mode auto from the job config: the device the planner is told, and what it plans."""

from __future__ import annotations

import pytest

from parallel.layout import Layout
from workers.config import ConfigError, JobConfig, job_constraints, job_device_type, job_plan

SPEC = {"model": {"preset": "tiny"}, "data": {"source": "synthetic", "seq_len": 32},
        "train": {"global_batch_size": 8, "micro_batch_size": 2}}


def _cfg(parallel=None, resources=None) -> JobConfig:
    return JobConfig.from_dict({**SPEC, "parallel": parallel or {}, "resources": resources or {}})


def test_auto_is_the_default_and_replicates_on_cpu():
    cfg = _cfg()
    assert cfg.parallel.dp_mode == "auto" and job_device_type(cfg) == "cpu"
    assert job_plan(cfg, 2).layout == Layout(dp_replicate=2)
    assert job_plan(cfg, 2, device_type="cuda").layout == Layout(dp_shard=2)  # torchrun on a GPU
    assert job_plan(_cfg({"dp_mode": "shard"}), 2).layout == Layout(dp_shard=2)
    assert job_plan(cfg, 2, layout="dp=2").layout == Layout(dp_shard=2)  # a written layout means shard


@pytest.mark.parametrize("resources,device", [
    ({"device": "cpu"}, "cpu"), ({"device": "auto"}, "cpu"), ({"device": "cuda"}, "cuda"),
    ({"device": "auto", "gpus_per_worker": 1}, "cuda"),
])
def test_device_type_from_resources(resources, device):
    cfg = _cfg(resources=resources)
    assert job_device_type(cfg) == device
    assert job_constraints(cfg).device_type == device


def test_a_budget_that_holds_the_replicas_replicates_on_gpus_too():
    cfg = _cfg({"memory_budget_gb": 64.0}, {"device": "cuda"})
    assert job_plan(cfg, 2).layout == Layout(dp_replicate=2)


def test_bad_dp_mode_is_refused():
    with pytest.raises(ConfigError, match="dp_mode"):
        _cfg({"dp_mode": "mirror"})
