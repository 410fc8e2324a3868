"""The API's routers: `api_router` (everything under /api/v1) and `ops_router` (/healthz, /metrics, and the
dashboard at /)."""

from fastapi import APIRouter

from api.routes import cluster, dashboard, jobs, ops

api_router = APIRouter(prefix="/api/v1")
api_router.include_router(jobs.router)
api_router.include_router(cluster.router)

ops_router = APIRouter()
ops_router.include_router(ops.router)
ops_router.include_router(dashboard.router)

__all__ = ["api_router", "ops_router"]
