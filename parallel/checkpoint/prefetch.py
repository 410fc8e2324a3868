"""Reading a rank's checkpoint files into the page cache while the rest of a restart goes on.

A process that resumes first builds its model (in a fresh process most of that is importing torch's
compiler and distributed modules: 1.5-2.2 s on an H200 host, several seconds on a busy CPU box) and only
then reads the checkpoint, so the disk idles while the CPU imports. One thread here reads the files that
hold this rank's part of the newest checkpoint, sequentially in large blocks (the bytes go nowhere: the
page cache keeps them), from the start of the build until the load itself begins; the load then finds
that much already in memory. Which files: those with a chunk that overlaps a box this rank holds under
its layout (`parallel.sharding.param_box`), worked out from the manifest alone (formats 3-4: from the
manifest and the indexes of the saved ranks that wrote what meets those boxes, as the load reads them). Local files only (an
object store has no page cache to warm); anything unexpected (no manifest, a name the layout does not
know) and the thread reads nothing or every file: it is a hint, never a correctness matter.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from parallel.checkpoint.keys import MODEL_PREFIX, OPTIM_PREFIX
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.storage import LocalStorage
from parallel.checkpoint.placement import index_keys_for
from parallel.checkpoint.validate import list_step_dirs, read_indexes, read_manifest_text
from parallel.layout import Layout
from parallel.sharding import Box, param_box

log = logging.getLogger(__name__)

BLOCK = 16 << 20
"""Bytes per read: large enough for the disk's full rate, small enough to stop soon when told."""


def _param_name(key: str) -> str:
    if key.startswith(OPTIM_PREFIX):
        return key[len(OPTIM_PREFIX):].split(".", 1)[1]
    return key.removeprefix(MODEL_PREFIX)


def files_for_rank(manifest: Manifest, layout: Layout, rank: int, n_layers: int, *, tied: bool) -> list[str]:
    """The files of `manifest` that hold a chunk overlapping what `rank` holds under `layout`, in the
    manifest's file order; every file if a tensor's box cannot be worked out."""
    needed: set[str] = set()
    for key, entry in manifest.tensors.items():
        try:
            box = param_box(_param_name(key), tuple(entry.shape), layout, rank, n_layers, tied=tied)
        except (ValueError, KeyError, IndexError):
            return sorted(manifest.files)
        if box is None:
            continue
        for c in entry.chunks:
            if c.file not in needed and box.intersect(Box(tuple(c.offsets), tuple(c.sizes))) is not None:
                needed.add(c.file)
    return [f for f in sorted(manifest.files) if f in needed]


def _my_part(storage: LocalStorage, step_dir: str, manifest: Manifest, layout: Layout, rank: int, n_layers: int, *,
             tied: bool) -> Manifest:
    """A format-3-4 manifest with the indexes merged in that describe what `rank` holds under `layout`."""
    boxes = {}
    for key, entry in manifest.tensors.items():
        box = param_box(_param_name(key), tuple(entry.shape), layout, rank, n_layers, tied=tied)
        if box is not None:
            boxes[key] = box
    placement = manifest.placement_of()
    wanted = ([(r, False) for r in range(manifest.indexes)] if placement is None
              else index_keys_for(placement.boxmap(manifest.optimizer_states()), boxes))
    indexes, _ = read_indexes(storage, step_dir, manifest, wanted)
    return manifest.merged(indexes, whole=False)[0]


def newest_manifest(storage: LocalStorage) -> tuple[Path, Manifest] | None:
    """The newest step directory under `storage`'s root that has a manifest, parsed."""
    try:
        steps = list_step_dirs(storage)
    except OSError:
        return None
    for _, name in steps:
        path = storage.join(storage.root, name)
        text, _ = read_manifest_text(storage, path)
        if text is None:  # not committed (or unreadable): the load will judge it; try an older one
            continue
        try:
            return Path(path), Manifest.from_json(text)
        except Exception:  # a manifest that does not parse: likewise
            continue
    return None


class Prefetch:
    """A thread reading `paths` front to back until done or `stop()`."""

    def __init__(self, paths: list[Path]) -> None:
        self.bytes = 0
        self._paths = list(paths)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        try:
            for p in self._paths:
                with open(p, "rb", buffering=0) as f:
                    while not self._stop.is_set():
                        n = f.readinto(view)
                        if not n:
                            break
                        self.bytes += n
                if self._stop.is_set():
                    return
        except OSError as e:  # the load reports what is wrong with the files; this was only a hint
            log.debug("checkpoint prefetch stopped: %s", e)

    def stop(self) -> int:
        """Stop reading (within one block); returns the bytes read."""
        self._stop.set()
        self._thread.join()
        return self.bytes


def start_prefetch(root: str | None, layout: Layout, rank: int, n_layers: int, *, tied: bool) -> Prefetch | None:
    """Start reading this rank's files of the newest checkpoint under `root` (a local directory), or None
    when there is nothing to read."""
    if not root or "://" in str(root):
        return None
    found = newest_manifest(LocalStorage(str(root)))
    if found is None:
        return None
    step_dir, manifest = found
    t = time.perf_counter()
    try:
        if manifest.scope == "top":
            manifest = _my_part(LocalStorage(str(root)), str(step_dir), manifest, layout, rank, n_layers, tied=tied)
        names = files_for_rank(manifest, layout, rank, n_layers, tied=tied)
    except Exception as e:  # a manifest this code cannot read: the load will say what is wrong with it
        log.debug("no checkpoint prefetch for %s: %s", step_dir, e)
        return None
    log.debug("prefetching %d of %d files of %s (planned in %.3f s)", len(names), len(manifest.files), step_dir,
              time.perf_counter() - t)
    return Prefetch([step_dir / n for n in names]) if names else None
