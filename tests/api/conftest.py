"""A throwaway PostgreSQL for the job store tests: pgserver (a dev dependency) runs its bundled server
from a temporary directory, over a Unix socket only. Each test gets a fresh database.

As root, pgserver runs PostgreSQL (which refuses root) as a system user `pgserver`, created with
useradd on first use, and makes the data directory's parent folders traversable for it; the data
directory is a new folder under the system temp dir, so no existing folder's mode changes in practice."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pg_server():
    pgserver = pytest.importorskip("pgserver", reason="pgserver is not installed: pip install -e '.[dev]'")
    # Short path: the server's socket lives there too, and socket paths are limited to ~100 bytes.
    data = Path(tempfile.mkdtemp(prefix="elastron-pg-"))
    try:
        srv = pgserver.get_server(data, cleanup_mode="delete")
    except Exception as e:  # e.g. running as root on a machine without useradd
        shutil.rmtree(data, ignore_errors=True)
        pytest.skip(f"PostgreSQL (pgserver) could not start on this machine: {type(e).__name__}: {e}")
    try:
        yield srv
    finally:
        srv.cleanup()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server) -> str:
    """A SQLAlchemy URL of an empty database, dropped after the test."""
    import psycopg

    admin = pg_server.get_uri()  # postgresql://postgres:@/postgres?host=SOCKET_DIR
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    yield pg_server.get_uri(name).replace("postgresql://", "postgresql+psycopg://", 1)
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
