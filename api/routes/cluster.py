"""/api/v1/cluster: nodes, resources and drain notices, as the coordinators see them."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import JobsDep, ReaderDep
from api.schemas import Cluster, ErrorBody

router = APIRouter(tags=["cluster"])


@router.get("/cluster", response_model=Cluster,
            responses={503: {"model": ErrorBody, "description": "The cluster could not be read."},
                       401: {"model": ErrorBody, "description": "No bearer token."},
                       403: {"model": ErrorBody, "description": "Wrong bearer token."}})
def get_cluster(jobs: JobsDep, who: ReaderDep) -> dict:
    """Every node with its CPUs/GPUs, alive or dead (with Ray's reason), and draining ones with their deadline."""
    return jobs.cluster()
