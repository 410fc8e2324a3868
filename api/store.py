"""The job store: specs, last statuses, events and metrics behind a SQLAlchemy URL (SQLAlchemy Core).

SQLite is the embedded default (a file path, ``sqlite:///PATH`` or ``:memory:``); PostgreSQL works with
``postgresql+psycopg://USER:PASSWORD@HOST/DB`` (``postgresql://`` means the same driver).

Schema (version 2; a version-1 store is upgraded in place on open):
  jobs(id PK, name, spec JSON, steps, workers, run_dir, created, updated, state, reason, status JSON, released,
       owner, idem_key, request JSON)
      A row is a service.server.job_record.JobRecord. `status` is the job's last JobStatus.to_dict()
      (service.control.status); `state`/`reason` are copied out of it so lists can filter without parsing JSON. `released` = 1 once the job is finished and its
      coordinator let go: nothing about it will change again. `owner`: the user who submitted it (None
      without users); `idem_key`/`request`: the submit's Idempotency-Key and the request it came with.
  events(job_id, idx, time, kind, data JSON)  PK (job_id, idx): idx is the coordinator's event index
  metrics(job_id, step, time, data JSON)      PK (job_id, step): a redone step (after a failure) replaces
                                              the row; the chart shows the run as it stands
  areas(job_id, field, place JSON, owner, deleted)  PK (job_id, field): the places a job holds
                                              (service.server.admission.Claim); `deleted` = 1 once the job
                                              was deleted (a tombstone, until an admin frees it)
  meta(key PK, value)                          schema_version
JSON is stored as text, so every dialect holds the same bytes (NaN and infinities become null).

SQLite: one writer at a time, serialised by a lock. A file on a local filesystem is in WAL mode, so the
API's request threads and its sync thread share it and a second server over the same file (a restart)
can read while the first still writes. WAL needs shared memory between the processes that open the
file, which a network filesystem does not give, so WAL is allowed only on the local types this module
names (`journal_mode`); on any other (a FUSE mount, an unknown type) the file keeps a rollback journal,
and a file on a known network filesystem (NFS, CIFS and the like) is refused (`network_filesystem`):
use PostgreSQL there. PostgreSQL: the engine's connection pool; each call is one transaction.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from sqlalchemy import (BigInteger, Column, Double, Integer, MetaData, Table, Text, create_engine,
                        event, func, select, update)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.pool import StaticPool

from service.server.admission import Claim, Place
from service.server.job_record import JobRecord
from service.control.status import JobStatus

SCHEMA_VERSION = 2

logger = logging.getLogger(__name__)

_md = MetaData()
_jobs = Table(
    "jobs", _md,
    Column("id", Text, primary_key=True), Column("name", Text, nullable=False),
    Column("spec", Text, nullable=False), Column("steps", BigInteger), Column("workers", Integer),
    Column("run_dir", Text, nullable=False), Column("created", Double, nullable=False),
    Column("updated", Double, nullable=False), Column("state", Text, nullable=False),
    Column("reason", Text, nullable=False, server_default=""), Column("status", Text, nullable=False),
    Column("released", Integer, nullable=False, server_default="0"),
    Column("owner", Text), Column("idem_key", Text), Column("request", Text),
)
_V2_COLUMNS = ("owner", "idem_key", "request")
_events = Table(
    "events", _md,
    Column("job_id", Text, primary_key=True), Column("idx", BigInteger, primary_key=True),
    Column("time", Double, nullable=False), Column("kind", Text, nullable=False), Column("data", Text, nullable=False),
)
_metrics = Table(
    "metrics", _md,
    Column("job_id", Text, primary_key=True), Column("step", BigInteger, primary_key=True),
    Column("time", Double), Column("data", Text, nullable=False),
)
_areas = Table(
    "areas", _md,
    Column("job_id", Text, primary_key=True), Column("field", Text, primary_key=True),
    Column("place", Text, nullable=False), Column("owner", Text),
    Column("deleted", Integer, nullable=False, server_default="0"),
)
_meta = Table("meta", _md, Column("key", Text, primary_key=True), Column("value", Text, nullable=False))

_INSERT = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}
_HINT = "use a file path, sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST/DB"


def store_url(url: str | Path) -> URL:
    """`url` as a SQLAlchemy URL: a bare path or ``:memory:`` becomes a SQLite URL, ``postgresql://``
    (and ``postgres://``) gets the psycopg driver. ValueError (one line) for anything else."""
    s = str(url)
    if not s.strip():
        raise ValueError(f"store URL must not be empty; {_HINT}")
    if s == ":memory:":
        return make_url("sqlite://")
    if "://" not in s:
        return URL.create("sqlite", database=s)
    try:
        u = make_url(s)
    except (ArgumentError, ValueError) as e:  # ValueError: e.g. a port that is not a number
        raise ValueError(f"store URL {s.split('://')[0]}://... cannot be parsed ({type(e).__name__}); {_HINT}") from None
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() not in _INSERT:
        raise ValueError(f"unsupported store URL {redact(u)!r}: only SQLite and PostgreSQL are supported; {_HINT}")
    return u


def redact(url: str | Path | URL) -> str:
    """The URL with its password hidden, for logs and messages."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return store_url(url).render_as_string(hide_password=True)
    except ValueError:
        return str(url).split("://")[0] + "://..." if "://" in str(url) else str(url)


NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "fuse.glusterfs",
                                  "fuse.cephfs", "lustre", "gpfs", "9p", "fuse.sshfs", "afs", "beegfs",
                                  "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "efs", "fuse.efs",
                                  "fuse.rclone", "fuse.blobfuse2", "fuse.blobfuse", "fuse.mountpoint-s3",
                                  "fuse.goofys", "fuse.geesefs"})
"""Filesystem types (as /proc/mounts names them) known to be shared over a network: a SQLite store there
is refused. Not a complete list: what it misses still gets no WAL (`journal_mode`)."""

LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs",
                                "overlay"})
"""Filesystem types on which SQLite's WAL mode is allowed: block-device (or memory) filesystems of one
kernel, whose shared memory (the -shm file SQLite maps) every process that opens the file sees. overlay
is a container's root: its writable layer is a directory on the host's local disk, private to one
container. Not here, so without WAL: any FUSE mount (fuse.*, fuseblk: a user-space process serves the
file, often from the network), virtiofs (a VM's share of its host's files), and any type not named."""


def network_filesystem(kind: str | None) -> bool:
    """Whether `kind` (a /proc/mounts type) is a known network filesystem (nfs4 as nfs)."""
    return kind is not None and (kind in NETWORK_FILESYSTEMS or kind.split(".")[0] in NETWORK_FILESYSTEMS)


def journal_mode(kind: str | None) -> str:
    """SQLite's journal mode for a store file on a filesystem of type `kind`: "wal" on a local type
    (LOCAL_FILESYSTEMS), else "delete", the rollback journal, which needs only file locks. None (the type
    cannot be told, e.g. not Linux) is not local."""
    return "wal" if kind in LOCAL_FILESYSTEMS else "delete"


def _unescape(field: str) -> str:
    """A /proc/mounts field with its octal escapes (\\040 for a space, \\011, \\012, \\134) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str | Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the filesystem `path` lies on, from the longest mount point that holds it (None when
    it cannot be told, e.g. not Linux)."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    full = os.path.realpath(path)
    best, kind = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = _unescape(parts[1])
        if (full == point or full.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def _engine(u: URL, fs_type: Callable[[Path], str | None]) -> Engine:
    if u.get_backend_name() != "sqlite":
        return create_engine(u, pool_pre_ping=True)
    memory = u.database in (None, "", ":memory:")
    mode = None  # a file's journal mode; none in memory
    if memory:  # one shared connection: each new one would be a new, empty database
        eng = create_engine(u, poolclass=StaticPool, connect_args={"check_same_thread": False})
    else:
        Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        kind = fs_type(Path(u.database).parent)
        if network_filesystem(kind):
            raise ValueError(f"the job store {u.database} lies on a {kind} filesystem: SQLite is not "
                             "safe on a network filesystem (WAL's shared memory and often its file locks do not "
                             "reach across machines), and two servers could corrupt it. Use PostgreSQL "
                             "(ELASTRON_STORE=postgresql+psycopg://USER:PASSWORD@HOST/DB) or a local disk "
                             "(a ReadWriteOnce volume)")
        mode = journal_mode(kind)
        if mode != "wal":
            logger.warning("job store %s: no WAL on a %s filesystem (WAL only on %s); a rollback journal "
                           "instead, so readers wait while a write commits", u.database, kind or "unknown",
                           ", ".join(sorted(LOCAL_FILESYSTEMS)))
        eng = create_engine(u, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(eng, "connect")
    def _pragmas(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        if mode is not None:  # set either way: a file keeps the mode it was last given
            cur.execute(f"PRAGMA journal_mode={mode.upper()}")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    return eng


class JobStore:
    """Thread-safe. `url`: a SQLAlchemy URL (SQLite or PostgreSQL), a file path, or ``:memory:``."""

    def __init__(self, url: str | Path, *, fs_type: Callable[[Path], str | None] = filesystem_type):
        """`fs_type(dir)`: the filesystem type a SQLite file's directory lies on (a seam for tests)."""
        u = store_url(url)
        self.url = redact(u)
        self.dialect = u.get_backend_name()
        try:
            self._engine = _engine(u, fs_type)
        except (ImportError, NoSuchModuleError) as e:
            raise ValueError(f"store URL {self.url!r} needs a database driver that is not installed ({e}); "
                             f"{_HINT}") from None
        # SQLite allows one writer: serialise here rather than wait on its file lock.
        self._lock = threading.Lock() if self.dialect == "sqlite" else contextlib.nullcontext()
        try:
            with self._tx() as c:
                _md.create_all(c)
                c.execute(self._insert(_meta).values(key="schema_version", value=str(SCHEMA_VERSION))
                          .on_conflict_do_nothing(index_elements=["key"]))
                found = c.execute(select(_meta.c.value).where(_meta.c.key == "schema_version")).scalar_one()
                if int(found) == 1:  # version 2 added columns to jobs: add them, keep every row
                    for col in _V2_COLUMNS:
                        c.exec_driver_sql(f"ALTER TABLE jobs ADD COLUMN {col} TEXT")
                    c.execute(update(_meta).where(_meta.c.key == "schema_version").values(value="2"))
                    found = "2"
        except OperationalError as e:
            self._engine.dispose()
            why = str(e.orig).strip().splitlines()[0] if e.orig is not None and str(e.orig).strip() else type(e).__name__
            raise RuntimeError(f"cannot open the job store {self.url}: {why}") from None
        if int(found) > SCHEMA_VERSION:
            self._engine.dispose()
            raise RuntimeError(f"store {self.url} has schema version {found}, newer than this server's "
                               f"{SCHEMA_VERSION}; upgrade Elastron")

    def close(self) -> None:
        with self._lock:
            self._engine.dispose()

    @contextlib.contextmanager
    def _tx(self):
        """One transaction, committed on success."""
        with self._lock, self._engine.begin() as conn:
            yield conn

    def _insert(self, table: Table):
        return _INSERT[self.dialect](table)

    def _upsert(self, table: Table, keys: list[str], rows: list[dict]) -> None:
        ins = self._insert(table)
        stmt = ins.on_conflict_do_update(index_elements=keys,
                                         set_={c.name: ins.excluded[c.name] for c in table.c if c.name not in keys})
        with self._tx() as c:
            c.execute(stmt, rows)

    # -- jobs --------------------------------------------------------------------------------------------
    def create(self, job: JobRecord, claims: Sequence[Claim] = ()) -> None:
        """Record the job and the places it holds, in one transaction."""
        st = job.status
        with self._tx() as c:
            if claims:
                c.execute(_areas.insert(), [_claim_row(a) for a in claims])
            c.execute(_jobs.insert().values(
                id=_text(job.id), name=_text(job.name), spec=_dumps(job.spec), steps=job.steps,
                workers=job.workers, run_dir=_text(job.run_dir), created=job.created, updated=job.updated,
                state=_text(st.state), reason=_text(st.reason or ""), status=_dumps(st.to_dict()),
                released=int(job.released), owner=job.owner, idem_key=job.idempotency_key,
                request=None if job.request is None else _dumps(job.request)))

    def get(self, job_id: str) -> JobRecord | None:
        with self._tx() as c:
            row = c.execute(select(_jobs).where(_jobs.c.id == _text(job_id))).mappings().first()
        return None if row is None else _job(row)

    def list(self, *, limit: int | None = None, offset: int = 0, owner: str | None = None) -> list[JobRecord]:
        """Jobs oldest first, `limit` of them from `offset`; only `owner`'s when given."""
        q = select(_jobs).order_by(_jobs.c.created, _jobs.c.id).limit(limit).offset(offset or None)
        if owner is not None:
            q = q.where(_jobs.c.owner == _text(owner))
        with self._tx() as c:
            rows = c.execute(q).mappings().all()
        return [_job(r) for r in rows]

    def count(self) -> int:
        with self._tx() as c:
            return c.execute(select(func.count()).select_from(_jobs)).scalar_one()

    def unsettled(self) -> list[JobRecord]:
        """Jobs whose record may still change: not finished, or finished but not yet released."""
        with self._tx() as c:
            rows = c.execute(select(_jobs).where(_jobs.c.released == 0).order_by(_jobs.c.created)).mappings().all()
        return [_job(r) for r in rows]

    def find_idempotent(self, owner: str | None, key: str) -> JobRecord | None:
        """The job `owner` submitted with Idempotency-Key `key`, with its `request`, or None."""
        q = select(_jobs).where(_jobs.c.idem_key == _text(key),
                                _jobs.c.owner.is_(None) if owner is None else _jobs.c.owner == _text(owner))
        with self._tx() as c:
            row = c.execute(q).mappings().first()
        return None if row is None else _job(row)

    def set_status(self, job_id: str, status: JobStatus) -> None:
        with self._tx() as c:
            c.execute(update(_jobs).where(_jobs.c.id == _text(job_id)).values(
                status=_dumps(status.to_dict()), state=_text(status.state), reason=_text(status.reason or ""),
                updated=time.time()))

    def mark_released(self, job_id: str) -> None:
        with self._tx() as c:
            c.execute(update(_jobs).where(_jobs.c.id == _text(job_id)).values(released=1))

    def delete(self, job_id: str) -> None:
        """Forget the job; the places it held stay recorded as its owner's (tombstones)."""
        with self._tx() as c:
            for table, col in ((_events, _events.c.job_id), (_metrics, _metrics.c.job_id), (_jobs, _jobs.c.id)):
                c.execute(table.delete().where(col == _text(job_id)))
            c.execute(update(_areas).where(_areas.c.job_id == _text(job_id)).values(deleted=1))

    # -- who holds which place -----------------------------------------------------------------------------
    def claims(self) -> list[Claim]:
        """Every place a job holds or held (tombstones of deleted jobs included)."""
        with self._tx() as c:
            rows = c.execute(select(_areas).order_by(_areas.c.job_id, _areas.c.field)).mappings().all()
        return [Claim(job_id=r["job_id"], owner=r["owner"], field=r["field"], place=Place(tuple(json.loads(r["place"]))),
                      deleted=bool(r["deleted"])) for r in rows]

    def add_claims(self, claims: Sequence[Claim]) -> None:
        """Record places of jobs admitted before the store kept them (a job's existing rows stay)."""
        if claims:
            ins = self._insert(_areas).on_conflict_do_nothing(index_elements=["job_id", "field"])
            with self._tx() as c:
                c.execute(ins, [_claim_row(a) for a in claims])

    def free_claims(self, job_id: str) -> int:
        """Forget the tombstones of deleted job `job_id` (an admin's act); how many were freed."""
        with self._tx() as c:
            return c.execute(_areas.delete().where(_areas.c.job_id == _text(job_id), _areas.c.deleted == 1)).rowcount

    def files(self) -> list[Path]:
        """The store's own files on the local disk (a SQLite file and its journal, WAL and shared-memory
        files), which no job may name; none for PostgreSQL or memory."""
        db = self._engine.url.database if self.dialect == "sqlite" else None
        if not db or db == ":memory:":
            return []
        base = Path(db).resolve()
        return [base, *(base.with_name(base.name + s) for s in ("-journal", "-wal", "-shm"))]

    # -- events and metrics ------------------------------------------------------------------------------
    def add_events(self, job_id: str, start: int, events: list[dict]) -> None:
        if events:
            self._upsert(_events, ["job_id", "idx"], [
                {"job_id": _text(job_id), "idx": start + i, "time": e.get("time") or 0.0, "kind": _text(e.get("kind") or ""),
                 "data": _dumps(e)} for i, e in enumerate(events)])

    def events(self, job_id: str, since: int = 0, limit: int | None = None) -> list[dict]:
        q = (select(_events.c.data).where(_events.c.job_id == _text(job_id), _events.c.idx >= max(0, since))
             .order_by(_events.c.idx).limit(limit))
        with self._tx() as c:
            return [json.loads(d) for d in c.execute(q).scalars()]

    def event_count(self, job_id: str) -> int:
        with self._tx() as c:
            return c.execute(select(func.count()).select_from(_events).where(_events.c.job_id == _text(job_id))).scalar_one()

    def add_metrics(self, job_id: str, rows: list[dict]) -> None:
        if rows:
            self._upsert(_metrics, ["job_id", "step"], [
                {"job_id": _text(job_id), "step": int(m["step"]), "time": m.get("time"), "data": _dumps(m)} for m in rows])

    def metrics(self, job_id: str, since: int = 0, limit: int | None = None, stride: int = 1) -> list[dict]:
        """Rows after step `since`, oldest first; with `stride` > 1 only steps that are multiples of it
        (a long run's chart in a bounded number of points)."""
        q = (select(_metrics.c.data).where(_metrics.c.job_id == _text(job_id), _metrics.c.step > since)
             .order_by(_metrics.c.step).limit(limit))
        if stride > 1:
            q = q.where(_metrics.c.step % stride == 0)
        with self._tx() as c:
            return [json.loads(d) for d in c.execute(q).scalars()]

    def last_step(self, job_id: str) -> int:
        with self._tx() as c:
            v = c.execute(select(func.max(_metrics.c.step)).where(_metrics.c.job_id == _text(job_id))).scalar()
        return v or 0


def _claim_row(a: Claim) -> dict:
    return {"job_id": _text(a.job_id), "field": a.field, "place": json.dumps(list(a.place.parts)),
            "owner": a.owner, "deleted": int(a.deleted)}


def _text(s: str) -> str:
    """PostgreSQL text cannot hold NUL: every dialect stores U+FFFD instead (JSON columns escape it)."""
    return s.replace("\x00", "\ufffd") if isinstance(s, str) else s


def _finite(v):
    """NaN and infinities as None: JSON has no such numbers, and a diverged loss must not break a response."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _dumps(v) -> str:
    return json.dumps(_finite(v), default=str)


def _job(row) -> JobRecord:
    return JobRecord(
        id=row["id"], name=row["name"], spec=json.loads(row["spec"]), run_dir=row["run_dir"], created=row["created"],
        updated=row["updated"], status=JobStatus.from_dict(json.loads(row["status"])), steps=row["steps"],
        workers=row["workers"], released=bool(row["released"]), owner=row["owner"], idempotency_key=row["idem_key"],
        request=None if row["request"] is None else json.loads(row["request"]))
