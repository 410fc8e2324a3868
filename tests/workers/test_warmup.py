"""Tier 1: a standby worker's warm-up and the job's compile cache directory."""

from __future__ import annotations

import os

import torch.distributed as dist

from workers.compile_cache import apply_compile_cache, cache_dir, compile_cache_env, job_cache_key
from workers.warmup import PHASES, warm_up


def test_warm_up_runs_a_step_and_leaves_no_process_group(tmp_path, monkeypatch):
    for k in compile_cache_env("j"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ELASTRON_COMPILE_CACHE", str(tmp_path))
    took = warm_up("cpu", cache_key="job one")
    assert took.first_step_s > 0 and took.import_s > 0 and tuple(took.to_dict()) == PHASES
    assert not dist.is_initialized()  # the worker can join its real group next
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "job_one" / "inductor")
    assert (tmp_path / "job_one" / "inductor").is_dir()


def test_the_cache_is_per_job_and_node_local_and_an_operators_choice_wins(tmp_path, monkeypatch):
    for k in compile_cache_env("j"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("ELASTRON_COMPILE_CACHE", raising=False)
    assert cache_dir("a/b") != cache_dir("a_c") and cache_dir("..").name == "job"
    env = compile_cache_env("run-1", root=tmp_path)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "run-1" / "inductor")
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    got = apply_compile_cache("run-1", root=tmp_path)
    assert got["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert got["TRITON_CACHE_DIR"] == str(tmp_path / "run-1" / "triton")


def test_two_jobs_of_one_name_in_other_run_directories_get_caches_of_their_own(tmp_path, monkeypatch):
    """Two users may name their jobs alike; their run directories differ (the service gives each one owner),
    and so do their caches. The same run directory, however spelt, is the same cache."""
    monkeypatch.chdir(tmp_path)
    alice, bob = job_cache_key("train", tmp_path / "alice" / "run"), job_cache_key("train", tmp_path / "bob" / "run")
    assert alice != bob and cache_dir(alice) != cache_dir(bob)
    assert alice.startswith("train-") and job_cache_key("train", "alice/run") == alice
    assert job_cache_key("train", None) == "train"
