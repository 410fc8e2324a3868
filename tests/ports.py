"""The one free-port helper of the tests (and the benchmarks, which import it from here)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now. It is released before the caller binds
    it, so another process can take it in between: callers that bind it retry on EADDRINUSE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
