"""Admission of a job request's locations: every place a request names (a path or a URL) is put in one
canonical form (`canonical`) and judged by one rule (`Admission`), before anything looks at it.

The fields that name a place are listed once, in LOCATION_FIELDS, each with its use:
  DATA    data.path, data.val_path, model.init_from: read by the workers. A local path inside one of
          the server's data roots (checked before the disk is looked at, so a request cannot probe what
          exists elsewhere).
  WRITE   run_dir, checkpoint.dir: written (and deleted from) by the job. A local path inside the runs
          root, or a URL inside an object store the operator allows (ELASTRON_OBJECT_STORES). Never the
          job store's own files, never inside a shared resume prefix (read-only to everyone), and never
          overlapping a place another owner holds.
  RESUME  checkpoint.resume_from: read as checkpoints. Inside the runs root, an allowed object store or
          a resume prefix; a user may name only places they hold, or a resume prefix; an admin any.

Who holds a place is recorded in the job store when a job is admitted (`Claim`), and stays recorded
after the job is deleted (a tombstone: its files stay, so its checkpoints are still that owner's) until
an admin frees it. An owner may write again into their own tombstoned places; nobody else may.

The canonical form (`Place`) makes two spellings of the same location compare equal: local paths are
absolute and resolved (symlinks followed, '..' refused); URL schemes are lower case and their aliases
become one scheme (s3a/s3n -> s3, gcs -> gs, az/abfss -> abfs); bucket and host names are lower case; an
Azure URL's account is explicit (`container@account.dfs|blob.core.windows.net`, or the operator's default
account), HDFS has its port (8020 by default). Forms that cannot be compared safely (chained `a::b` URLs,
query strings, user info, S3 access-point ARNs, an HDFS URL without a namenode) are refused.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.server.specs import SpecError

__all__ = ["Admission", "Claim", "LOCATION_FIELDS", "Place", "REMOTE_SCHEMES", "SCHEME_ALIASES", "Use", "canonical",
           "check_paths", "field_name", "place_of"]


class Use(enum.Enum):
    DATA = "data"
    WRITE = "write"
    RESUME = "resume"


LOCATION_FIELDS: dict[tuple[str, ...], Use] = {
    ("run_dir",): Use.WRITE,
    ("spec", "checkpoint", "dir"): Use.WRITE,
    ("spec", "checkpoint", "resume_from"): Use.RESUME,
    ("spec", "data", "path"): Use.DATA,
    ("spec", "data", "val_path"): Use.DATA,
    ("spec", "model", "init_from"): Use.DATA,
}
"""Every field of a submit request that names a place, as its path in the request body, with its use.
tests/service/test_admission.py walks the request schema and fails on a field that names a place and
is missing here."""

REMOTE_SCHEMES = frozenset({"s3", "s3a", "s3n", "gs", "gcs", "az", "abfs", "abfss", "hdfs"})
"""fsspec URL schemes a WRITE or RESUME place may use (object stores and HDFS), each still only inside
an allowed store. file:// is a local path; any other scheme is refused."""

SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs", "az": "abfs", "abfss": "abfs"}
"""URL schemes fsspec reads from the same store as another: compared as that one."""

MAX_LOCATION_CHARS = 4096
"""The longest location a request may name (Linux's PATH_MAX): checked before anything else is done
with it, so that judging a location costs time linear in at most this many characters."""

_AZURE_HOSTS = (".dfs.core.windows.net", ".blob.core.windows.net")
HDFS_PORT = 8020
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)


def field_name(loc: Sequence[str | int]) -> str:
    """A request field as a message names it: ("spec", "data", "path") -> "data.path"."""
    return ".".join(str(x) for x in loc if x != "spec")


@dataclass(frozen=True, slots=True)
class Place:
    """A location in canonical form: its parts, the scheme first ("file://" for a local path, then the
    resolved path's parts; "s3://" then bucket and key parts; "abfs://" then account, container, path;
    "hdfs://" then host:port, path). Two places are the same location exactly when their parts are."""

    parts: tuple[str, ...]

    @property
    def local(self) -> bool:
        return self.parts[0] == "file://"

    @property
    def path(self) -> Path:
        """A local place as a Path."""
        return Path(*self.parts[1:])

    def within(self, other: "Place") -> bool:
        """Whether this place is `other` or lies inside it."""
        return len(self.parts) >= len(other.parts) and self.parts[:len(other.parts)] == other.parts

    def overlaps(self, other: "Place") -> bool:
        """Whether one of the two is, or lies inside, the other."""
        return self.within(other) or other.within(self)

    def __str__(self) -> str:
        if self.local:
            return str(self.path)
        return self.parts[0] + "/".join(self.parts[1:])


