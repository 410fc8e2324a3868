"""The job control service: `create_app()` builds the FastAPI app, `serve()` runs it with uvicorn
(`elastron serve`).

Nothing is created at import. `create_app(jobs=...)` takes a ready JobManager (tests: an in-process
launcher); without one, the app's startup connects to Ray and builds the default manager (the job store
at ELASTRON_STORE, a SQLAlchemy URL, by default SQLite under the runs root; coordinators as detached Ray
actors). Startup re-attaches to the jobs' coordinators
(`JobManager.start`); shutdown stops only the syncing: the jobs keep running.
"""

from __future__ import annotations

import logging
import os
import secrets
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware

from api.deps import Settings
from api.routes import api_router, ops_router
from api.routes.dashboard import STATIC_DIR
from api.routes.ops import make_registry
from service.server.job_actor import JobUnavailable
from service.server.job_manager import JobConflict, JobForbidden, JobManager, JobNotFound
from service.server.specs import SpecError

logger = logging.getLogger("elastron.api")


def default_manager(settings: Settings) -> JobManager:
    """The job store at settings.store_url (a SQLAlchemy URL), then the Ray launcher, connecting to Ray."""
    from api.run import connect_ray
    from api.store import JobStore
    from service.server.job_actor import RayLauncher

    store = JobStore(settings.store_url)  # first: a wrong store URL should not cost a Ray start
    try:
        connect_ray(settings.ray_address)
    except Exception as e:  # ConnectionError, TimeoutError, RuntimeError from ray.init
        store.close()
        where = settings.ray_address or os.environ.get("RAY_ADDRESS") or "a new local Ray"
        raise RuntimeError(f"cannot connect to Ray at {where}: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    launcher = RayLauncher()
    started = not (settings.ray_address or os.environ.get("RAY_ADDRESS"))
    logger.info("joined %s%s", launcher.where(),
                " (a private local Ray started for this server: jobs launched on another cluster show as "
                "UNKNOWN; give --address to join that one)" if started else "")
    return JobManager(store, launcher, runs_root=settings.runs_root,
                      data_roots=settings.data_roots, sync_interval_s=settings.sync_interval_s,
                      stop_timeout_s=settings.stop_timeout_s, quotas=settings.quotas,
                      shared=settings.schedule, resume_prefixes=settings.resume_prefixes,
                      object_stores=settings.object_stores, azure_account=settings.azure_account,
                      max_live_jobs=settings.max_live_jobs, lock_timeout_s=settings.lock_timeout_s,
                      max_finished_jobs=settings.max_finished_jobs)


class BodyLimit:
    """413 for request bodies over `max_bytes`: at once from Content-Length, or while a chunked body is read."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await JSONResponse({"detail": "invalid Content-Length"}, 400)(scope, receive, send)
            if int(length) > self.max_bytes:
                return await self._too_large()(scope, receive, send)
            return await self.app(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self._detail())
            return msg

        return await self.app(scope, counted, send)

    def _detail(self) -> str:
        return f"request body is larger than the server's limit of {self.max_bytes} bytes"

    def _too_large(self) -> JSONResponse:
        return JSONResponse({"detail": self._detail()}, 413)


class PerUserLimit:
    """429 with Retry-After for a request beyond `max_inflight` of its token's requests being answered at
    once, before its body is read: one user's flood holds a bounded share of the request threads and of
    memory (bodies being parsed), and other users' reads keep their turn. Requests are counted per token
    the server knows (the admin, the read-only token, each user); an unknown or missing token counts as
    one caller ("anonymous", which the auth check then refuses). /healthz is not counted."""

    def __init__(self, app, settings: Settings, max_inflight: int):
        self.app, self.max_inflight = app, max_inflight
        self.tokens = [(t.encode(), who) for who, t in (("admin", settings.token), ("reader", settings.read_token),
                                                         *((f"user:{u}", t) for u, t in settings.user_tokens.items()))
                       if t]
        self.inflight: dict[str, int] = {}  # the event loop's thread only: no lock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/healthz":
            return await self.app(scope, receive, send)
        who = self._who(dict(scope["headers"]).get(b"authorization", b""))
        if self.inflight.get(who, 0) >= self.max_inflight:
            return await JSONResponse(
                {"detail": f"too many requests at once from this token (the server answers {self.max_inflight} at a "
                           "time per token, ELASTRON_MAX_REQUESTS_PER_USER); retry in a moment"},
                429, headers={"Retry-After": "1"})(scope, receive, send)
        self.inflight[who] = self.inflight.get(who, 0) + 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.inflight[who] -= 1
            if not self.inflight[who]:
                del self.inflight[who]

    def _who(self, header: bytes) -> str:
        scheme, _, given = header.partition(b" ")
        found = "anonymous"
        if scheme.lower() == b"bearer":
            for tok, who in self.tokens:  # every comparison made, as in authenticate()
                if secrets.compare_digest(given.strip(), tok) and found == "anonymous":
                    found = who
        return found


class SecurityHeaders:
    """Headers on every response: no framing (clickjacking of the dashboard's buttons), no MIME sniffing."""

    HEADERS = [(b"content-security-policy", b"frame-ancestors 'none'"), (b"x-frame-options", b"DENY"),
               (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), *self.HEADERS]}
            await send(msg)

        return await self.app(scope, receive, with_headers)


def create_app(*, jobs: JobManager | None = None, settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if getattr(app.state, "jobs", None) is None:
            app.state.jobs = await run_in_threadpool(default_manager, settings)
            app.state.registry = make_registry(app.state.jobs)
        await run_in_threadpool(app.state.jobs.start)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.jobs.close)

    # No /docs or /redoc: FastAPI's pages load Swagger UI from a CDN. /openapi.json is served.
    app = FastAPI(title="Elastron job control", version="1", docs_url=None, redoc_url=None,
                  description="Submit, watch and steer elastic training jobs. With a token configured, every "
                              "endpoint but /healthz needs `Authorization: Bearer TOKEN`: the admin token "
                              "(every job), the read-only token, or a user's token (their own jobs).",
                  lifespan=lifespan)
    app.state.settings = settings
    app.state.jobs = jobs
    app.state.registry = make_registry(jobs) if jobs is not None else None
    app.include_router(api_router)
    app.include_router(ops_router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.auth and settings.max_requests_per_user is not None:
        app.add_middleware(PerUserLimit, settings=settings, max_inflight=settings.max_requests_per_user)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts or ["*"]))
    app.add_middleware(SecurityHeaders)

    @app.exception_handler(JobNotFound)
    async def _not_found(request: Request, e: JobNotFound):
        return JSONResponse({"detail": str(e)}, 404)

    @app.exception_handler(JobConflict)
    async def _conflict(request: Request, e: JobConflict):
        return JSONResponse({"detail": str(e)}, 409)

    @app.exception_handler(JobForbidden)
    async def _forbidden(request: Request, e: JobForbidden):
        return JSONResponse({"detail": str(e)}, 403)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return JSONResponse({"detail": validation_detail(e.errors())}, 422)

    @app.exception_handler(SpecError)
    async def _spec(request: Request, e: SpecError):
        return JSONResponse({"detail": validation_detail([{"loc": ["body", *e.loc], "msg": e.msg,
                                                           "type": "value_error"}])}, 422)

    @app.exception_handler(JobUnavailable)
    async def _unavailable(request: Request, e: JobUnavailable):
        return JSONResponse({"detail": str(e)}, 503, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # whatever else went wrong stays in the server's log: a message, a path or a SQL error could tell
        # a caller about the server or another user's jobs
        ref = uuid.uuid4().hex[:8]
        logger.error("error %s on %s %s", ref, request.method, request.url.path, exc_info=e)
        return JSONResponse({"detail": f"internal error (reference {ref} in the server's log)"}, 500)

    return app


MAX_ERRORS = 20
"""A 422 lists at most this many of the request's errors."""
MAX_LOC = 16
"""An error's `loc` keeps at most this many parts (a deeply nested value's place, cut)."""
MAX_TEXT = 1000
"""Each part of `loc`, and each `msg`, keeps at most this many characters."""


def validation_detail(errors) -> list[dict]:
    """A 422's detail: each error's `loc`, `msg` and `type`, bounded (MAX_ERRORS, MAX_LOC, MAX_TEXT).
    The value refused (`input`, `ctx`) is not echoed: it may be nested as deep as the parser allows,
    which a recursive encoder cannot walk, or hold what JSON cannot carry (a non-finite number, a lone
    surrogate); a 422 must never become a 500 for the value it refuses."""
    out = []
    for err in list(errors)[:MAX_ERRORS]:
        loc = [x if isinstance(x, int) and not isinstance(x, bool) else _json_safe(str(x)[:MAX_TEXT])
               for x in list(err.get("loc", ()))[:MAX_LOC]]
        out.append({"loc": loc, "msg": _json_safe(str(err.get("msg", ""))[:MAX_TEXT]),
                    "type": _json_safe(str(err.get("type", ""))[:MAX_TEXT])})
    return out


def _json_safe(s: str) -> str:
    """`s` as strict JSON can hold it: what UTF-8 cannot encode (a lone surrogate) spelled as escapes."""
    return s if s.isascii() or _encodes(s) else s.encode("utf-8", "backslashreplace").decode("utf-8")


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def serve(address: str | None = None, host: str = "127.0.0.1", port: int = 8000, store: str | None = None, *,
          insecure: bool = False, tls_cert: str | None = None, tls_key: str | None = None) -> int:
    """`elastron serve`: the API on host:port (loopback by default), jobs on the Ray cluster at `address`,
    the job store at `store` (a SQLAlchemy URL or SQLite file path; default ELASTRON_STORE). A
    non-loopback address needs a token (or `insecure`); `tls_cert`/`tls_key` serve HTTPS."""
    import uvicorn

    from api.store import redact

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings.from_env(ray_address=address, store_url=store)
    except ValueError as e:
        logger.error("cannot start: %s", e)
        return 2
    if (tls_cert is None) != (tls_key is None):
        logger.error("cannot start: give --tls-cert and --tls-key together")
        return 2
    if _is_loopback(host):
        if settings.allowed_hosts is None:  # a DNS-rebinding page must not reach a loopback server
            settings.allowed_hosts = LOOPBACK_HOSTS
        logger.info("binding %s:%d: loopback only, other machines cannot reach it (use --host 0.0.0.0 to "
                    "expose it, with ELASTRON_API_TOKEN set)", host, port)
    elif not settings.auth and not insecure:
        logger.error("refusing to bind %s:%d with no token: anyone who can reach it could read, submit and stop "
                     "jobs. Set ELASTRON_API_TOKEN (and ELASTRON_READ_TOKEN / ELASTRON_USER_TOKENS), or pass "
                     "--insecure on a network you trust", host, port)
        return 2
    elif not settings.auth:
        logger.warning("binding %s:%d with no token (--insecure): anyone who can reach it can read, submit and "
                       "stop jobs", host, port)
    else:
        logger.info("binding %s:%d; every endpoint but /healthz needs a bearer token", host, port)
    if not tls_cert and not _is_loopback(host):
        logger.warning("serving plain HTTP on %s: tokens cross the network in clear; use --tls-cert/--tls-key "
                       "or a TLS-terminating proxy", host)
    logger.info("runs root %s, store %s, auth %s", settings.runs_root.resolve(), redact(settings.store_url),
                "on" if settings.auth else "off")
    Path(settings.runs_root).mkdir(parents=True, exist_ok=True)
    try:  # in the main thread, before binding: a Ray that cannot be reached is one clear line
        jobs = default_manager(settings)
    except Exception as e:
        logger.error("cannot start: %s", e)
        return 1
    uvicorn.run(create_app(jobs=jobs, settings=settings), host=host, port=port, log_level="info",
                ssl_certfile=tls_cert, ssl_keyfile=tls_key)
    return 0
