"""Where checkpoints live: a local directory or an fsspec URL (s3://..., gs://..., memory://...).

The two differ in how a checkpoint is committed. A local (POSIX) directory gets the classic protocol:
write into a hidden temporary directory, fsync every file and the directory, write the manifest last,
rename into place, fsync the parent. Object stores have no atomic directory rename (s3fs "renames" by
copying every object), so there the checkpoint is written in place and the manifest, a single atomic
PUT written after every shard is complete, is the commit: a directory without it is never loaded.

The shard files themselves are written by `writer.ShardWriter` through `open` (fsspec) or raw file
descriptors (local); this module stays free of torch so that tools which only inspect checkpoints do not
import it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import IO, Any

log = logging.getLogger(__name__)

_HASH_BLOCK = 8 << 20


def open_storage(root: str | os.PathLike[str], **storage_options: Any) -> "Storage":
    """Local storage for plain paths and file:// URLs, fsspec storage for any other URL."""
    text = os.fspath(root)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if "://" in text:
        return FsspecStorage(text, **storage_options)
    return LocalStorage(text)


class Storage:
    """File operations the checkpoint code needs, on string paths under `root`."""

    root: str
    atomic_rename: bool
    """True: commit by renaming a temporary directory; False: write in place, manifest last."""

    def join(self, *parts: str) -> str:
        raise NotImplementedError

    def open(self, path: str, mode: str = "rb") -> IO[bytes]:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def size(self, path: str) -> int:
        raise NotImplementedError

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under `path`; empty if it does not exist."""
        raise NotImplementedError

    def write_bytes(self, path: str, data: bytes) -> None:
        """Durable, all-or-nothing write of a small file (manifest, latest pointer)."""
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        raise NotImplementedError

    def staging_path(self, final: str) -> str:
        """Where the files of checkpoint `final` are written before the commit."""
        raise NotImplementedError

    def prepare_dir(self, path: str) -> None:
        """An empty directory at `path` (whatever a crashed attempt left there is removed)."""
        raise NotImplementedError

    def commit_dir(self, staging: str, final: str) -> None:
        """Make the fully written `staging` directory visible as `final`."""
        raise NotImplementedError

    def set_aside(self, path: str) -> str | None:
        """Move the checkpoint directory `path` to a free name that is not a step directory (so it is
        neither loaded, counted by retention, nor replaced by a new save of its step); return the new
        path, or None where storage cannot rename cheaply (it then stays where it is)."""
        return None

    def read_bytes(self, path: str) -> bytes:
        with self.open(path) as f:
            return f.read()

    def read_ranges(self, path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes ``[start, start + length)`` of `path` for each (start, length) of `ranges`, in
        order; a range that runs past the end comes back short (the caller checks)."""
        out = []
        with self.open(path) as f:
            for start, length in ranges:
                f.seek(start)
                out.append(f.read(length))
        return out

    def sha256(self, path: str) -> str:
        h = hashlib.sha256()
        with self.open(path) as f:
            while block := f.read(_HASH_BLOCK):
                h.update(block)
        return h.hexdigest()

    def is_staging_name(self, name: str) -> bool:
        return name.startswith(".") and name.endswith(".tmp")


class LocalStorage(Storage):
    atomic_rename = True

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def open(self, path: str, mode: str = "rb") -> IO[bytes]:
        return open(path, mode)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def write_bytes(self, path: str, data: bytes) -> None:
        # tmp + fsync + replace: a crash leaves the old file or the new one, never half of one.
        tmp = f"{path}.{os.getpid()}.part"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def staging_path(self, final: str) -> str:
        head, name = os.path.split(final)
        return os.path.join(head, f".{name}.tmp")

    def prepare_dir(self, path: str) -> None:
        self.remove_tree(path)
        os.makedirs(path)
        _fsync_dir(os.path.dirname(path))

    def commit_dir(self, staging: str, final: str) -> None:
        for name in os.listdir(staging):  # DCP fsyncs its shards; this also covers the manifest
            with open(os.path.join(staging, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(staging)
        if os.path.exists(final):
            # A run fell back past a step directory that could not be set aside (see set_aside) and
            # is saving that step again.
            old = self.staging_path(final).replace(".tmp", ".old.tmp")
            self.remove_tree(old)
            os.rename(final, old)
            os.rename(staging, final)
            self.remove_tree(old)
        else:
            os.rename(staging, final)
        _fsync_dir(os.path.dirname(final))

    def set_aside(self, path: str) -> str | None:
        new, n = f"{path}.unloadable", 1
        while os.path.lexists(new):
            n += 1
            new = f"{path}.unloadable-{n}"
        os.rename(path, new)
        _fsync_dir(os.path.dirname(path))
        return new


class FsspecStorage(Storage):
    atomic_rename = False

    def __init__(self, url: str, **storage_options: Any) -> None:
        from fsspec.core import url_to_fs

        self.options = storage_options
        self.fs, _ = url_to_fs(url, **storage_options)
        self.root = url.rstrip("/")
        self.protocol = url.split("://", 1)[0]

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts)

    def _fresh(self) -> None:
        # Listings are cached per process; another rank may have written since.
        self.fs.invalidate_cache()

    def open(self, path: str, mode: str = "rb") -> IO[bytes]:
        return self.fs.open(path, mode)

    def exists(self, path: str) -> bool:
        self._fresh()
        return self.fs.exists(path)

    def read_ranges(self, path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        # Ranged GETs of exactly these bytes (a file opened through fsspec reads whole cache blocks).
        if not ranges:
            return []
        return list(self.fs.cat_ranges([path] * len(ranges), [s for s, _ in ranges],
                                       [s + n for s, n in ranges], on_error="raise"))

    def size(self, path: str) -> int:
        self._fresh()
        return int(self.fs.size(path))

    def list_dir(self, path: str) -> list[str]:
        self._fresh()
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def write_bytes(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)  # one PUT: atomic on object stores

    def remove_tree(self, path: str) -> None:
        self._fresh()
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def staging_path(self, final: str) -> str:
        return final

    def prepare_dir(self, path: str) -> None:
        # A stale manifest goes first, so the directory is uncommitted while the rest is removed.
        manifest = self.join(path, "manifest.json")
        self._fresh()
        if self.fs.exists(manifest):
            self.fs.rm(manifest)
        self.remove_tree(path)

    def commit_dir(self, staging: str, final: str) -> None:
        if staging != final:
            raise ValueError(f"object-store checkpoints are written in place; got {staging!r} -> {final!r}")


def _fsync_dir(path: str) -> None:
    """Persist a directory's entries (renames, new files); not every platform allows it."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