def _checked_text(where: Any, loc: Sequence[str | int]) -> str:
    """`where` if it is a non-blank string without NUL bytes of at most MAX_LOCATION_CHARS, else a SpecError."""
    name = field_name(loc)
    if isinstance(where, str) and len(where) > MAX_LOCATION_CHARS:
        raise SpecError(loc, f"{name} {where[:60]!r}... is {len(where)} characters long; a location may have at "
                             f"most {MAX_LOCATION_CHARS}")
    if not isinstance(where, str) or not where.strip() or "\x00" in where:
        raise SpecError(loc, f"{name} {where!r} must be a non-blank path without NUL bytes")
    return where


def canonical(where: Any, loc: Sequence[str | int] = ("location",), *, azure_account: str | None = None,
              resolve: bool = True) -> Place:
    """`where` (a local absolute path, a file:// URL, or an object store's / HDFS URL) as a Place, or a
    SpecError naming `loc` that says what is wrong. Looks at the disk only to resolve symlinks, and not at
    all with `resolve=False` (a local path is then taken as written: the lexical place)."""
    name = field_name(loc)
    where = _checked_text(where, loc)
    if "::" in where:
        raise SpecError(loc, f"{name} {where!r}: chained URLs (a::b) are not accepted; give one path or URL")
    m = _URL.match(where)
    if m is None:
        return _local(where, loc, resolve)
    scheme, rest = m.group(1), m.group(2)
    if scheme != scheme.lower():
        raise SpecError(loc, f"{name} {where!r}: write the scheme in lower case ({scheme.lower()}://); the "
                             "workers' storage reads schemes as written")
    if scheme == "file":
        return _local(rest, loc, resolve)
    if scheme == "memory":
        raise SpecError(loc, f"{name} {where!r}: memory:// lives in one process only, so its checkpoints cannot "
                             "survive a restart or reach other workers; use a path or an object store")
    if scheme not in REMOTE_SCHEMES:
        raise SpecError(loc, f"{name} {where!r}: a URL's scheme must be one of {', '.join(sorted(REMOTE_SCHEMES))} "
                             "(or give a local path)")
    if any(c in rest for c in "?#\\") or any(c.isspace() for c in rest):
        raise SpecError(loc, f"{name} {where!r}: a URL here must not hold '?', '#', '\\' or white space")
    host, _, key = rest.partition("/")
    parts = [p for p in key.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise SpecError(loc, f"{name} {where!r} must not contain '..'")
    scheme = SCHEME_ALIASES.get(scheme, scheme)
    host = host.lower()
    if scheme == "abfs":
        return Place(("abfs://", *_azure(host, where, loc, azure_account), *parts))
    if not host:
        raise SpecError(loc, f"{name} {where!r} names no {'namenode' if scheme == 'hdfs' else 'bucket'}: "
                             f"write {scheme}://{'HOST' if scheme == 'hdfs' else 'BUCKET'}/...")
    if "@" in host:
        raise SpecError(loc, f"{name} {where!r}: user information in a URL is not accepted")
    if scheme == "hdfs":
        h, colon, port = host.partition(":")
        if colon and not (port.isascii() and port.isdigit()):
            raise SpecError(loc, f"{name} {where!r}: the port must be a number (ASCII digits 0-9)")
        return Place(("hdfs://", f"{h}:{int(port) if colon else HDFS_PORT}", *parts))
    if ":" in host:  # an S3 access-point ARN, or a port on a bucket name
        raise SpecError(loc, f"{name} {where!r}: name the bucket itself (s3://BUCKET/...), not an access point")
    return Place((f"{scheme}://", host, *parts))


def _local(path: str, loc: Sequence[str | int], resolve: bool = True) -> Place:
    name = field_name(loc)
    p = Path(path)
    if not p.is_absolute():
        raise SpecError(loc, f"{name} {path!r} must be an absolute path")
    if ".." in p.parts:
        raise SpecError(loc, f"{name} {path!r} must not contain '..'")
    if not resolve:
        return Place(("file://", *p.parts))
    try:
        full = p.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise SpecError(loc, f"{name} {path!r} cannot be resolved: {type(e).__name__}") from None
    return Place(("file://", *full.parts))


def _azure(host: str, where: str, loc, default_account: str | None) -> tuple[str, str]:
    """(account, container) of an abfs:// URL's host part: `container@account.dfs.core.windows.net`
    (or .blob.), or a bare `container` in the operator's default account."""
    name = field_name(loc)
    container, at, account_host = host.partition("@")
    if at:
        suffix = next((s for s in _AZURE_HOSTS if account_host.endswith(s)), None)
        account = account_host[:-len(suffix)] if suffix else ""
        if not account or "." in account or ":" in account:
            raise SpecError(loc, f"{name} {where!r}: an Azure URL's host must be CONTAINER@ACCOUNT.dfs.core.windows.net "
                                 "(or .blob.core.windows.net)")
    elif default_account:
        account = default_account.lower()
    else:
        raise SpecError(loc, f"{name} {where!r}: name the storage account (abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/...): "
                             "this server has no default Azure account")
    if not container or ":" in container:
        raise SpecError(loc, f"{name} {where!r} names no container")
    return account, container


@dataclass(frozen=True, slots=True)
class Claim:
    """A place a job holds, as the store records it: `deleted` once the job was deleted (a tombstone:
    still its owner's until an admin frees it)."""

    job_id: str
    owner: str | None
    field: str
    """"run_dir" or "checkpoint.dir"."""
    place: Place
    deleted: bool = False


def _get(spec: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(spec, dict):
            return None
        spec = spec.get(k)
    return spec


class Admission:
    """The one judge of where a job may read and write. `runs_root`: every local WRITE place lies inside
    it. `data_roots`: every DATA place lies inside one. `object_stores`: URLs (each a store's root, e.g.
    s3://ckpts, abfs://c@acct.dfs.core.windows.net, hdfs://nn:8020/jobs) inside which WRITE and RESUME
    places may lie. `resume_prefixes`: places every user may resume from and nobody may write into.
    `reserved`: local files nobody's job may name or hold (the job store's). `azure_account`: the account
    of an abfs:// URL that names none."""

    def __init__(self, *, runs_root: str | Path, data_roots: Sequence[str | Path] = (),
                 object_stores: Sequence[str] = (), resume_prefixes: Sequence[str] = (),
                 reserved: Sequence[str | Path] = (), azure_account: str | None = None):
        self.azure_account = azure_account
        self.runs_root = Path(runs_root).resolve()
        self.data_roots = [Path(r).resolve() for r in data_roots]
        self._spellings: dict[Use, list[Path]] = {
            Use.DATA: _spellings(data_roots), Use.WRITE: _spellings([runs_root]),
            Use.RESUME: _spellings([runs_root, *(p for p in resume_prefixes if not _URL.match(p))])}
        self._prefix_spellings = _spellings(p for p in resume_prefixes if not _URL.match(p))
        """Each use's local roots as given and as resolved: what a location is judged against, as written,
        before the disk is looked at (`_lexically_inside`)."""
        for r in self.data_roots:
            if r == self.runs_root or r in self.runs_root.parents or self.runs_root in r.parents:
                raise ValueError(f"data root {r} holds the runs root {self.runs_root} (or lies inside it): a job "
                                 "could read other jobs' files and the job store; give data roots beside it")
        self.stores = [self._setting(s, "ELASTRON_OBJECT_STORES") for s in object_stores]
        for s in self.stores:
            if s.local:
                raise ValueError(f"ELASTRON_OBJECT_STORES: {s} is a local path; list object-store URLs only")
        self.resume_prefixes = [self._setting(p, "ELASTRON_RESUME_PREFIXES") for p in resume_prefixes]
        self.reserved = [Place(("file://", *Path(r).resolve().parts)) for r in reserved]

    def _setting(self, where: str, env: str) -> Place:
        try:
            return self.canonical(where, (env,))
        except SpecError as e:
            raise ValueError(f"{env}: {e.msg}") from None

    def canonical(self, where: Any, loc: Sequence[str | int], use: Use | None = None) -> Place:
        """`where` as a Place; with `use`, a local path is first judged as written against that use's roots
        (`_lexically_inside`), so that no path outside them is resolved: the disk is looked at only for a
        path that may be inside."""
        if use is not None:
            self._lexically_inside(canonical(where, loc, azure_account=self.azure_account, resolve=False),
                                   where, loc, use)
        return canonical(where, loc, azure_account=self.azure_account)

    def _lexically_inside(self, p: Place, where: Any, loc: Sequence[str | int], use: Use) -> None:
        """A SpecError, the one its use gives, when the local place `p` (as written) lies in none of the use's
        roots (a WRITE place: strictly inside the runs root). Time linear in the length of `where`."""
        if not p.local:
            return
        path = p.path
        if use is Use.WRITE:  # strictly inside the runs root; in a resume prefix: refused as read-only below
            inside = any(r in path.parents for r in self._spellings[use]) or any(
                path == r or r in path.parents or path in r.parents for r in self._prefix_spellings)
        else:
            inside = any(path == r or r in path.parents for r in self._spellings[use])
        if inside:
            return
        if use is Use.DATA:
            raise self._outside_data(where, loc)
        raise SpecError(loc, f"{field_name(loc)} {where!r} must be a directory inside the runs root {self.runs_root}")

    # -- each use ----------------------------------------------------------------------------------------
    def data(self, where: Any, loc: Sequence[str | int]) -> Place:
        """A DATA place: a local path (as the workers open it: no file:// URL), inside a data root."""
        where = _checked_text(where, loc)
        if _URL.match(where):
            raise SpecError(loc, f"{field_name(loc)} {where[:200]!r}: the workers open this as a local file; give "
                                 "it as an absolute path, not a URL")
        p = self.canonical(where, loc, Use.DATA)
        if not p.local or not any(p.path == r or r in p.path.parents for r in self.data_roots):
            raise self._outside_data(where, loc)
        return p

    def _outside_data(self, where: Any, loc: Sequence[str | int]) -> SpecError:
        roots = " or ".join(str(r) for r in self.data_roots) or "(none configured)"
        return SpecError(loc, f"{field_name(loc)} {where!r} is outside the server's data roots: {roots} "
                              "(the server's ELASTRON_DATA_ROOTS)")

    def run_dir(self, run_dir: str | None, default_name: str, loc: Sequence[str | int] = ("run_dir",)) -> Place:
        """The run directory: `run_dir` relative to the runs root (or absolute inside it), or the default
        name there; a WRITE place."""
        if run_dir is None:
            return self.write(str(self.runs_root / default_name), loc)
        run_dir = _checked_text(run_dir, loc)
        if _URL.match(run_dir):
            raise SpecError(loc, f"{field_name(loc)} {run_dir!r} must be a directory inside the runs root "
                                 f"{self.runs_root}, not a URL")
        p = Path(run_dir)
        return self.write(str(p if p.is_absolute() else self.runs_root / p), loc)

    def write(self, where: Any, loc: Sequence[str | int]) -> Place:
        """A WRITE place: inside the runs root or an allowed object store; not the store's files; not in
        a resume prefix; not an object store's root (which holds every other job's places in it). Whose it
        is: `check_claims`."""
        p = self.canonical(where, loc, Use.WRITE)
        name = field_name(loc)
        if any(p.overlaps(r) for r in self.resume_prefixes):
            raise SpecError(loc, f"{name} {where!r} overlaps a shared resume prefix (ELASTRON_RESUME_PREFIXES), "
                                 f"which is read-only to every job; choose another {name}")
        if any(p == s for s in self.stores):
            raise SpecError(loc, f"{name} {where!r} is the root of an object store this server allows; name a "
                                 f"directory inside it ({str(p).rstrip('/')}/YOUR-DIR)")
        self._inside_allowed(p, where, loc, also=())
        if any(p.overlaps(r) for r in self.reserved):
            raise SpecError(loc, f"{name} {where!r} is reserved for the server's own files; choose another {name}")
        return p

    def resume(self, where: Any, loc: Sequence[str | int], *, owner: str | None, claims: Iterable[Claim]) -> Place:
        """A RESUME place: inside the runs root, an allowed store or a resume prefix; for a user (owner
        not None) also inside a resume prefix or a place the user holds (a tombstone included)."""
        p = self.canonical(where, loc, Use.RESUME)
        if any(p.within(r) for r in self.resume_prefixes):
            return p
        self._inside_allowed(p, where, loc, also=self.resume_prefixes)
        if any(p.overlaps(r) for r in self.reserved):
            raise SpecError(loc, f"{field_name(loc)} {where!r} is reserved for the server's own files")
        if owner is None or any(c.owner == owner and p.within(c.place) for c in claims):
            return p
        raise SpecError(loc, f"{field_name(loc)} {where!r} is not a directory of one of your jobs"
                             + (" nor under the server's resume prefixes (ELASTRON_RESUME_PREFIXES)"
                                if self.resume_prefixes else "") + ": name your own job's run or checkpoint directory")

    def _inside_allowed(self, p: Place, where: Any, loc, *, also: Sequence[Place]) -> None:
        name = field_name(loc)
        if p.local:
            if self.runs_root not in p.path.parents:
                raise SpecError(loc, f"{name} {where!r} must be a directory inside the runs root {self.runs_root}")
            return
        if not any(p.within(s) for s in (*self.stores, *also)):
            listed = ", ".join(str(s) for s in self.stores) or "none"
            raise SpecError(loc, f"{name} {where!r} is not inside an object store this server allows ({listed}; "
                                 "the server's ELASTRON_OBJECT_STORES)")

    # -- the whole request -------------------------------------------------------------------------------
    def check(self, spec: Any, *, run_dir: str | None, default_name: str, owner: str | None,
              claims: Iterable[Claim]) -> dict[str, Place]:
        """Every place of a request judged by its use (LOCATION_FIELDS); the WRITE places by name
        ("run_dir", "checkpoint.dir") for `check_claims`."""
        claims = list(claims)
        out: dict[str, Place] = {}
        for loc, use in LOCATION_FIELDS.items():
            if loc == ("run_dir",):
                out["run_dir"] = self.run_dir(run_dir, default_name)
                continue
            v = _get(spec, *loc[1:])
            if v is None:
                continue
            if use is Use.DATA and loc[1] == "data" and _get(spec, "data", "source") == "synthetic":
                if loc[2] == "path":
                    continue  # synthetic data reads no file (a val_path there is JobConfig's error)
            if use is Use.DATA:
                self.data(v, loc)
            elif use is Use.WRITE:
                out[field_name(loc)] = self.write(v, loc)
            else:
                self.resume(v, loc, owner=owner, claims=claims)
        if owner is not None:
            for name, p in out.items():
                self._unclaimed(p, ("run_dir",) if name == "run_dir" else ("spec", *name.split(".")), claims)
        return out

    def _unclaimed(self, p: Place, loc: Sequence[str | int], claims: Sequence[Claim]) -> None:
        """A SpecError when a local WRITE place, or a directory on its way down from the runs root, exists
        already and overlaps no place a job holds: files no job made (a hand-made run, `elastron run`'s)
        are nobody's to take. An operator adopts them (docs/hardening.md)."""
        if not p.local:
            return
        root = len(self.runs_root.parts)
        for depth in range(root + 1, len(p.parts)):
            d = Place(p.parts[:depth + 1])
            if not d.path.exists():
                return
            if not any(d.overlaps(c.place) for c in claims):
                raise SpecError(loc, f"{field_name(loc)} {str(p)!r}: {d.path} already exists in the runs root and "
                                     "no job holds it; choose another directory (an admin may adopt it)")

    def check_paths(self, spec: Any, *, run_dir: str | None) -> None:
        """The ownership-free part of `check`, for callers without owners (`elastron run`, tests)."""
        self.check(spec, run_dir=run_dir, default_name="job", owner=None, claims=())


def _spellings(roots: Iterable[str | Path]) -> list[Path]:
    """Each local root as given (made absolute) and resolved."""
    out: list[Path] = []
    for r in roots:
        for p in (Path(r).absolute(), Path(r).resolve()):
            if p not in out:
                out.append(p)
    return out


def place_of(where: str, *, runs_root: str | Path | None = None, azure_account: str | None = None) -> Place | None:
    """A stored job's place (its run_dir or checkpoint.dir as recorded), or None if it no longer parses
    (a record from before these rules): used to record claims of jobs admitted earlier."""
    try:
        return canonical(where, azure_account=azure_account)
    except SpecError:
        return None


def check_paths(spec: Any, *, run_dir: str | None, runs_root: Path, data_roots: Sequence[Path],
                object_stores: Sequence[str] = ()) -> None:
    """Every place of a request checked by the rules that need no owner (see Admission)."""
    Admission(runs_root=runs_root, data_roots=data_roots, object_stores=object_stores).check_paths(
        spec, run_dir=run_dir)
