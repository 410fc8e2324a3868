"""Settings and the API's dependencies, as `Annotated` aliases that tests can override
(`app.dependency_overrides[get_jobs] = ...`).

Who may do what (`Principal`, from the bearer token; with no token configured the server is open, and
`elastron serve` then binds loopback only):
  ELASTRON_API_TOKEN     admin: every job, every call
  ELASTRON_READ_TOKEN    read-only, every job (e.g. for Prometheus' scrape of /metrics)
  ELASTRON_USER_TOKENS   "alice=TOKEN,bob=TOKEN": each user submits, sees and steers only their own jobs
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.server.job_manager import JobManager
from service.sharing.scheduler import Quota


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
    """The admin token: with any token set, every endpoint but /healthz needs `Authorization: Bearer TOKEN`."""
    read_token: str | None = None
    """A read-only token that sees every job (e.g. Prometheus)."""
    user_tokens: dict[str, str] = field(default_factory=dict)
    """User name -> token: a user sees and steers only the jobs their token submitted."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host headers the server answers (TrustedHostMiddleware); None: any. `elastron serve` on loopback
    defaults to the loopback names, so a DNS-rebinding page cannot reach it."""
    max_body_bytes: int = 1 << 20
    """Larger request bodies get 413."""
    max_requests_per_user: int | None = 8
    """With tokens configured, the requests of one token answered at once; more get 429 with Retry-After
    (api.app.PerUserLimit). None: no limit."""
    sync_interval_s: float = 0.5
    """How often the job manager pulls status, events and metrics from the coordinators
    (service.server.store_sync), each sync round followed by a scheduling round."""
    stop_timeout_s: float = 30.0
    """DELETE waits this long for a job's final checkpoint before releasing its coordinator."""
    ray_address: str | None = None
    """Ray cluster for the default (Ray) launcher; None: RAY_ADDRESS, else a private local Ray."""
    schedule: bool = True
    """Share the cluster among the jobs (service.server.scheduling runs the rounds service.sharing.rounds
    decides): grants, queue, priorities, quotas.
    ELASTRON_SCHEDULE=0 turns it off: each job then plans onto the whole cluster, as if it were alone."""
    quotas: dict[str, Quota] = field(default_factory=dict)
    """User name -> the workers and running jobs that user's jobs may hold on the shared cluster."""
    resume_prefixes: tuple[str, ...] = ()
    """Paths or object-store URLs under which any user's job may name its checkpoint.resume_from (e.g.
    shared base checkpoints), and no job may write; besides them, a user may name only their own jobs'
    directories."""
    object_stores: tuple[str, ...] = ()
    """Object-store and HDFS URLs (e.g. s3://ckpts, abfs://c@acct.dfs.core.windows.net, hdfs://nn:8020/jobs)
    a job's checkpoint.dir may lie in; none: local paths only. The workers connect only to these."""
    azure_account: str | None = None
    """The storage account of an abfs:// URL that names none (AZURE_STORAGE_ACCOUNT_NAME, as adlfs reads it)."""
    max_live_jobs: int | None = 32
    """A user's unfinished jobs at once; None: no limit."""
    max_finished_jobs: int = 100
    """A user's finished jobs kept in the store: a submit prunes that user's oldest finished jobs beyond
    it (their record, events and metrics; their run directories stay, and so do their places)."""
    lock_timeout_s: float = 30.0
    """How long a request waits for a job's lock (held while its coordinator is asked) before a 503."""

    def __post_init__(self) -> None:
        self.runs_root = Path(self.runs_root)
        if self.data_roots is not None:
            self.data_roots = tuple(Path(r) for r in self.data_roots)
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for what, tok in (("ELASTRON_API_TOKEN", self.token), ("ELASTRON_READ_TOKEN", self.read_token),
                          *((f"the token of user {u!r}", t) for u, t in self.user_tokens.items())):
            if tok is not None and not tok.strip():
                raise ValueError(f"an API token must not be empty or blank ({what})")
        toks = [t for t in (self.token, self.read_token, *self.user_tokens.values()) if t]
        if len(set(toks)) != len(toks):
            raise ValueError("every API token must be different (admin, read-only and user tokens)")

    @property
    def auth(self) -> bool:
        """Whether any token is configured (else every call is open)."""
        return bool(self.token or self.read_token or self.user_tokens)

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        """ELASTRON_RUNS_ROOT, ELASTRON_STORE, ELASTRON_API_TOKEN, ELASTRON_MAX_BODY_BYTES,
        ELASTRON_DATA_ROOTS (os.pathsep-separated), ELASTRON_SCHEDULE, ELASTRON_QUOTAS (`parse_quotas`),
        ELASTRON_RESUME_PREFIXES and ELASTRON_OBJECT_STORES (comma-separated), AZURE_STORAGE_ACCOUNT_NAME,
        ELASTRON_MAX_LIVE_JOBS, ELASTRON_MAX_FINISHED_JOBS, ELASTRON_MAX_REQUESTS_PER_USER, then `overrides`."""
        env = os.environ
        root = env.get("ELASTRON_RUNS_ROOT", "runs")
        kw: dict = {"runs_root": Path(root), "store_url": env.get("ELASTRON_STORE", str(Path(root) / "elastron.db")),
                    "token": env.get("ELASTRON_API_TOKEN") or None, "read_token": env.get("ELASTRON_READ_TOKEN") or None}
        if env.get("ELASTRON_USER_TOKENS"):
            users = {}
            for item in env["ELASTRON_USER_TOKENS"].split(","):
                name, sep, tok = item.strip().partition("=")
                if not sep or not name.strip() or not tok.strip():
                    raise ValueError("ELASTRON_USER_TOKENS must be NAME=TOKEN pairs separated by commas")
                users[name.strip()] = tok.strip()
            kw["user_tokens"] = users
        if env.get("ELASTRON_SCHEDULE", "1").strip() not in ("0", "1"):
            raise ValueError(f"ELASTRON_SCHEDULE must be 1 (share the cluster among jobs) or 0, got "
                             f"{env['ELASTRON_SCHEDULE']!r}")
        kw["schedule"] = env.get("ELASTRON_SCHEDULE", "1").strip() == "1"
        if env.get("ELASTRON_QUOTAS"):
            kw["quotas"] = parse_quotas(env["ELASTRON_QUOTAS"])
        if env.get("ELASTRON_ALLOWED_HOSTS"):
            kw["allowed_hosts"] = tuple(h.strip() for h in env["ELASTRON_ALLOWED_HOSTS"].split(",") if h.strip())
        if "ELASTRON_MAX_BODY_BYTES" in env:
            v = env["ELASTRON_MAX_BODY_BYTES"]
            if not v.strip().isdigit():
                raise ValueError(f"ELASTRON_MAX_BODY_BYTES must be a whole number of bytes, got {v!r}")
            kw["max_body_bytes"] = int(v)
        if "ELASTRON_MAX_REQUESTS_PER_USER" in env:
            v = env["ELASTRON_MAX_REQUESTS_PER_USER"].strip()
            if v and not (v.isascii() and v.isdigit() and 1 <= int(v) <= 100_000):
                raise ValueError(f"ELASTRON_MAX_REQUESTS_PER_USER must be a whole number from 1 (empty: no limit), "
                                 f"got {v!r}")
            kw["max_requests_per_user"] = int(v) if v else None
        if env.get("ELASTRON_DATA_ROOTS"):
            kw["data_roots"] = tuple(Path(r) for r in env["ELASTRON_DATA_ROOTS"].split(os.pathsep) if r)
        if env.get("ELASTRON_OBJECT_STORES"):
            kw["object_stores"] = tuple(p.strip() for p in env["ELASTRON_OBJECT_STORES"].split(",") if p.strip())
        if env.get("AZURE_STORAGE_ACCOUNT_NAME"):
            kw["azure_account"] = env["AZURE_STORAGE_ACCOUNT_NAME"].strip()
        if "ELASTRON_MAX_FINISHED_JOBS" in env:
            v = env["ELASTRON_MAX_FINISHED_JOBS"].strip()
            if not (v.isascii() and v.isdigit()) or len(v) > 9:
                raise ValueError(f"ELASTRON_MAX_FINISHED_JOBS must be a whole number (a user's finished jobs kept), "
                                 f"got {v!r}")
            kw["max_finished_jobs"] = int(v)
        if "ELASTRON_MAX_LIVE_JOBS" in env:
            v = env["ELASTRON_MAX_LIVE_JOBS"].strip()
            if v and not v.isdigit():
                raise ValueError(f"ELASTRON_MAX_LIVE_JOBS must be a whole number (empty: no limit), got {v!r}")
            kw["max_live_jobs"] = int(v) if v else None
        if env.get("ELASTRON_RESUME_PREFIXES"):
            kw["resume_prefixes"] = tuple(p.strip() for p in env["ELASTRON_RESUME_PREFIXES"].split(",") if p.strip())
        kw.update({k: v for k, v in overrides.items() if v is not None})
        if "max_live_jobs" in overrides and overrides["max_live_jobs"] is None:
            kw["max_live_jobs"] = None
        return cls(**kw)


