"""CheckpointManager: save (async), commit atomically, keep the last K, and load the newest good one.

Async design. `save()` blocks only to stage: the model and AdamW tensors are copied into reusable CPU
buffers (`Stager`), then a daemon thread writes them and commits. The thread talks to the other ranks
on a gloo group of its own, created collectively when the manager is built, so its collectives never
interleave with the training loop's (gloo, or NCCL on GPUs) on the default group. We do not use
`dcp.async_save`: its future ends when the shards are written, but our commit (gather checksums,
manifest, rename, `latest`, retention) is itself collective and must follow the write on every rank;
running save + commit as one function on one thread keeps that ordering trivially and gives one place
to catch errors. At most one save is in flight: the next `save()` (or `flush()`) waits for it.

Commit protocol, every rank in the writer thread:
  1. rank 0 empties the staging directory;                       broadcast (errors abort everywhere)
  2. `dcp.save` writes one safetensors file per rank (HuggingFace storage, distributed mode);
     each rank sizes, checksums and reads back the header of the files it wrote;  gather to rank 0
  3. rank 0 builds and checks the manifest, writes it last, commits the directory, moves `latest`,
     applies retention;                                          broadcast the outcome
A failure anywhere leaves the previous checkpoints and the `latest` pointer untouched.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from parallel.checkpoint import state as state_mod
from parallel.checkpoint.manifest import MANIFEST_NAME, CheckpointError, Chunk, FileEntry, Manifest, TensorEntry
from parallel.checkpoint.storage import Storage, open_storage
from parallel.checkpoint.tensor_io import ManifestReader, dtype_name, read_header, saved_offsets
from parallel.checkpoint.validate import (
    LATEST_NAME,
    check_manifest,
    file_problems,
    list_step_dirs,
    read_manifest_text,
    step_dir_name,
)

log = logging.getLogger(__name__)


def _first(problems: list[str]) -> str:
    """The first problem, and how many more: one readable line even for a 40-tensor shape mismatch."""
    return problems[0] + (f" (+{len(problems) - 1} more problem(s))" if len(problems) > 1 else "")


def _describe(e: BaseException) -> str:
    """One line per failure. DCP's CheckpointException (a BaseException, not an Exception: an
    `except Exception` does not catch it) carries each failed rank's exception plus a traceback."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {_describe(f[0] if isinstance(f, tuple) else f)}"
                         for r, f in sorted(e.failures.items()))
    return f"{type(e).__name__}: {str(e)[:1000]}"


@dataclass(slots=True)
class _SaveJob:
    step: int
    tensors: dict[str, torch.Tensor]
    shapes: dict[str, tuple[list[int], str]]
    optimizer_steps: dict[str, int]
    state: dict[str, Any]


class _Comm:
    """Collectives on the checkpoint's own gloo group; trivial ones when there is no process group
    (tools and unit tests run in one process)."""

    def __init__(self, timeout_s: float) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = None
        self.rank, self.world = 0, 1
        if self.enabled:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            # DCP warns on every single-process save/load; here that is the intent, not a mistake.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        if not self.enabled:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)


