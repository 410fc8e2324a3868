"""The job service's public names in one place, for existing imports (`from service.jobs import JobManager`).

The code lives in:
  service.specs        request checks: validate_spec, SpecError, resolve_run_dir, check_paths
  service.job_manager  JobManager (its syncing half: service.job_sync)
  service.job_types    its seams (JobHandle, Launcher, Store) and errors (JobNotFound, JobConflict)
  service.areas        the directories each job owns
  service.limits       the sizes a request may name
  service.status       JobStatus, the one status record (service.state.TERMINAL: the final states)
  service.driver       JobRunner, the one job driver (the job actor's body, elastron run and demo)
  service.run_files    what a run directory says when the coordinator is gone (events, metrics, checkpoints)
"""

from service.job_actor import JobUnavailable
from service.job_manager import JobConflict, JobHandle, JobManager, JobNotFound, Launcher, Store
from service.specs import SpecError, check_paths, config_error_loc, resolve_run_dir, validate_spec
from service.state import TERMINAL
from service.status import JobStatus

__all__ = ["JobConflict", "JobHandle", "JobManager", "JobNotFound", "JobStatus", "JobUnavailable", "Launcher",
           "SpecError", "Store", "TERMINAL", "check_paths", "config_error_loc", "resolve_run_dir", "validate_spec"]
