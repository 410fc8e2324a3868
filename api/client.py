"""A small HTTP client for the job API (httpx), used by the `elastron` client commands and usable from
notebooks. Every failure is an `APIError` whose message is one line fit to show a person."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from service.control.commands import Pause, Resume, SetWorkers, Stop, to_json

if TYPE_CHECKING:  # httpx is imported when a client is made, so `elastron --help` stays instant
    import httpx

DEFAULT_SERVER = "http://127.0.0.1:8000"


class APIError(Exception):
    """The server answered with an error (status >= 400), or did not answer (status None)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerUnreachable(APIError):
    pass


def error_text(r: httpx.Response) -> str:
    """One line from an error response: the detail string, or each field error as `field.path: message`."""
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, list):
        parts = []
        for e in detail:
            loc = [str(x) for x in (e.get("loc") or []) if x != "body"] if isinstance(e, dict) else []
            msg = e.get("msg", e) if isinstance(e, dict) else e
            parts.append(f"{'.'.join(loc)}: {msg}" if loc else str(msg))
        text = "; ".join(parts)
    elif detail is not None:
        text = str(detail)
    else:
        text = r.text.strip() or r.reason_phrase
    return f"{r.status_code} {' '.join(text.split())}"


class Client:
    def __init__(self, server: str | None = None, token: str | None = None, *, timeout: float = 60.0,
                 transport: httpx.BaseTransport | None = None):
        import httpx

        self.server = (server or os.environ.get("ELASTRON_SERVER") or DEFAULT_SERVER).rstrip("/")
        token = token if token is not None else os.environ.get("ELASTRON_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, *, retries: int = 0, **kw) -> Any:
        """`retries`: how often a 503 (the job's coordinator busy or restarting) is tried again, after the
        server's Retry-After (at most 2 s). A 429 (this token's requests at once are at the server's limit)
        is tried again up to 3 times, whatever `retries`."""
        import httpx

        try:
            r = self._http.request(method, path, **kw)
            busy = 3
            while (r.status_code == 503 and retries > 0) or (r.status_code == 429 and busy > 0):
                if r.status_code == 503:
                    retries -= 1
                else:
                    busy -= 1
                time.sleep(_retry_after(r.headers.get("retry-after")))
                r = self._http.request(method, path, **kw)
        except httpx.TimeoutException:
            raise ServerUnreachable(f"the Elastron server at {self.server} did not answer in time") from None
        except httpx.TransportError as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ServerUnreachable(f"cannot reach the Elastron server at {self.server} ({why}); is `elastron serve` "
                                    "running? (set --server or ELASTRON_SERVER)") from None
        if r.status_code >= 400:
            raise APIError(error_text(r), r.status_code)
        try:
            return r.json()
        except ValueError:
            raise APIError(f"{r.status_code} the server at {self.server} answered with non-JSON "
                           f"({r.headers.get('content-type', 'no content type')}); is it an Elastron server?",
                           r.status_code) from None

    # -- jobs --------------------------------------------------------------------------------------------
    def submit(self, spec: dict, *, steps: int | None = None, workers: int | None = None,
               run_dir: str | None = None) -> dict:
        body = {"spec": spec, **{k: v for k, v in (("steps", steps), ("workers", workers), ("run_dir", run_dir))
                                 if v is not None}}
        return self._request("POST", "/api/v1/jobs", json=body)

    def jobs(self) -> list[dict]:
        return self._request("GET", "/api/v1/jobs")

    def job(self, job_id: str) -> dict:
        return self._request("GET", f"/api/v1/jobs/{job_id}")

    def events(self, job_id: str, since: int = 0) -> list[dict]:
        return self._request("GET", f"/api/v1/jobs/{job_id}/events", params={"since": since})

    def metrics(self, job_id: str, since: int = 0) -> list[dict]:
        return self._request("GET", f"/api/v1/jobs/{job_id}/metrics", params={"since": since})

    def checkpoints(self, job_id: str) -> dict:
        return self._request("GET", f"/api/v1/jobs/{job_id}/checkpoints")

    def command(self, job_id: str, cmd: SetWorkers | Pause | Resume | Stop) -> dict:
        """Send a user's command: a resize with its range as the body, the others as bare POSTs."""
        body = to_json(cmd)["args"] if isinstance(cmd, SetWorkers) else None
        return self._request("POST", f"/api/v1/jobs/{job_id}/{cmd.kind}", json=body, retries=5)

    def delete(self, job_id: str) -> dict:
        """Stop and forget the job; a 503 (another command for it still being delivered) is retried."""
        return self._request("DELETE", f"/api/v1/jobs/{job_id}", retries=5)

    def cluster(self) -> dict:
        return self._request("GET", "/api/v1/cluster")


def _retry_after(value: str | None) -> float:
    """Seconds to wait for a Retry-After header (seconds; a date or nothing counts as 1), at most 2."""
    try:
        return max(0.0, min(2.0, float(value)))
    except (TypeError, ValueError):
        return 1.0
