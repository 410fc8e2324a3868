"""A module-scoped local Ray for tests that need real actors but no cluster: import `local_ray` into a
test module to use it (`from tests.ray_local import local_ray`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def local_ray():
    """2 CPUs, no dashboard; workers find this checkout's packages on PYTHONPATH."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    yield
    ray.shutdown()
