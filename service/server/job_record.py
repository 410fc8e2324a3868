"""A job's stored record (JobRecord): light to import, so the job store (api.store) need not bring in Ray."""

from __future__ import annotations

from dataclasses import dataclass

from service.control.status import JobStatus


@dataclass(kw_only=True, slots=True, frozen=True)
class JobRecord:
    """A job as the store keeps it: what was submitted, and its last status. The manager makes the first
    one at submit; the store makes the others when it reads a row; the API's views are made from it
    (api.schemas.job_view). Its state is its status's: there is no second copy to drift."""

    id: str
    name: str
    spec: dict
    """The spec as submitted (JSON); its JobConfig is parsed from it where it is not at hand."""
    run_dir: str
    created: float
    """When it was submitted (unix seconds)."""
    updated: float
    """When its status was last stored."""
    status: JobStatus
    steps: int | None = None
    """The submit's `steps` override, if it gave one."""
    workers: int | None = None
    """The submit's `workers` override, if it gave one."""
    released: bool = False
    """Finished and its coordinator let go: nothing about it will change again."""
    owner: str | None = None
    """The user who submitted it (None without users)."""
    idempotency_key: str | None = None
    request: dict | None = None
    """The submit request (spec, steps, workers, run_dir) as given, to tell a retry from a new request."""

    @property
    def state(self) -> str:
        return self.status.state

    @property
    def checkpoint_dir(self) -> str | None:
        """The spec's checkpoint.dir (None: the run directory's checkpoints/)."""
        return (self.spec.get("checkpoint") or {}).get("dir")
