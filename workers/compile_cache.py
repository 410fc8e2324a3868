"""Where a job's compiled graphs are kept, so a restarted rank or a new worker does not recompile them.

torch.compile's inductor caches (the FX graph cache, the AOT autograd cache, generated kernels; Triton's
on GPUs) are keyed by the graph and the software, not by the process: every worker of a job on one node
shares one node-local directory, and a rank that starts again finds the graphs its predecessor (or a
peer of the same layout) compiled. The directory is per job, so jobs do not evict or read each other's
entries: keyed by the job's name and its run directory (`job_cache_key`), which the service gives one owner,
so two users' jobs of the same name never share a cache; node-local because the caches are many small files.

    key = job_cache_key(cfg.name, run_dir)
    env = compile_cache_env(key)           # for a worker's environment, before it compiles anything
    apply_compile_cache(key)               # or in the worker's own process
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT_ENV = "ELASTRON_COMPILE_CACHE"
"""Overrides the node-local root (default: <tmp>/elastron-compile-cache)."""


def job_cache_key(job_name: str, run_dir: str | os.PathLike[str] | None) -> str:
    """The cache key of a job: its name, and a digest of its run directory's absolute path where it has one
    (the same job restarted in its run directory finds its graphs again; another job of the same name, in
    another run directory, gets a directory of its own)."""
    if run_dir is None:
        return job_name
    where = os.path.abspath(os.fspath(run_dir))
    return f"{job_name}-{hashlib.sha256(where.encode()).hexdigest()[:16]}"


def cache_dir(job_name: str, root: str | os.PathLike[str] | None = None) -> Path:
    """The node-local compile cache directory of job `job_name`."""
    base = Path(root or os.environ.get(ROOT_ENV) or Path(tempfile.gettempdir()) / "elastron-compile-cache")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_name).strip(".") or "job"
    return base / safe


def compile_cache_env(job_name: str, root: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Environment variables that point inductor's and Triton's caches at the job's directory and turn
    on the caches that reuse a whole compiled graph (FX graph and AOT autograd)."""
    d = cache_dir(job_name, root)
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"),
        "TRITON_CACHE_DIR": str(d / "triton"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }


def apply_compile_cache(job_name: str, root: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Set `compile_cache_env` in this process (before its first compile), leaving any of its variables
    the environment already sets (an operator's choice wins), and create the directories; returns the
    values in effect. Inductor reads the cache directory when it compiles, and the two switches also go
    to its config in case it was imported already."""
    for k, v in compile_cache_env(job_name, root).items():
        os.environ.setdefault(k, v)
    env = {k: os.environ[k] for k in compile_cache_env(job_name, root)}
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        Path(env[k]).mkdir(parents=True, exist_ok=True)
    for module, name in (("torch._inductor.config", "fx_graph_cache"),
                         ("torch._functorch.config", "enable_autograd_cache")):
        config = sys.modules.get(module)
        if config is not None and hasattr(config, name):
            setattr(config, name, True)
    return env
