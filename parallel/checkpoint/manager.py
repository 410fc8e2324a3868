"""CheckpointManager: save (async), commit atomically, keep the last K, and load the newest good one.

Save. `save()` collects each rank's boxes of every tensor and picks the ones it writes (replicas write
once): with a `Placement` (the layout the trainer runs under), by a rule each rank evaluates alone
(`placement.writes`), once the ranks agree that their boxes are the ones the placement predicts (two
integers reduced); else, as a fallback, from every rank's boxes gathered (`state.assign_writers`). For an
async save, it copies the boxes
it writes into a host buffer pool allocated once (`state.Stager`): that copy is all the caller waits
for. A daemon thread then streams the boxes into safetensors files (`writer.ShardWriter`: header, then
each tensor's bytes from host memory in large writes, hashed as they go out, several files in parallel)
and commits. The heavy work (os.write, hashing) runs in native code that releases the GIL, and an async
writer thread lowers its own CPU priority, so it runs on idle cores and yields to training on busy ones.
The thread talks to the other ranks on a gloo group of its own, created collectively when the manager is
built, so its collectives never interleave with the training loop's (gloo, or NCCL on GPUs) on the
default group. At most one save is in flight: the next `save()` (or `flush()`) waits for it.

Commit protocol (format 4: `sections.py`, `index.py`), every rank in the writer thread:
  1. rank 0 empties the staging directory;                       broadcast (errors abort everywhere)
  2. each rank writes its files, then its index (``index-rNNNNN.json``: sizes, header digests and
     per-block digests, computed over the bytes as they were written: no read-back; keyed by the
     checkpoint's keys when the save is placed, one JSON document in the fallback); it reports only
     whether that worked (and, in the fallback, its tensors' shapes)                gather to rank 0
  3. rank 0 writes the top manifest last (the placement, the number of indexes, the JSON state in its
     header; the shapes from the placement in one section per pipeline stage), commits the directory,
     moves `latest`, applies retention;
                                                                 broadcast the outcome
A failure anywhere leaves the previous checkpoints and the `latest` pointer untouched. No rank handles
another rank's chunk records.

Load (`loader.py`). Each rank reads the top manifest's header (rank 0 reads and shares it) and the
sections of its stage's parameters, of the indexes of the saved ranks that wrote what
meets its boxes the header and the records of the keys it meets, and only the blocks of the files that
overlap its boxes, files in parallel, verifying each block against its index before copying it into
the live shards (`tensor_io.read_into`); a mismatch fails the load on every rank and the previous
checkpoint is tried. Format-2 checkpoints (one manifest with every chunk) load as before; format-1
ones (whole-file sha256) are verified completely first.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallel.checkpoint import state as state_mod
from parallel.checkpoint.checksum import DEFAULT as DEFAULT_CHECKSUM
from parallel.checkpoint.checksum import check_algorithm
from parallel.checkpoint.comm import Comm
from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
from parallel.checkpoint.errors import CheckpointError, describe
from parallel.checkpoint.formats import FORMAT_VERSION, MANIFEST_NAME, index_name, shard_prefix
from parallel.checkpoint.index import Index
from parallel.checkpoint.keys import OPTIM_PREFIX, key_order, param_of
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.placement import Placement, shared, writes
from parallel.checkpoint.loader import load_newest
from parallel.checkpoint.storage import Storage, open_storage
from parallel.checkpoint.tensor_io import dtype_name
from parallel.checkpoint.timings import Timings
from parallel.checkpoint.validate import LATEST_NAME, list_step_dirs, step_dir_name
from parallel.checkpoint.writer import MIN_FILE_BYTES, Piece, ShardWriter, WrittenFile, split_files

log = logging.getLogger(__name__)


def _lower_priority() -> None:
    """Let the calling (writer) thread yield the CPU to training threads: on Linux the nice value is per
    thread, and threads it starts inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


