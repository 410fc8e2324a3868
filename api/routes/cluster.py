"""/api/v1/cluster: nodes, resources and drain notices, as the coordinators see them."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import JobsDep
from api.schemas import Cluster, ErrorBody

router = APIRouter(tags=["cluster"])


@router.get("/cluster", response_model=Cluster,
            responses={503: {"model": ErrorBody, "description": "The cluster could not be read."}})
def get_cluster(jobs: JobsDep) -> dict:
    """Every node with its CPUs/GPUs, alive or dead (with Ray's reason), and draining ones with their deadline."""
    return jobs.cluster()
