"""One job driver, for every way a job is started: the REST API's job actor (service.server.job_actor), `elastron
run` (api.run) and `elastron demo` (api.demo) all run a `JobRunner`: a Coordinator in a background
thread, with thread-safe status, events, metrics and commands.

The CLI's edge checks live here too, so that api/ needs nothing below service/: `load_job` parses a job
YAML once and makes the checks `elastron run` makes before Ray starts; `check_local_job` those of
`elastron train` before any rank starts.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from service.control.commands import Command
from service.control.coordinator import Coordinator, CoordinatorOptions
from service.control.events import Cause, EventKind
from service.control.job import Job
from service.server.specs import check_plannable
from service.control.status import JobStatus
from workers.config import JobConfig, job_plan, load_config, with_steps
from workers.preflight import preflight
from workers.run_dir import check_run_dir

logger = logging.getLogger(__name__)

CoordinatorFactory = Callable[..., Coordinator]
"""Builds a Coordinator from (job, options=); a test seam."""


class JobRunner:
    """A Coordinator in a daemon thread, with thread-safe accessors. Starts at construction: this is an
    actor body, and a Ray actor's constructor is its only start signal."""

    def __init__(self, job: Job, *, options: dict | None = None, coordinator_factory: CoordinatorFactory | None = None,
                 on_tick: Callable[[Coordinator], object] | None = None):
        """`job`: as its edge built it (its config parsed and checked there: service.server.specs.validate_spec
        for REST, `load_job` for the CLI), not parsed again here. `on_tick(coordinator)` runs after every
        step (progress output)."""
        self.job_id = job.id
        factory = coordinator_factory or Coordinator
        self.coord = factory(job, options=CoordinatorOptions(**(options or {})))
        self.on_tick = on_tick
        self.error: str | None = None
        self._abandoned = False
        self._ended = threading.Event()
        """Set once the loop has returned. Waited on instead of Thread.join: a join that Ctrl-C interrupts
        (Python 3.11) marks the thread as ended while it still runs, and a later join returns at once."""
        self._thread = threading.Thread(target=self._run, name=f"elastron-job-{job.id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._ended.set()

    def _loop(self) -> None:
        try:
            self.coord.run(self.on_tick)
        except Exception as e:
            if self._abandoned:  # its process is ending (Ctrl-C): errors from Ray going away are expected
                return
            error = f"coordinator crashed: {type(e).__name__}: {e}"
            logger.error("job %s: %s; the job is reported FAILED. See the traceback and events.jsonl in %s",
                         self.job_id, error, self.coord.run_dir, exc_info=True)
            try:
                self.coord.journal.note(EventKind.FAILURE, reason=error, step=self.coord.step_done, cause=Cause.FAILURE)
            except Exception:
                logger.warning("job %s: could not record the crash as an event", self.job_id, exc_info=True)
            self.error = error  # last: once status() says FAILED, the event above is there to be read

    # -- reads -------------------------------------------------------------------------------------------
    def status(self) -> JobStatus:
        return self.coord.status().with_runner(running=not self._ended.is_set(), error=self.error, pid=os.getpid())

    def events_since(self, index: int = 0) -> list[dict]:
        return self.coord.events_since(index)

    def metrics_since(self, step: int = 0) -> list[dict]:
        return self.coord.metrics_since(step)

    def reconfigs(self) -> list[dict]:
        return [r.to_dict() for r in list(self.coord.reconfigs)]

    def abandon(self, timeout_s: float = 10.0) -> None:
        """The process is ending under the loop (Ctrl-C on `elastron run`): stop watching the cluster, end
        the loop at its next chance (it releases the workers) and wait for it up to `timeout_s`; what the
        loop meets meanwhile is not reported as a crash."""
        self._abandoned = True
        self.coord.watcher.stop()
        self.coord.halt()
        self._ended.wait(timeout_s)

    # -- commands (queued; the loop applies them at its next step) ---------------------------------------
    def send(self, cmd: Command) -> None:
        self.coord.send(cmd)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end; True if it has."""
        return self._ended.wait(timeout)

    def ping(self) -> str:
        return self.job_id


# -- the CLI's edge ------------------------------------------------------------------------------------------

def load_job(config: str | Path, *, job_id: str, workers: int | None = None, layout: str | None = None,
             steps: int | None = None, run_dir: str | Path | None = None) -> tuple[Job, tuple[str, ...]]:
    """The job of the YAML at `config`, parsed once, in its run directory (default runs/NAME), after
    every check that can fail before Ray starts (workers.preflight: the model's files, the data's
    headers and meta.json; the options; a forced layout the planner accepts; a writable run directory),
    with the preflight's warnings. ValueError (or ConfigError, PlanError) in one line. `steps` is the
    run's length and its LR schedule's (workers.config.with_steps)."""
    if workers is not None and layout is not None:
        raise ValueError("give --workers or --layout, not both")
    checked = preflight(with_steps(load_config(config), steps))
    cfg = checked.cfg
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    # The planner judges the job now, before Ray starts, as the REST API does at submit.
    if layout is not None:
        from parallel.layout import Layout

        job_plan(cfg, Layout.parse(layout, dp_mode=cfg.parallel.dp_mode).world_size, layout=layout)
    else:
        check_plannable(cfg, workers)
    rd = Path(run_dir or Path("runs") / cfg.name)
    check_run_dir(cfg, rd)  # a run that cannot write its events must not start
    return Job.of(cfg, job_id=job_id, run_dir=rd, workers=workers, layout=layout), checked.warnings


def check_local_job(config: str | Path, *, nproc: int, layout: str | None, steps: int | None,
                    run_dir: str | Path) -> JobConfig:
    """`elastron train`'s checks, before any rank starts: those every rank would make."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    cfg = preflight(with_steps(load_config(config), steps)).cfg
    job_plan(cfg, nproc, layout=layout)
    check_run_dir(cfg, run_dir)
    return cfg


def run_local(config: str | Path, *, nproc: int, run_dir: str | Path, layout: str | None,
              steps: int | None) -> int:
    """`nproc` local ranks of workers.train (no Ray); the first non-zero exit code, else 0."""
    from workers.local import launch_local

    return launch_local(config, nproc=nproc, run_dir=run_dir, layout=layout, steps=steps)
