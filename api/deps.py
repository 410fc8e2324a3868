"""Settings and the API's dependencies, as `Annotated` aliases that tests can override
(`app.dependency_overrides[get_jobs] = ...`)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.job_manager import JobManager


@dataclass(kw_only=True, slots=True)
class Settings:
    runs_root: Path = Path("runs")
    """Every job's run directory lies under this; requests cannot name a path outside it."""
    store_url: str = "runs/elastron.db"
    """Job store (specs, statuses, events, metrics): a SQLAlchemy URL (sqlite:///PATH,
    postgresql+psycopg://USER:PASSWORD@HOST/DB), or a SQLite file path."""
    data_roots: tuple[Path, ...] | None = None
    """Directories a job's data.path may lie under; None: none (never the runs root, which holds other
    jobs' files and the store)."""
    token: str | None = None
    """When set, mutating endpoints need `Authorization: Bearer TOKEN`."""
    max_body_bytes: int = 1 << 20
    """Larger request bodies get 413."""
    sync_interval_s: float = 0.5
    """How often the job manager pulls status, events and metrics from the coordinators."""
    stop_timeout_s: float = 30.0
    """DELETE waits this long for a job's final checkpoint before releasing its coordinator."""
    ray_address: str | None = None
    """Ray cluster for the default (Ray) launcher; None: RAY_ADDRESS, else a private local Ray."""

    def __post_init__(self) -> None:
        self.runs_root = Path(self.runs_root)
        if self.data_roots is not None:
            self.data_roots = tuple(Path(r) for r in self.data_roots)
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.token is not None and not self.token.strip():
            raise ValueError("an API token must not be empty or blank (unset ELASTRON_API_TOKEN instead)")

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        """ELASTRON_RUNS_ROOT, ELASTRON_STORE, ELASTRON_API_TOKEN, ELASTRON_MAX_BODY_BYTES,
        ELASTRON_DATA_ROOTS (os.pathsep-separated), then `overrides`."""
        env = os.environ
        root = env.get("ELASTRON_RUNS_ROOT", "runs")
        kw: dict = {"runs_root": Path(root), "store_url": env.get("ELASTRON_STORE", str(Path(root) / "elastron.db")),
                    "token": env.get("ELASTRON_API_TOKEN") or None}
        if "ELASTRON_MAX_BODY_BYTES" in env:
            v = env["ELASTRON_MAX_BODY_BYTES"]
            if not v.strip().isdigit():
                raise ValueError(f"ELASTRON_MAX_BODY_BYTES must be a whole number of bytes, got {v!r}")
            kw["max_body_bytes"] = int(v)
        if env.get("ELASTRON_DATA_ROOTS"):
            kw["data_roots"] = tuple(Path(r) for r in env["ELASTRON_DATA_ROOTS"].split(os.pathsep) if r)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_jobs(request: Request) -> JobManager:
    return request.app.state.jobs


SettingsDep = Annotated[Settings, Depends(get_settings)]
JobsDep = Annotated[JobManager, Depends(get_jobs)]

_bearer = HTTPBearer(auto_error=False, description="Needed on mutating endpoints when the server has "
                                                   "ELASTRON_API_TOKEN set.")


def require_token(settings: SettingsDep,
                  creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """401 without a bearer token, 403 with a wrong one; open when the server has no token."""
    if settings.token is None:
        return
    if creds is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "this endpoint needs 'Authorization: Bearer <token>' "
                            "(the server's ELASTRON_API_TOKEN)", headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(creds.credentials.encode(), settings.token.encode()):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "wrong API token")


AuthDep = Depends(require_token)
"""For `dependencies=[AuthDep]` on mutating routes."""