@dataclass(slots=True)
class _SaveJob:
    step: int
    pieces: list[Piece]
    shapes: dict[str, tuple[list[int], str]]
    optimizer_steps: dict[str, int]
    state: dict[str, Any]
    background: bool
    placed: bool = False
    """The writers were chosen by the placement's rule (the top manifest records it)."""
    shared: frozenset = frozenset()
    """Keys of the boxes this rank writes that are shared (`placement.shared`): its shared index."""
    stage_after: Any = False
    """False: `pieces` are ready to write; None or a CUDA event: the writer thread stages them first
    (after that event on GPUs)."""


class CheckpointManager:
    """Checkpoints of one run under `root` (a path or fsspec URL). Construction is collective when a
    process group exists (it creates the writer's gloo group), and so are `save`, `flush` and
    `load_latest`: every rank calls them in the same order."""

    def __init__(self, root: str, *, keep_last: int = 3, async_save: bool = True,
                 storage_options: dict[str, Any] | None = None, timeout_s: float = 600.0,
                 checksum: str = DEFAULT_CHECKSUM, io_threads: int = 2, read_only: bool = False,
                 placement: Placement | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is always kept), got {keep_last}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.storage: Storage = open_storage(root, **(storage_options or {}))
        self.keep_last = keep_last
        self.async_save = async_save
        self.checksum = check_algorithm(checksum)
        self.io_threads = io_threads  # files written (per rank) and read in parallel
        self.read_only = read_only
        """Another job's checkpoints (`checkpoint.resume_from`): loaded, never saved, cleaned or set aside."""
        self.placement = placement
        """The layout saves run under: lets each rank choose the boxes it writes alone, and loaders read
        only the indexes they need. None: writers are chosen from every rank's gathered boxes."""
        self._comm = Comm(timeout_s)
        self.rank = self._comm.rank
        if self.rank == 0 and not read_only:
            self._remove_stale_staging()
        self._comm.barrier()
        self._stager = state_mod.Stager()
        self._unloadable: set[str] = set()  # step directories skipped by load_latest that could not be set aside
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved_step: int | None = None
        """Step of the newest save handed to the writer (committed once `flush()` returns cleanly)."""
        self.last_committed_step: int | None = None
        """Step of the newest checkpoint this manager committed."""
        self.blocked_s = 0.0
        """Seconds the last `save()` call blocked its caller (waiting for the previous save + staging)."""
        self.write_s = 0.0
        """Seconds the last background write + commit took."""
        self._staged = threading.Event()
        self._staged.set()
        self._committed = threading.Event()
        self._committed.set()
        self._hooked: tuple[torch.optim.Optimizer, Any] | None = None
        self.stage_wait_s = 0.0
        """Seconds optimizer steps have waited for deferred staging copies (`overlap_staging`), in total."""
        self.save_timings = Timings()
        """Phases of the last save on this rank: collect, plan, stage (caller); write, commit (writer)."""
        self.load_timings = Timings()
        """Phases of the last `load_latest` on this rank: check, read (of the checkpoint that loaded)."""

    @property
    def root(self) -> str:
        return self.storage.root

    # -- save --------------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *, state: dict[str, Any],
             blocking: bool | None = None, overlap_staging: bool = False) -> None:
        """Checkpoint `model` and `optimizer` at `step` with JSON-able `state` (layout, data position, ...)
        in the manifest. Returns once the state is staged, or once it is committed if `blocking` (default:
        not `async_save`). A failed background save raises from the next `save()` or `flush()`.

        `overlap_staging` (async saves): return before the state is copied; the copy runs in the writer
        thread while the caller goes on, and the optimizer's next `step()` waits for it (a step pre-hook).
        Only for callers that change parameters and optimizer state through `optimizer.step()` alone, as a
        training loop does: forward and backward then overlap the copy instead of waiting for it."""
        if self.read_only:
            raise CheckpointError(f"{self.root} was opened read-only (checkpoint.resume_from): nothing is saved there")
        t0 = time.perf_counter()
        if blocking is None:
            blocking = not self.async_save
        self.flush()
        tm = self.save_timings = Timings()
        t = time.perf_counter()
        tensors, opt_steps = state_mod.collect(model, optimizer)
        shapes = {k: (list(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()}
        local = state_mod.pieces(tensors)
        tm.add("collect", time.perf_counter() - t)
        t = time.perf_counter()
        mine, shared_keys = self._my_pieces(local, shapes)
        tm.add("plan", time.perf_counter() - t)
        tm.bytes = sum(p.nbytes for p in mine)
        job = _SaveJob(step=step, pieces=mine, shapes=shapes, optimizer_steps=opt_steps, state=dict(state),
                       background=not blocking, placed=shared_keys is not None, shared=shared_keys or frozenset())
        cuda = any(p.data.is_cuda for p in mine)
        if overlap_staging and not blocking:
            job.stage_after = torch.cuda.Event() if cuda else None
            if job.stage_after is not None:
                job.stage_after.record()  # the copies wait for the work queued so far, not for the host
            self._staged.clear()
            self._hook(optimizer)
        elif not blocking or cuda:  # a blocking save on CPU writes from the live tensors: no copy
            t = time.perf_counter()
            job.pieces = self._stager.stage(mine)
            tm.add("stage", time.perf_counter() - t)
        self._committed.clear()
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()
        self.last_saved_step = step
        if blocking:
            self._committed.wait()  # committed (or failed); retention may still be running
            if self._error is not None:
                self.flush()
        self.blocked_s = time.perf_counter() - t0

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Get the host staging pool for this rank's share of a save of `model` and `optimizer` (AdamW
        moments counted before they exist) allocated, and on CUDA pinned, in the background now, so the
        first save costs what the others do. Collective (it agrees which rank writes which box, as a
        save does). Only where saves stage: async saves, or device memory; a blocking save on CPU writes
        from the live tensors and reserves nothing. Returns the bytes reserved."""
        if self.read_only:
            return 0
        tensors = state_mod.collect_planned(model, optimizer)
        local = state_mod.pieces(tensors)
        cuda = any(p.data.is_cuda for p in local)
        if not (self.async_save or cuda):
            return 0
        mine, _ = self._my_pieces(local, {k: (list(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()})
        self._stager.reserve([p.nbytes for p in mine], pin=cuda)
        return state_mod.Stager.pool_bytes(mine)

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` wait until a deferred staging copy is done (registered once, removed by
        `close`). The hook holds the manager weakly: a strong reference would close a cycle (optimizer ->
        hook -> manager -> optimizer) that keeps the optimizer, its parameters and moments and the staging
        pool alive after the trainer is dropped, until a full run of the cyclic garbage collector."""
        if self._hooked is not None and self._hooked[0] is optimizer:
            return
        self._unhook()
        ref = weakref.ref(self)

        def wait_for_staging(*_: Any) -> None:
            m = ref()
            if m is not None and not m._staged.is_set():
                t = time.perf_counter()
                m._staged.wait()
                m.stage_wait_s += time.perf_counter() - t

        self._hooked = (optimizer, optimizer.register_step_pre_hook(wait_for_staging))

    def _unhook(self) -> None:
        if self._hooked is not None:
            self._hooked[1].remove()
            self._hooked = None

    def _my_pieces(self, local: list[Piece], shapes: dict[str, tuple[list[int], str]]
                   ) -> tuple[list[Piece], frozenset | None]:
        """(The boxes this rank writes, the keys of those that are shared (`placement.shared`), or None
        when the placement's rule did not choose them). Collective. With a
        placement whose `BoxMap` gives every rank exactly the boxes, shapes and dtypes it holds (agreed
        by a reduction of two integers), each rank keeps the boxes `placement.writes` gives it: work in
        its own boxes. Otherwise every rank's boxes are gathered and each distinct box is given to one
        of its holders (`state.assign_writers`)."""
        states = tuple(sorted({k[len(OPTIM_PREFIX):].split(".", 1)[0] for k in shapes if k.startswith(OPTIM_PREFIX)}))
        bm, ok = None, False
        if self.placement is not None:
            try:
                bm = self.placement.boxmap(states)
                ok = _placed_as_predicted(bm, self.placement, self.rank, local, shapes)
            except (ValueError, KeyError) as e:
                log.debug("checkpoint placement does not apply: %s", e)
            token = zlib.crc32(repr((states, self.placement.to_dict(), len(self.placement.params))).encode())
            if self._comm.agree(ok, token):
                mine = [p for p in local if writes(bm, self.rank, p.key)]
                return mine, frozenset(p.key for p in mine if shared(bm, p.key, bm.tile_of(self.rank, p.key)))
            if ok or self.rank == 0:
                log.warning("checkpoint boxes differ from what layout %s predicts on some rank: choosing "
                            "writers from every rank's boxes (a save and a load that cost the world size)",
                            self.placement.layout)
        plan = [(p.key, tuple(p.offsets), tuple(p.data.shape), p.nbytes) for p in local]
        mine = state_mod.assign_writers(self._comm.all_gather(plan))[self.rank]
        return [p for p in local if (p.key, tuple(p.offsets)) in mine], None

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being staged, written or committed."""
        return self._thread is not None and self._thread.is_alive()

    def flush(self) -> None:
        """Wait for the save in flight, if any; raise CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            self.last_saved_step = self.last_committed_step  # so the same step can be saved again
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"checkpoint save failed: {type(err).__name__}: {err}") from err

    def close(self, *, timeout_s: float | None = None) -> bool:
        """Wait up to `timeout_s` (None: for ever) for the save in flight. Unlike `flush`, a failed save
        is logged rather than raised, and one still running after the timeout is abandoned (its thread is
        a daemon; without a manifest it was never committed), since after a failure its peers may be gone.
        Returns False if a save was abandoned (its thread may still touch the staging area). Removes the
        optimizer's staging hook once no save runs."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("abandoning the checkpoint save still running after %.0f s (step %s); it will not "
                            "be committed", timeout_s, self.last_saved_step)
                self._thread = None
                return False
        try:
            self.flush()
        except CheckpointError:
            log.warning("the last checkpoint save failed", exc_info=True)
        self._unhook()
        return True

    def _run(self, job: _SaveJob) -> None:
        t0 = time.perf_counter()
        if job.background:
            _lower_priority()
        try:
            if job.stage_after is not False:
                t = time.perf_counter()
                try:
                    job.pieces = self._stager.stage(job.pieces, after=job.stage_after)
                finally:
                    self._staged.set()
                self.save_timings.add("stage", time.perf_counter() - t)
            self._write(job)
            self.last_committed_step = job.step
        except BaseException as e:  # re-raised in the training thread by flush()
            self._error = e
            return
        finally:
            self.write_s = time.perf_counter() - t0
            self._committed.set()
        if self.rank == 0:
            # After the commit, so a blocking save returns without waiting for old checkpoints to be
            # deleted; the next save (or flush) waits for it, as it waits for this thread.
            t = time.perf_counter()
            try:
                self._retain()
            except Exception:
                log.warning("checkpoint retention under %s failed; old checkpoints were kept", self.storage.root,
                            exc_info=True)
            self.save_timings.add("retention", time.perf_counter() - t)

    def _write(self, job: _SaveJob) -> None:
        st, comm = self.storage, self._comm
        name = step_dir_name(job.step)
        final = st.join(st.root, name)
        staging = st.staging_path(final)
        err = None
        if self.rank == 0:
            try:
                st.prepare_dir(staging)
            except Exception as e:
                err = f"cannot prepare {staging}: {e}"
        err = comm.broadcast(err)
        if err:
            raise CheckpointError(f"checkpoint {final} was not saved: {err}")

        # The fallback has no placement to take the shapes of other ranks' tensors from: they come along.
        report: dict[str, Any] = {"error": None, "shapes": None if job.placed else job.shapes}
        t = time.perf_counter()
        try:
            self.write_index(staging, job, self.write_shards(staging, job.pieces))
        except Exception as e:
            report["error"] = f"rank {self.rank}: {describe(e)}"
        self.save_timings.add("write", time.perf_counter() - t)
        t = time.perf_counter()
        reports = comm.gather(report)

        outcome = None
        if self.rank == 0:
            try:
                outcome = self._commit(job, staging, final, reports)
            except Exception as e:
                outcome = f"commit failed: {describe(e)}"
            if outcome is not None:
                try:
                    st.remove_tree(staging)
                except Exception:
                    log.warning("could not remove the uncommitted checkpoint %s; it is ignored by loaders and "
                                "removed by the next run", staging, exc_info=True)
        outcome = comm.broadcast(outcome)
        self.save_timings.add("commit", time.perf_counter() - t)
        if outcome:
            raise CheckpointError(f"checkpoint {final} was not committed: {outcome}")

    def write_shards(self, directory: str, pieces: list[Piece]) -> list[WrittenFile]:
        """Write this rank's pieces as one or more safetensors files into `directory` (one writer thread
        per file; a rank's shard is split only when each file still gets MIN_FILE_BYTES)."""
        if not pieces:
            return []
        total = sum(p.nbytes for p in pieces)
        n = max(1, min(self.io_threads, math.ceil(total / MIN_FILE_BYTES)))
        files = {f"{shard_prefix(self.rank)}{i:02d}.safetensors": group
                 for i, group in enumerate(split_files(pieces, n))}
        writer = ShardWriter(self.storage, directory, algorithm=self.checksum,
                             sync=self.storage.atomic_rename)
        return writer.write(files, threads=self.io_threads)

    def write_index(self, directory: str, job: _SaveJob, written: list[WrittenFile]) -> None:
        """Write this rank's index of `written` into `directory` (and its shared index, for the shared
        boxes it wrote), after checking them against the shapes this rank holds (its own records only)."""
        files = {wf.name: FileEntry(size=wf.size, digest=wf.header_digest, algorithm=self.checksum, blockwise=True)
                 for wf in written}
        chunks = {key: Chunk(file=wf.name, offsets=tuple(c.offsets), sizes=tuple(c.sizes), block_rows=c.block_rows,
                             digests=tuple(c.digests)) for wf in written for key, c in wf.chunks.items()}
        tensors = {k: TensorEntry(shape=tuple(s), dtype=d, chunks=()) for k, (s, d) in job.shapes.items()}
        # Placed: every key of the checkpoint is known here (the top manifest's, `_commit`), so the index
        # is keyed by it; the fallback's loaders read every index whole, which then is one JSON document.
        keys = key_order(self._global_shapes(job)) if job.placed else None
        for is_shared in (False, True):
            mine = {k: c for k, c in chunks.items() if (k in job.shared) == is_shared}
            if is_shared and not mine:
                continue
            index = Index(rank=self.rank, step=job.step, shared=is_shared, chunks=mine,
                          files={c.file: files[c.file] for c in mine.values()},
                          optimizer_steps={p: n for p, n in job.optimizer_steps.items()
                                           if not is_shared or any(param_of(k) == p for k in mine)})
            problems = index.problems(tensors)
            if problems:
                raise CheckpointError("; ".join(problems[:5]))
            self.storage.write_bytes(self.storage.join(directory, index_name(self.rank, is_shared)),
                                     index.to_bytes(keys))

    def _global_shapes(self, job: _SaveJob) -> dict[str, tuple[list[int], str]]:
        """Every key of a placed save with its global shape and dtype: the placement's parameters with
        the optimizer states this rank holds (the ranks agreed on those states in `_my_pieces`)."""
        states = {k[len(OPTIM_PREFIX):].split(".", 1)[0] for k in job.shapes if k.startswith(OPTIM_PREFIX)}
        return {f"{prefix}{n}": (list(s), d) for n, (s, d) in self.placement.params.items()
                for prefix in ("model.", *(f"{OPTIM_PREFIX}{st}." for st in sorted(states)))}

    def _commit(self, job: _SaveJob, staging: str, final: str, reports: list[dict]) -> str | None:
        """Rank 0, once every rank wrote its files and index: write the top manifest (the commit marker)
        and commit; an error string if not."""
        errors = sorted({r["error"] for r in reports if r["error"]})
        if errors:
            return "; ".join(errors)
        if job.placed:
            shapes = self._global_shapes(job)
        else:
            shapes = {}
            for r in reports:
                for k, v in r["shapes"].items():
                    if shapes.setdefault(k, v) != v:
                        return f"ranks disagree on the global shape/dtype of {k}: {shapes[k]} vs {v}"
        tensors = {k: TensorEntry(shape=tuple(shape), dtype=dtype, chunks=()) for k, (shape, dtype) in shapes.items()}
        manifest = Manifest(step=job.step, tensors=tensors, files={}, state=job.state, format_version=FORMAT_VERSION,
                            placement=self.placement.to_dict() if job.placed else None, indexes=len(reports),
                            scope="top")
        problems = manifest.structure_problems()
        if problems:
            return "; ".join(problems[:5])
        st = self.storage
        t = time.perf_counter()
        st.write_bytes(st.join(staging, MANIFEST_NAME), manifest.to_json().encode())
        st.commit_dir(staging, final)
        st.write_bytes(st.join(st.root, LATEST_NAME), (step_dir_name(job.step) + "\n").encode())
        self.save_timings.add("commit.files", time.perf_counter() - t)
        return None

    def _retain(self) -> None:
        """Keep the newest `keep_last` committed checkpoints (the newest is never deleted); drop
        uncommitted step directories older than the newest committed one (leftovers of failed saves)."""
        st = self.storage
        dirs = list_step_dirs(st)
        committed = [(s, n) for s, n in dirs
                     if n not in self._unloadable and st.exists(st.join(st.root, n, MANIFEST_NAME))]
        if not committed:
            return
        keep = {n for _, n in committed[: self.keep_last]}
        newest_step = committed[0][0]
        committed_names = {n for _, n in committed}
        for s, n in dirs:
            if n in keep or n in self._unloadable or (n not in committed_names and s >= newest_step):
                continue
            log.info("checkpoint retention: removing %s", st.join(st.root, n))
            st.remove_tree(st.join(st.root, n))

    def _remove_stale_staging(self) -> None:
        for n in self.storage.list_dir(self.storage.root):
            if self.storage.is_staging_name(n):
                log.warning("removing %s, left by an interrupted checkpoint save", self.storage.join(self.root, n))
                self.storage.remove_tree(self.storage.join(self.storage.root, n))

    # -- load --------------------------------------------------------------------------------------
    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    expected: dict[str, tuple[tuple[int, ...], str]] | None = None,
                    fresh: bool = False) -> Manifest | None:
        """Load the newest checkpoint that passes every check into `model` and `optimizer` (any layout),
        and return its manifest; None if there is no checkpoint at all (see `loader.load_newest`).
        `fresh=True` only for a model and optimizer that hold no values yet (they may be read into
        directly; a failed load leaves them unusable)."""
        self.flush()
        self.load_timings = Timings()
        return load_newest(self, model, optimizer, expected, fresh)


def _placed_as_predicted(bm, placement: Placement, rank: int, local: list[Piece],
                         shapes: dict[str, tuple[list[int], str]]) -> bool:
    """Whether `rank`'s boxes (`local`), and the global shapes and dtypes of its tensors, are exactly those
    the placement predicts: then every rank can tell who holds and who writes what without asking."""
    held = bm.held(rank)
    if len(held) != len(local):
        return False
    for p in local:
        b = held.get(p.key)
        want = placement.params.get(param_of(p.key))
        if (b is None or b.offsets != tuple(p.offsets) or b.sizes != tuple(p.data.shape) or want is None
                or (tuple(shapes[p.key][0]), shapes[p.key][1]) != (tuple(want[0]), want[1])):
            return False
    return True
