"""What a job may run on, from its config and what its request added: one rule for the coordinator and
the scheduler alike."""

from __future__ import annotations

from workers.config import JobConfig, job_constraints


def worker_range(cfg: JobConfig, workers: int | None = None, *, layout: str | None = None) -> tuple[int, int]:
    """(min, max) workers a job may run on: parallel.min/max_workers; `workers` (a request's or `elastron
    run --workers`) caps them; a forced layout (config, or `layout`) fixes both to its world size."""
    lo, hi = cfg.parallel.min_workers, cfg.parallel.max_workers
    if workers is not None:
        lo, hi = min(lo, workers), workers
    forced = job_constraints(cfg, layout=layout).layout
    if forced is not None:
        lo = hi = forced.world_size
    return lo, hi