class CheckpointManager:
    """Checkpoints of one run under `root` (a path or fsspec URL). Construction is collective when a
    process group exists (it creates the writer's gloo group), and so are `save`, `flush` and
    `load_latest`: every rank calls them in the same order."""

    def __init__(self, root: str, *, keep_last: int = 3, async_save: bool = True,
                 storage_options: dict[str, Any] | None = None, timeout_s: float = 600.0) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is always kept), got {keep_last}")
        self.storage: Storage = open_storage(root, **(storage_options or {}))
        self.keep_last = keep_last
        self.async_save = async_save
        self._comm = _Comm(timeout_s)
        self.rank = self._comm.rank
        if self.rank == 0:
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

    @property
    def root(self) -> str:
        return self.storage.root

    # -- save --------------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *, state: dict[str, Any],
             blocking: bool | None = None) -> None:
        """Checkpoint `model` and `optimizer` at `step` with JSON-able `state` (layout, data position, ...)
        in the manifest. Returns once the state is staged, or once it is committed if `blocking` (default:
        not `async_save`). A failed background save raises from the next `save()` or `flush()`."""
        t0 = time.perf_counter()
        if blocking is None:
            blocking = not self.async_save
        self.flush()
        tensors, opt_steps = state_mod.collect(model, optimizer)
        shapes = {k: (list(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()}
        if not blocking:
            tensors = self._stager.stage(tensors)  # a blocking save writes from the live tensors: no copy
        job = _SaveJob(step=step, tensors=tensors, shapes=shapes, optimizer_steps=opt_steps, state=dict(state))
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()
        self.last_saved_step = step
        if blocking:
            self.flush()
        self.blocked_s = time.perf_counter() - t0

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

    def close(self, *, timeout_s: float | None = None) -> None:
        """Wait up to `timeout_s` (None: for ever) for the save in flight. Unlike `flush`, a failed save
        is logged rather than raised, and one still running after the timeout is abandoned (its thread is
        a daemon; without a manifest it was never committed), since after a failure its peers may be gone."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("abandoning the checkpoint save still running after %.0f s (step %s); it will not "
                            "be committed", timeout_s, self.last_saved_step)
                self._thread = None
                return
        try:
            self.flush()
        except CheckpointError:
            log.warning("the last checkpoint save failed", exc_info=True)

    def _run(self, job: _SaveJob) -> None:
        t0 = time.perf_counter()
        try:
            self._write(job)
            self.last_committed_step = job.step
        except BaseException as e:  # re-raised in the training thread by flush()
            self._error = e
        finally:
            self.write_s = time.perf_counter() - t0

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

        report: dict[str, Any] = {"error": None, "files": {}, "shapes": job.shapes,
                                  "optimizer_steps": job.optimizer_steps}
        writer = st.writer(staging)
        try:
            dcp.save(job.tensors, storage_writer=writer, process_group=comm.group)
            report["files"] = self._describe_files(staging, writer.written)
        except (Exception, CheckpointException) as e:
            # DCP already names the failed ranks, and raises the same error on every rank.
            own = isinstance(e, CheckpointException)
            report["error"] = _describe(e) if own else f"rank {self.rank}: {_describe(e)}"
        reports = comm.gather(report)

        outcome = None
        if self.rank == 0:
            try:
                outcome = self._commit(job, staging, final, reports)
            except Exception as e:
                outcome = f"commit failed: {_describe(e)}"
            if outcome is not None:
                try:
                    st.remove_tree(staging)
                except Exception:
                    log.warning("could not remove the uncommitted checkpoint %s; it is ignored by loaders and "
                                "removed by the next run", staging, exc_info=True)
        outcome = comm.broadcast(outcome)
        if outcome:
            raise CheckpointError(f"checkpoint {final} was not committed: {outcome}")

    def _describe_files(self, staging: str, names: list[str]) -> dict[str, dict[str, Any]]:
        """Size, sha256 and chunk list of each file this rank wrote (read back from storage)."""
        out = {}
        for n in names:
            path = self.storage.join(staging, n)
            size = self.storage.size(path)
            with self.storage.open(path) as f:
                header, _ = read_header(f, file_size=size, where=path)
            offsets = saved_offsets(header)
            tensors = {k: (offsets.get(k, [0] * len(v["shape"])), list(v["shape"]))
                       for k, v in header.items() if k != "__metadata__"}
            out[n] = {"size": size, "sha256": self.storage.sha256(path), "tensors": tensors}
        return out

    def _commit(self, job: _SaveJob, staging: str, final: str, reports: list[dict]) -> str | None:
        """Rank 0: build the manifest from every rank's report and commit; an error string if not."""
        errors = sorted({r["error"] for r in reports if r["error"]})
        if errors:
            return "; ".join(errors)
        shapes: dict[str, tuple[list[int], str]] = {}
        steps: dict[str, int] = {}
        files: dict[str, FileEntry] = {}
        chunks: dict[str, list[Chunk]] = defaultdict(list)
        for r in reports:
            for k, v in r["shapes"].items():
                if shapes.setdefault(k, v) != v:
                    return f"ranks disagree on the global shape/dtype of {k}: {shapes[k]} vs {v}"
            for k, v in r["optimizer_steps"].items():
                if steps.setdefault(k, v) != v:
                    return f"ranks disagree on the optimizer step of {k}: {steps[k]} vs {v}"
            for fname, info in r["files"].items():
                if fname in files:
                    return f"two ranks wrote {fname}"
                files[fname] = FileEntry(size=info["size"], sha256=info["sha256"])
                for key, (offsets, sizes) in info["tensors"].items():
                    chunks[key].append(Chunk(file=fname, offsets=tuple(offsets), sizes=tuple(sizes)))
        tensors = {k: TensorEntry(shape=tuple(shape), dtype=dtype,
                                  chunks=tuple(sorted(chunks[k], key=lambda c: c.offsets)))
                   for k, (shape, dtype) in shapes.items()}
        manifest = Manifest(step=job.step, tensors=tensors, files=files, optimizer_steps=steps, state=job.state)
        problems = manifest.structure_problems()
        if problems:
            return "; ".join(problems[:5])
        st = self.storage
        st.write_bytes(st.join(staging, MANIFEST_NAME), manifest.to_json().encode())
        st.commit_dir(staging, final)
        st.write_bytes(st.join(st.root, LATEST_NAME), (step_dir_name(job.step) + "\n").encode())
        try:
            self._retain()
        except Exception:
            log.warning("checkpoint retention under %s failed; old checkpoints were kept", st.root, exc_info=True)
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
                    expected: dict[str, tuple[tuple[int, ...], str]] | None = None) -> Manifest | None:
        """Load the newest checkpoint that passes every check into `model` and `optimizer` (any layout),
        and return its manifest; None if there is no checkpoint at all. Checkpoints that fail are skipped:
        once an older one loads, each is logged with its reason and, if it was committed, set aside
        (`Storage.set_aside`) so that it is kept for inspection but never replaced by a new save of its step
        nor counted by retention. If none loads, CheckpointError names each one and its first problem, and
        nothing is moved. `expected` (canonical name -> (global shape, dtype)) lets the check reject
        another model's checkpoint before anything is read."""
        self.flush()
        comm, st = self._comm, self.storage
        names = comm.broadcast(list_step_dirs(st) if self.rank == 0 else None)
        skipped: list[tuple[str, list[str], bool]] = []  # (path, problems, committed)
        for _, name in names:
            path = st.join(st.root, name)
            text, why = comm.broadcast(read_manifest_text(st, path) if self.rank == 0 else (None, None))
            check = check_manifest(path, text, why, expected)
            if check.manifest is not None and not check.problems:
                # Checksums read every byte: share the files out across ranks, then agree on the union.
                mine = sorted(check.manifest.files)[self.rank::comm.world]
                local = file_problems(st, path, check.manifest, mine)
                check.problems = sorted({p for ps in comm.all_gather(local) for p in ps})
            if not check.problems:
                manifest = check.manifest
                err = None
                try:
                    state_mod.load(model, optimizer, lambda targets: dcp.load(
                        targets, storage_reader=ManifestReader(st, path, manifest), process_group=comm.group),
                        manifest.optimizer_steps)
                except (Exception, CheckpointException) as e:
                    err = _describe(e)
                errs = [e for e in comm.all_gather(err) if e]
                if not errs:
                    if skipped and self.rank == 0:
                        self._set_aside(skipped)
                        log.warning("resumed from %s after skipping %d newer checkpoint(s)", path, len(skipped))
                    return manifest
                check.problems = [f"loading failed: {errs[0]}"]
            skipped.append((path, check.problems, text is not None))
        if skipped:
            raise CheckpointError(
                f"no loadable checkpoint under {st.root}: "
                + "; ".join(f"{p.rstrip('/').rsplit('/', 1)[-1]}: {_first(problems)}" for p, problems, _ in skipped)
                + ". To resume, use the job config these checkpoints were saved with (see `elastron ckpt "
                  "inspect`) or restore a good one; to start over, use a new run directory")
        return None

    def _set_aside(self, skipped: list[tuple[str, list[str], bool]]) -> None:
        """Rank 0, after a fallback: log each skipped checkpoint and set the committed ones aside."""
        st = self.storage
        for path, problems, committed in skipped:
            note = ""
            if committed:
                try:
                    moved = st.set_aside(path)
                except OSError:
                    log.warning("could not set %s aside", path, exc_info=True)
                    moved = None
                if moved is None:
                    self._unloadable.add(path.rstrip("/").rsplit("/", 1)[-1])
                    note = "; kept in place until its step is saved again"
                else:
                    note = f"; moved to {moved} for inspection (delete it when done)"
            log.warning("checkpoint %s cannot be loaded: %s%s; falling back to an older checkpoint",
                        path, _first(problems), note)