def parse_quotas(text: str) -> dict[str, Quota]:
    """`NAME=WORKERS:JOBS[:PRIORITY],...` (e.g. `ann=8:2:10,bob=4:`; an empty WORKERS or JOBS is no limit,
    an empty or left out PRIORITY is 0, `*` none) -> {name: Quota}. PRIORITY is the highest
    scheduling.priority the user's jobs may ask for; a user not listed may ask for 0 at most."""
    out = {}
    for item in text.split(","):
        name, sep, limits = item.strip().partition("=")
        workers, colon, rest = limits.partition(":")
        jobs, _, prio = rest.partition(":")
        parts = [p.strip() for p in (workers, jobs)]
        prio = prio.strip()
        if not sep or not colon or not name.strip() or not all(p == "" or (p.isascii() and p.isdigit()) for p in parts) \
                or not (prio in ("", "*") or re.fullmatch(r"-?[0-9]{1,9}", prio)):
            raise ValueError(f"ELASTRON_QUOTAS: {item.strip()!r} is not NAME=WORKERS:JOBS[:PRIORITY] (whole numbers, "
                             "WORKERS and JOBS empty for no limit, PRIORITY * for no ceiling), e.g. ann=8:2:10,bob=4:")
        out[name.strip()] = Quota(max_workers=int(parts[0]) if parts[0] else None,
                                  max_jobs=int(parts[1]) if parts[1] else None,
                                  max_priority=None if prio == "*" else int(prio or 0))
    return out


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_jobs(request: Request) -> JobManager:
    return request.app.state.jobs


