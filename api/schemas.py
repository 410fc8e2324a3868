"""Request and response models of the HTTP API.

A submitted job's spec is described once, by the job YAML's schema (workers.config, through
service.server.specs): the request body is judged by it (types, bounds, the rules between fields; one
422 naming the first field it refuses) and /openapi.json documents it (JobConfig and its sections, each
field with its bounds). The job responses (JobSummary, JobDetail) wrap service.control.status.JobStatus,
with its field docstrings.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from service.control.commands import SetWorkers
from service.server.specs import LOCATION, MAX_STEPS, MAX_WORKERS, JobConfig
from service.server.job_record import JobRecord
from service.control.status import JobStatus


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after the field), as JobStatus writes them."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return {}
    docs = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _judged_spec(spec: Any) -> dict[str, Any]:
    """`spec` as written, once the job spec's schema accepts it; else its first refusal, at its field
    (a ValidationError raised here is reported under the request's `spec`)."""
    try:
        JobConfig.from_dict(spec)
    except ValueError as e:  # ConfigError: one line, and the field's path
        raise ValidationError.from_exception_data("spec", [InitErrorDetails(
            type=PydanticCustomError("value_error", "{reason}", {"reason": str(e)}),
            loc=tuple(getattr(e, "loc", ())), input=None)]) from None
    return spec


JobSpec = Annotated[dict[str, Any], PlainValidator(_judged_spec, json_schema_input_type=JobConfig)]
"""A job spec in a request: judged by, and documented as, the job YAML's schema (JobConfig); kept as the
user wrote it (fields left out stay defaults)."""


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- requests ------------------------------------------------------------------------------------------------

class JobSubmit(BaseModel):
    """A job to run: its spec (the job YAML, as a mapping) and optional overrides."""

    model_config = ConfigDict(extra="forbid")
    spec: JobSpec = Field(description="The job YAML's content (sections model, data, train, parallel, ...).")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Total optimizer steps (default: train.steps).")
    workers: int | None = Field(None, ge=1, le=MAX_WORKERS, description="Run on at most this many workers.")
    run_dir: str | None = Field(None, min_length=1, max_length=255, json_schema_extra=LOCATION,
                                description="Run directory, relative to the server's runs root (default: NAME-ID).")

    def spec_dict(self) -> dict:
        """The spec as the user wrote it (fields they did not give stay out, so defaults stay defaults)."""
        return self.spec


class ResizeRequest(BaseModel):
    """Either `workers` (run on at most N), or `min_workers` and/or `max_workers` (a new range)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"workers": 2},
                                                                               {"min_workers": 1, "max_workers": 4}]})
    workers: int | None = Field(None, ge=1, le=MAX_WORKERS)
    min_workers: int | None = Field(None, ge=1, le=MAX_WORKERS)
    max_workers: int | None = Field(None, ge=1, le=MAX_WORKERS)

    @model_validator(mode="after")
    def _one_form(self) -> "ResizeRequest":
        self.command()  # the command's own checks, once: a CommandError is a ValueError, so a 422
        return self

    def command(self) -> SetWorkers:
        return SetWorkers(workers=self.workers, min_workers=self.min_workers, max_workers=self.max_workers)


# -- responses -----------------------------------------------------------------------------------------------

class Layout(_Out):
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int


class Degrees(_Out):
    dp: int
    tp: int
    pp: int


class JobCreated(BaseModel):
    id: str
    run_dir: str


_STATUS = _field_docs(JobStatus)


def _status(name: str, default: Any = None, **kw: Any) -> Any:
    """A JobStatus field as a response field, described by the field's docstring."""
    if "default_factory" in kw:
        return Field(description=_STATUS[name], **kw)
    return Field(default, description=_STATUS[name], **kw)


class JobSummary(BaseModel):
    """A job in the list: its record (id, name, run_dir, times) and the main fields of its JobStatus."""

    id: str
    name: str
    state: str = Field(description=_STATUS["state"])
    reason: str | None = _status("reason")
    step: int | None = _status("step")
    total_steps: int | None = None
    world_size: int = _status("world_size", 0)
    loss: float | None = None
    val_loss: float | None = _status("val_loss")
    tokens_per_s: float | None = None
    mfu: float | None = _status("mfu")
    layout: Layout | None = _status("layout")
    degrees: Degrees | None = None
    run_dir: str
    created: float
    updated: float
    owner: str | None = Field(None, description="The user whose token submitted the job (none without users).")
    priority: int = _status("priority", 0)
    queue_position: int | None = _status("queue_position")
    held: dict[str, int] = _status("held", default_factory=dict)


class JobDetail(JobSummary):
    """One job: its record and its whole JobStatus (service.control.status), field for field."""

    model_config = ConfigDict(extra="allow")
    job_id: str | None = None
    cause: str | None = _status("cause")
    since: float | None = _status("since")
    committed_step: int | None = _status("committed_step")
    min_workers: int | None = None
    max_workers: int | None = None
    reconfigurations: dict[str, int] = _status("reconfigurations", default_factory=dict)
    steps_lost: int = 0
    events: int | None = _status("events")
    spec: dict[str, Any]
    steps: int | None = None
    workers: int | None = None
    running: bool | None = _status("running")
    error: str | None = _status("error")
    pid: int | None = _status("pid")
    grant: dict[str, int] | None = _status("grant")
    standby: int = _status("standby", 0)


def job_view(r: JobRecord) -> dict[str, Any]:
    """A job as the API shows it (JobSummary, JobDetail): its status's fields with its record's."""
    return {**r.status.to_dict(), "id": r.id, "name": r.name, "state": r.state, "run_dir": r.run_dir,
            "created": r.created, "updated": r.updated, "spec": r.spec, "steps": r.steps, "workers": r.workers,
            "owner": r.owner}


class MetricRow(_Out):
    step: int
    loss: float | None = None
    val_loss: float | None = Field(None, description="Loss on the held-out split; only on steps that evaluate.")
    tokens_per_s: float | None = None
    mfu: float | None = Field(None, description="Model FLOPs utilisation of the step (0..1); null where unknown.")
    time: float | None = None
    world_size: int | None = None


class ActionResult(BaseModel):
    id: str
    action: str
    accepted: bool
    state: str = Field(description="The state when the command was queued; it takes effect at the next iteration.")


class Deleted(BaseModel):
    id: str
    state: str
    deleted: bool
    run_dir: str


class Freed(BaseModel):
    id: str
    freed: int = Field(description="How many places (run_dir, checkpoint.dir) were freed.")


class CheckpointEntry(BaseModel):
    name: str
    step: int | None
    is_dir: bool
    committed: bool = Field(description="manifest.json present: the checkpoint was committed.")
    bytes: int
    modified: float


class Checkpoints(BaseModel):
    dir: str
    latest: str | None
    entries: list[CheckpointEntry]
    note: str | None = None


class Node(BaseModel):
    node_id: str
    alive: bool
    cpus: float
    gpus: float
    draining: bool
    drain_deadline: float | None
    seconds_left: float | None = Field(description="Until the drain deadline, when there is one.")
    is_head: bool
    death_reason: str | None


class Cluster(BaseModel):
    """The admin and the read-only token see every node; a user sees counts only (nodes is empty)."""

    time: float
    nodes: list[Node]
    usable_workers: int
    node_count: int | None = Field(None, description="Alive nodes (a user's view).")
    draining_nodes: int | None = Field(None, description="Nodes draining (a user's view).")
    cpus: float | None = Field(None, description="CPUs on alive nodes (a user's view).")
    gpus: float | None = Field(None, description="GPUs on alive nodes (a user's view).")


class QuotaUsage(BaseModel):
    """One user's quota on the shared cluster and what their jobs hold now."""

    owner: str
    max_workers: int | None = Field(description="Most workers the user's jobs may hold together; null: no limit.")
    max_jobs: int | None = Field(description="Most of the user's jobs holding workers at once; null: no limit.")
    workers_held: int
    jobs_running: int


class Health(BaseModel):
    status: str
    jobs: int | None = None


class ErrorBody(BaseModel):
    detail: str


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    detail: list[FieldError]
