"""One job as its coordinator runs it: the parsed config and what the request added, built once where
the job enters (the REST submit, `elastron run`, the demo) and passed whole from there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    id: str
    cfg: JobConfig
    run_dir: Path
    total_steps: int
    """The run's length in optimizer steps (the request's, else train.steps)."""
    min_workers: int
    max_workers: int | None
    layout: str | None = None
    """A layout the request forces (`elastron run --layout`), on top of cfg.parallel.layout."""

    @classmethod
    def of(cls, cfg: JobConfig, *, job_id: str, run_dir: str | Path, steps: int | None = None,
           workers: int | None = None, layout: str | None = None) -> Job:
        lo, hi = worker_range(cfg, workers, layout=layout)
        return cls(id=job_id, cfg=cfg, run_dir=Path(run_dir), total_steps=steps or cfg.train.steps,
                   min_workers=lo, max_workers=hi, layout=layout)