SettingsDep = Annotated[Settings, Depends(get_settings)]
JobsDep = Annotated[JobManager, Depends(get_jobs)]

_bearer = HTTPBearer(auto_error=False, description="Needed on every endpoint but /healthz when the server has "
                                                   "a token (ELASTRON_API_TOKEN, ELASTRON_READ_TOKEN, "
                                                   "ELASTRON_USER_TOKENS).")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a request: a user (their own jobs), the admin, or the read-only token (every job)."""

    name: str | None
    can_write: bool
    sees_all: bool

    @property
    def owner(self) -> str | None:
        """The job manager's `owner` argument: None sees every job."""
        return None if self.sees_all else self.name


OPEN = Principal(name=None, can_write=True, sees_all=True)


def authenticate(settings: SettingsDep,
                 creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    """401 without a bearer token, 403 with a wrong one; open when the server has no token."""
    if not settings.auth:
        return OPEN
    if creds is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "this endpoint needs 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    given = creds.credentials.encode()
    found = None  # every comparison is made, so the time does not tell which token nearly matched
    for who, tok in ((Principal("admin", True, True), settings.token),
                     (Principal("reader", False, True), settings.read_token),
                     *((Principal(u, True, False), t) for u, t in settings.user_tokens.items())):
        if tok is not None and secrets.compare_digest(given, tok.encode()) and found is None:
            found = who
    if found is None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "wrong API token")
    return found


def reader(who: Annotated[Principal, Depends(authenticate)]) -> Principal:
    return who


def writer(who: Annotated[Principal, Depends(authenticate)]) -> Principal:
    if not who.can_write:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "this token is read-only")
    return who


def overseer(who: Annotated[Principal, Depends(authenticate)]) -> Principal:
    """Every job's data at once (/metrics): the admin or the read-only token, not a user."""
    if not who.sees_all:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only the admin or the read-only token sees every job")
    return who


def admin(who: Annotated[Principal, Depends(authenticate)]) -> Principal:
    """The admin token (or an open server): acts on what belongs to no one job, e.g. freeing places."""
    if not (who.sees_all and who.can_write):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only the admin token may do this")
    return who


ReaderDep = Annotated[Principal, Depends(reader)]
AdminDep = Annotated[Principal, Depends(admin)]
WriterDep = Annotated[Principal, Depends(writer)]
OverseerDep = Annotated[Principal, Depends(overseer)]
AuthDep = Depends(writer)
"""For `dependencies=[AuthDep]` on mutating routes that need no principal."""
