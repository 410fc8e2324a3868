"""Job requests checked before anything runs: the spec (workers.config's one schema: types, bounds and the
rules between fields), a layout that can fit, and its strings. Where a request may read and write is service.server.admission's
to judge. Errors are SpecError with the request field they concern, so the API can name it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from parallel.layout import Layout
from parallel.planner import plan
from workers.config import LOCATION, MAX_GLOBAL_BATCH, MAX_STEPS, MAX_WORKERS, JobConfig, job_constraints, with_steps
from workers.preflight import preflight

__all__ = ["JobConfig", "LOCATION", "MAX_GLOBAL_BATCH", "MAX_STEPS", "MAX_WORKERS", "SpecError", "check_plannable", "check_text",
           "safe_name", "validate_spec"]


class SpecError(ValueError):
    """A job request that cannot run. `loc` is the field path in the request body, e.g.
    ("spec", "train", "steps") or ("run_dir",)."""

    def __init__(self, loc: Iterable[str | int], msg: str):
        super().__init__(msg)
        self.loc, self.msg = tuple(loc), msg


# -- the spec ------------------------------------------------------------------------------------------------

def validate_spec(spec: Any, *, steps: int | None = None, workers: int | None = None) -> JobConfig:
    """The JobConfig of `spec`, parsed once here for the whole job, or SpecError naming the field: the
    spec's schema (JobConfig.from_dict: types, bounds, rules between fields), plus what would only fail
    once the job runs: a readable data path and a layout that fits the model on the allowed worker counts
    (e.g. a tp that does not divide the heads)."""
    try:
        cfg = JobConfig.from_dict(spec)
    except ValueError as e:  # ConfigError, or a ValueError from a check deeper down (e.g. a NUL in a path)
        raise SpecError(("spec", *getattr(e, "loc", ())), str(e)) from None
    for name, v in (("steps", steps), ("workers", workers)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise SpecError((name,), f"{name} must be an integer >= 1, got {v!r}")
    try:  # the model's files and the data's headers: the server's workers usually share its filesystem
        cfg = preflight(with_steps(cfg, steps)).cfg
    except ValueError as e:
        raise SpecError(("spec", *getattr(e, "loc", ())), str(e)) from None
    except OSError as e:  # data.path that cannot even be looked at (name too long, ...)
        raise SpecError(("spec", "data", "path"), f"data.path cannot be checked: {e.strerror or e}") from None
    d = cfg.data
    if d.path is not None and d.source != "synthetic":
        p = Path(d.path).expanduser()
        if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
            raise SpecError(("spec", "data", "path"), f"data.path {d.path!r} is not readable by the server")
    _check_layout(cfg, workers)
    return cfg


def _check_layout(cfg: JobConfig, workers: int | None) -> None:
    """The server's bound on the worker count, then `check_plannable`, as SpecErrors naming the field."""
    pc = cfg.parallel
    if pc.layout:
        loc = ("spec", "parallel", "layout")
    else:
        loc = ("spec", "parallel") + (("tp",) if pc.tp else ("pp",) if pc.pp else ("max_workers",))
    if (hi := _most_workers(cfg, workers)) > MAX_WORKERS:
        raise SpecError(loc, f"{hi} workers is more than this server accepts (at most {MAX_WORKERS})")
    try:
        check_plannable(cfg, workers)
    except ValueError as e:
        raise SpecError(loc, str(e)) from None


def check_plannable(cfg: JobConfig, workers: int | None = None) -> None:
    """ValueError (one line) unless the planner finds a layout for the job on the most workers it may run
    on: a tp that does not divide the heads, a forced layout that does not fit the model or batch, a
    range with no usable size. Judged where a job enters (the REST API's validate_spec, `elastron run`),
    before anything starts: the coordinator cannot tell such a job from one short of capacity, and would
    wait for capacity that never helps. The planner's work is bounded by the worker count, the batch
    and the layer count, which the spec's bounds (workers.config) keep small."""
    pc, hi = cfg.parallel, _most_workers(cfg, workers)
    try:
        plan(hi, cfg.model.build(), job_constraints(cfg, min_workers=min(pc.min_workers, hi), max_workers=hi))
    except ValueError as e:  # PlanError, or Constraints that contradict themselves (e.g. tp > max_tp)
        raise ValueError(f"no parallel layout can run this job: {e}") from None


def _most_workers(cfg: JobConfig, workers: int | None) -> int:
    """A forced layout's world size, else `workers` (a request's cap) or parallel.max_workers."""
    pc = cfg.parallel
    return Layout.parse(pc.layout, dp_mode=pc.dp_mode).world_size if pc.layout else workers or pc.max_workers


# -- text ----------------------------------------------------------------------------------------------------

def _field(loc: Sequence[str | int]) -> str:
    return ".".join(str(x) for x in loc if x != "spec")


def check_text(request: Any, loc: tuple[str | int, ...] = ()) -> None:
    """SpecError naming the field for a string that is not text: a lone surrogate (JSON's "\\ud800"
    escapes allow one) cannot be written as UTF-8 to the store, a run directory's name or a log."""
    if isinstance(request, str):
        try:
            request.encode("utf-8")
        except UnicodeEncodeError:
            raise SpecError(loc, f"{_field(loc) or 'the request'} is not valid text (it holds a lone UTF-16 "
                                 "surrogate); send UTF-8 text") from None
    elif isinstance(request, dict):
        for k, v in request.items():
            check_text(k, loc)
            check_text(v, (*loc, k) if isinstance(k, str) else loc)
    elif isinstance(request, list):
        for i, v in enumerate(request):
            check_text(v, (*loc, i))


def safe_name(name: str) -> str:
    """`name` usable as one directory name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".")[:64] or "job"
