"""/api/v1/jobs: submit, list, inspect, command and forget jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response, status

from api.deps import AdminDep, JobsDep, ReaderDep, WriterDep
from service.control.commands import Pause, Resume, Stop
from service.control.events import Event
from api.schemas import (MAX_STEPS, ActionResult, Checkpoints, Deleted, ErrorBody, Freed, JobCreated,
                         JobDetail, JobSubmit, JobSummary, MetricRow, ResizeRequest, ValidationErrorBody, job_view)

router = APIRouter(prefix="/jobs", tags=["jobs"])

NOT_FOUND = {404: {"model": ErrorBody, "description": "No job with that id."}}
CONFLICT = {409: {"model": ErrorBody, "description": "The action does not fit the job's state; the detail says why."}}
INVALID = {422: {"model": ValidationErrorBody, "description": "Invalid request; each error names its field."}}
AUTH = {401: {"model": ErrorBody, "description": "No bearer token (the server has a token set)."},
        403: {"model": ErrorBody, "description": "Wrong bearer token, or a read-only one for a change."}}
UNAVAILABLE = {503: {"model": ErrorBody, "description": "The job's coordinator did not answer; retry."}}
Since = Annotated[int, Query(ge=0, le=MAX_STEPS, description="Only rows after this step.")]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobCreated,
             responses={**INVALID, **AUTH, **CONFLICT, 413: {"model": ErrorBody, "description": "Body too large."}})
def submit_job(body: JobSubmit, jobs: JobsDep, who: WriterDep, response: Response,
               idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255, description=(
                   "Makes the submit safe to retry: a repeat with the same key and body returns the first "
                   "job instead of starting another (409 when the body differs)."))] = None) -> JobCreated:
    """Validate the spec as `elastron run` would (422 names the bad field) and start the job."""
    job_id = jobs.submit(body.spec_dict(), steps=body.steps, workers=body.workers, run_dir=body.run_dir,
                         idempotency_key=idempotency_key, owner=who.owner)
    response.headers["Location"] = f"/api/v1/jobs/{job_id}"
    return JobCreated(id=job_id, run_dir=jobs.get(job_id, owner=who.owner).run_dir)


@router.get("", response_model=list[JobSummary], responses=AUTH)
def list_jobs(jobs: JobsDep, who: ReaderDep, limit: Annotated[int, Query(ge=1, le=1000)] = 500,
              offset: Annotated[int, Query(ge=0, le=MAX_STEPS)] = 0) -> list[dict]:
    """Jobs, oldest first, `limit` of them from `offset` (page with offset += limit)."""
    return [job_view(r) for r in jobs.list(limit=limit, offset=offset, owner=who.owner)]


@router.get("/{job_id}", response_model=JobDetail, responses={**NOT_FOUND, **AUTH})
def get_job(job_id: str, jobs: JobsDep, who: ReaderDep) -> dict:
    """State, layout, world size, step, loss, tokens/s, last committed checkpoint, and the reason for the
    state (why it is waiting, why it failed)."""
    return job_view(jobs.get(job_id, owner=who.owner))


@router.get("/{job_id}/metrics", response_model=list[MetricRow], responses={**NOT_FOUND, **AUTH})
def job_metrics(job_id: str, jobs: JobsDep, who: ReaderDep, since: Since = 0,
                limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
                stride: Annotated[int, Query(ge=1, le=MAX_STEPS, description=(
                    "Only steps that are multiples of this: a long run's curve in fewer points."))] = 1
                ) -> list[dict]:
    """Per-step metrics after step `since`, oldest first (poll with the last step you have)."""
    return jobs.metrics(job_id, since, limit, stride, owner=who.owner)


@router.get("/{job_id}/events", response_model=list[Event], responses={**NOT_FOUND, **AUTH})
def job_events(job_id: str, jobs: JobsDep, who: ReaderDep,
               since: Annotated[int, Query(ge=0, le=MAX_STEPS, description="Index of the first event.")] = 0,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[dict]:
    """The job's events (transitions, resizes, preemption notices, failures, checkpoints) from index
    `since`, at most `limit` of them (page with since += the number returned)."""
    return jobs.events(job_id, since, limit, owner=who.owner)


@router.get("/{job_id}/checkpoints", response_model=Checkpoints, responses={**NOT_FOUND, **AUTH})
def job_checkpoints(job_id: str, jobs: JobsDep, who: ReaderDep) -> dict:
    """Entries of the job's checkpoints directory (read-only)."""
    return jobs.checkpoints(job_id, owner=who.owner)


def _action(code: int = status.HTTP_202_ACCEPTED):
    return dict(status_code=code, response_model=ActionResult,
                responses={**NOT_FOUND, **CONFLICT, **AUTH, **UNAVAILABLE})


@router.post("/{job_id}/resize", **_action())
def resize_job(job_id: str, body: ResizeRequest, jobs: JobsDep, who: WriterDep) -> dict:
    """Queue a resize; the coordinator checkpoints and re-forms at its next iteration."""
    return jobs.command(job_id, body.command(), owner=who.owner)


@router.post("/{job_id}/pause", **_action())
def pause_job(job_id: str, jobs: JobsDep, who: WriterDep) -> dict:
    return jobs.command(job_id, Pause(), owner=who.owner)


@router.post("/{job_id}/resume", **_action())
def resume_job(job_id: str, jobs: JobsDep, who: WriterDep) -> dict:
    return jobs.command(job_id, Resume(), owner=who.owner)


@router.post("/{job_id}/stop", **_action())
def stop_job(job_id: str, jobs: JobsDep, who: WriterDep) -> dict:
    return jobs.command(job_id, Stop(), owner=who.owner)


@router.delete("/{job_id}", response_model=Deleted, responses={**NOT_FOUND, **AUTH, **CONFLICT})
def delete_job(job_id: str, jobs: JobsDep, who: WriterDep, force: bool = False) -> dict:
    """Stop the job (after its final checkpoint) and forget it. Its run directory and checkpoints stay.
    A job still saving its final checkpoint after the server's stop timeout is left running (409: retry);
    `force=true` releases it anyway."""
    return jobs.delete(job_id, force=force, owner=who.owner)


@router.delete("/{job_id}/places", response_model=Freed, responses={**NOT_FOUND, **AUTH, **CONFLICT})
def free_places(job_id: str, jobs: JobsDep, who: AdminDep) -> dict:
    """Admin only: forget the places (run and checkpoint directories) a deleted job still holds, so that
    any user's job may use them. Until then they stay its owner's: the files are still there."""
    return jobs.free_places(job_id)
