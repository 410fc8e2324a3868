"""/api/v1/cluster: nodes, resources and drain notices, as the coordinators see them; /api/v1/quotas: what
each user's jobs may hold on the shared cluster, and hold now."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import JobsDep, ReaderDep
from api.schemas import Cluster, ErrorBody, QuotaUsage

router = APIRouter(tags=["cluster"])


@router.get("/cluster", response_model=Cluster,
            responses={503: {"model": ErrorBody, "description": "The cluster could not be read."},
                       401: {"model": ErrorBody, "description": "No bearer token."},
                       403: {"model": ErrorBody, "description": "Wrong bearer token."}})
def get_cluster(jobs: JobsDep, who: ReaderDep) -> dict:
    """Every node with its CPUs/GPUs, alive or dead (with Ray's reason), and draining ones with their
    deadline; a user's token gets counts only."""
    return jobs.cluster(owner=who.owner)


@router.get("/quotas", response_model=list[QuotaUsage],
            responses={401: {"model": ErrorBody, "description": "No bearer token."},
                       403: {"model": ErrorBody, "description": "Wrong bearer token."}})
def get_quotas(jobs: JobsDep, who: ReaderDep) -> list[dict]:
    """Each user's quota (workers held, jobs running) and their use now; a user sees only their own."""
    return jobs.quota_usage(owner=who.owner)
