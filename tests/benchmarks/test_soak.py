"""benchmarks/soak.py's measuring parts: what a worker reports of its own memory (`Worker.memory`, which the
soak asks every worker for), the CUDA columns taken from it, and the verdicts over literal samples. The soak
itself (a Ray cluster, 100 reconfigurations) is the benchmark's run, not a test."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

from benchmarks.soak import CUDA_TARGET, cuda_columns, cuda_verdict, lifetimes, passed
from tests.multiproc import run_ranks
from workers.report import Memory

CFG = {"model": {"preset": "tiny"}, "data": {"source": "synthetic", "seq_len": 16},
       "train": {"steps": 10, "global_batch_size": 2, "micro_batch_size": 2, "seed": 3},
       "checkpoint": {"interval_steps": 100}}


def body(run_dir: str) -> dict:
    from parallel.layout import Layout
    from parallel.planner import Plan
    from workers.actor import Worker
    from workers.config import JobConfig

    plan = Plan(layout=Layout(), world_size=1, available=1, micro_batch_size=2, grad_accum_steps=1,
                memory_bytes=0.0, reasons=())
    w = Worker(JobConfig.from_dict(CFG), run_dir)
    out = {"pid": os.getpid(), "idle": asdict(w.memory())}
    w.join(rank=0, world_size=1, master_addr="127.0.0.1", master_port=w.open_store(), plan=plan)
    w.run(until_step=10, steps=1)
    out["training"] = asdict(w.memory())
    w.leave()
    return out


@pytest.mark.dist
def test_a_worker_reports_its_own_process_and_device_memory(tmp_path):
    (got,) = run_ranks(1, body, str(tmp_path))
    idle, training = got["idle"], got["training"]
    assert idle["pid"] == training["pid"] == got["pid"]
    assert idle["device"] == "none" and training["device"] == "cpu"
    assert training["rss_mb"] > idle["rss_mb"] > 0  # the model and its optimizer state are resident now
    assert training["cuda_allocated_mb"] is None and training["cuda_reserved_mb"] is None  # a CPU worker


def _mem(pid, reserved=None, allocated=None, device="cpu"):
    return Memory(pid=pid, rss_mb=100.0, device=device, cuda_allocated_mb=allocated, cuda_reserved_mb=reserved)


def test_the_cuda_columns_hold_only_the_workers_on_cuda_among_the_sampled_processes():
    procs = {"worker-1": 1, "worker-2": 2, "standby-3": 3, "coordinator-4": 4}
    memory = {1: _mem(1, 2048.0, 1500.0, "cuda:0"), 2: _mem(2), 3: _mem(3, 0.0, 0.0, "cuda:0"),
              9: _mem(9, 512.0, 256.0, "cuda:0")}  # pid 9: not one of this job's processes
    assert cuda_columns(procs, memory) == {"cuda_allocated_mb": {"worker-1": 1500.0, "standby-3": 0.0},
                                           "cuda_reserved_mb": {"worker-1": 2048.0, "standby-3": 0.0}}
    assert cuda_columns(procs, {2: _mem(2)}) == {"cuda_allocated_mb": {}, "cuda_reserved_mb": {}}


def _sample(reconfigs, reserved, rss=1000.0):
    return {"reconfigs": reconfigs, "world_size": 2, "rss_mb": {"worker-1": rss},
            "cuda_reserved_mb": {"worker-1": reserved} if reserved is not None else {}}


@pytest.mark.parametrize("reserved, ratio, ok", [
    ((4000, 4100, 4200, 4400, 4400, 4400), 1.0, True),       # grows while it loads, then flat from the 3rd
    ((4000, 4100, 4200, 4400, 4500, 4650), 1.057, False),    # +5.7% after the 3rd: over CUDA_TARGET
    ((4000, 4100, 4200, 4400, 4500, 4600), 1.045, True),     # +4.5%: within it
])
def test_cuda_reserved_memory_is_judged_from_each_workers_third_reconfiguration(reserved, ratio, ok):
    samples = [_sample(i, r) for i, r in enumerate(reserved)]
    lives, worst = cuda_verdict(samples)
    assert lives["worker-1"]["base_reconfigs"] == 3 and lives["worker-1"]["base_mb"] == reserved[3]
    assert worst == ratio
    assert (worst <= CUDA_TARGET) is ok
    out = {"error": None, "max_ratio_per_process": 1.0, "max_cuda_reserved_ratio": worst}
    assert passed(out) is ok


def test_a_cpu_soak_has_no_cuda_verdict_and_is_judged_by_its_rss_alone():
    samples = [_sample(i, None, rss) for i, rss in enumerate((900, 950, 1000, 1000, 1050, 1120))]
    assert cuda_verdict(samples) == ({}, None)
    assert lifetimes(samples)["worker-1"]["ratio"] == 1.12
    assert not passed({"error": None, "max_ratio_per_process": 1.12, "max_cuda_reserved_ratio": None})
    assert passed({"error": None, "max_ratio_per_process": 1.08, "max_cuda_reserved_ratio": None})
