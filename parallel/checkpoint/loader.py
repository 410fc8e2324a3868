"""Loading the newest good checkpoint, every rank together, falling back only past proven damage.

Each candidate, newest first: rank 0 reads the manifest and shares it (format 4: its header only); every
rank checks it (structure, the model's shapes). Format 4: each rank then reads the sections of the top
manifest that hold the parameters of its pipeline stage and checks their shapes against the model's.
Formats 3-4: each rank then reads, of the indexes of the saved ranks that wrote what
meets its boxes, the records of the keys it meets (found from the saved placement,
`placement.index_keys_for`; a keyed index's header says where each record lies; every index whole if
the checkpoint has no placement), checks that their chunks tile its boxes and that the files it will
read have their sizes.
Formats 1-2: each rank checks the sizes of its share of the files (format 1: their whole-file sha256 too).
Then every rank reads the blocks it needs, verifying each before it reaches a parameter that holds data
(`tensor_io.read_into`; a trainer being built reads into its unset shards directly).
The ranks agree on the outcome after each stage.

Two kinds of failure are told apart:
- **proven damage** (no manifest, malformed manifest, another model's shapes, missing or short file,
  checksum mismatch): the checkpoint is skipped; once an older one loads, each skipped checkpoint is
  logged and, if committed, set aside (`Storage.set_aside`) so it is never loaded, counted by retention
  or replaced by a new save of its step;
- **a transient error** (an OSError other than a missing file, an object store's 5xx, running out of
  memory): the same checkpoint is tried again, `READ_ATTEMPTS` times with a growing pause. If it still
  cannot be read, the load fails with that error and nothing is skipped or moved: falling back would
  throw away the newest progress because of a network blip.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from parallel.checkpoint import state as state_mod
from parallel.checkpoint.errors import CheckpointError, describe
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.placement import index_keys_for
from parallel.checkpoint.tensor_io import read_into
from parallel.checkpoint.validate import (check_manifest, file_problems, list_step_dirs, read_indexes, read_manifest_text,
                                         read_sections)
from parallel.sharding import Box

log = logging.getLogger("parallel.checkpoint.manager")  # the name operators filter on

class Checkpoints(Protocol):
    """What loading needs of its caller (`CheckpointManager` is one): where the checkpoints are, this
    rank, the ranks' agreement, and where the read's timings and unloadable steps go."""

    storage: Any
    rank: int
    read_only: bool
    io_threads: int
    load_timings: Any
    _comm: Any
    _unloadable: Any


READ_ATTEMPTS = 3
RETRY_PAUSE_S = 1.0
"""Pause before the second attempt; doubled before each further one."""


@dataclass(slots=True)
class _Outcome:
    manifest: Manifest | None = None
    problems: list[str] = field(default_factory=list)
    """Proven damage: skip this checkpoint."""
    transient: list[str] = field(default_factory=list)
    """Errors worth another try."""
    committed: bool = False


def _first(problems: list[str]) -> str:
    """The first problem, and how many more: one readable line even for a 40-tensor shape mismatch."""
    return problems[0] + (f" (+{len(problems) - 1} more problem(s))" if len(problems) > 1 else "")


def _agree(mgr: "Checkpoints", out: _Outcome) -> _Outcome:
    """Every rank's problems and transient errors, merged (collective)."""
    merged = mgr._comm.all_gather((out.problems, out.transient))
    out.problems = sorted({p for ps, _ in merged for p in ps})
    out.transient = sorted({p for _, ts in merged for p in ts})
    return out


def _attempt(mgr: "Checkpoints", path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
             expected: dict | None, fresh: bool = False) -> _Outcome:
    comm, st, tm = mgr._comm, mgr.storage, mgr.load_timings
    transient: list[str] = []
    text, why, transient = comm.broadcast(
        (*read_manifest_text(st, path, transient=transient, head=True), transient) if mgr.rank == 0 else None)
    out = _Outcome(committed=text is not None, transient=transient)
    if transient:
        return out
    t = time.perf_counter()
    check = check_manifest(path, text, why, expected)
    out.manifest, out.problems = check.manifest, list(check.problems)
    if out.manifest is None or out.problems:
        return out
    manifest = out.manifest
    if manifest.scope == "top":  # formats 3-4: this rank's indexes, their cover of its boxes, its files' sizes
        manifest, out.problems = my_part(st, path, manifest, model, expected=expected, transient=out.transient)
        out.manifest = manifest
        tm.phases["indexes"] = time.perf_counter() - t
    else:
        # Sizes (truncation) and presence of this rank's share of the files; format 1 also needs its
        # whole-file sha256 before any byte is used. Then agree on the union.
        mine = sorted(manifest.files)[mgr.rank::comm.world]
        out.problems = file_problems(st, path, manifest, mine, checksums=not _blockwise(manifest),
                                     transient=out.transient)
    blockwise = _blockwise(manifest)
    _agree(mgr, out)
    tm.phases["check"] = time.perf_counter() - t
    if out.problems or out.transient:
        return out
    t = time.perf_counter()

    def read(targets: dict[str, Any]) -> None:
        t_read = time.perf_counter()
        parts: dict[str, float] = {}
        tm.bytes = read_into(st, path, manifest, targets, threads=mgr.io_threads, verify=blockwise, stats=parts,
                             in_place=fresh)
        tm.phases["read"] = time.perf_counter() - t_read
        tm.phases.update({f"read.{k} (thread-s)": v for k, v in parts.items()})

    try:
        state_mod.load(model, optimizer, read, manifest.optimizer_steps)
    except CheckpointError as e:  # names the file and what is wrong with it
        out.problems.append(str(e)[:1000])
    except Exception as e:  # I/O, memory, an object store's 5xx: worth another try
        out.transient.append(f"loading failed: {describe(e)}")
    tm.phases["prepare"] = time.perf_counter() - t - tm.phases.get("read", 0.0)
    t = time.perf_counter()
    _agree(mgr, out)
    tm.phases["agree"] = time.perf_counter() - t
    return out


def _blockwise(manifest: Manifest) -> bool:
    return all(f.blockwise for f in manifest.files.values())


def my_part(storage: Any, path: str, manifest: Manifest, model: torch.nn.Module, *,
            expected: dict[str, tuple[tuple[int, ...], str]] | None = None,
            transient: list[str] | None = None) -> tuple[Manifest, list[str]]:
    """(The format-3-4 `manifest` with the parts of the indexes this rank needs merged in, problems).
    Format 4, read without its sections: first the sections of this rank's parameters, checked against
    `expected` (the model's shapes) before anything else is read. Then which indexes, and which keys'
    records of each, from the saved placement and this rank's boxes (every index whole without a
    placement); problems if they do not tile its boxes, or a file it reads is missing or of the wrong
    size."""
    if manifest.sections is not None and not manifest.sections.complete:
        n = len(transient) if transient is not None else 0
        manifest, problems = read_sections(storage, path, manifest, state_mod.named_state(model), transient=transient)
        if not problems and expected is not None:
            problems = manifest.model_problems(expected)
        if problems or (transient is not None and len(transient) > n):
            return manifest, problems
    boxes = state_mod.boxes_to_load(model, manifest.tensors)
    placement = manifest.placement_of()
    if placement is None:  # the fallback's saves write no shared indexes
        wanted: Any = [(r, False) for r in range(manifest.indexes)]
    else:
        wanted = index_keys_for(placement.boxmap(manifest.optimizer_states()),
                                {k: Box(o, s) for k, (o, s) in boxes.items()})
    indexes, problems = read_indexes(storage, path, manifest, wanted, transient=transient, boxes=boxes)
    part, more = manifest.merged(indexes, whole=False)
    problems += more
    if problems or (transient and len(indexes) < len(wanted)):
        return part, problems
    problems += part.coverage_problems(boxes)
    if problems:
        return part, problems
    names = sorted({c.file for k, (o, s) in boxes.items() for c in part.tensors[k].meeting(o, s)})
    return part, file_problems(storage, path, part, names, checksums=False, transient=transient)


def load_newest(mgr: "Checkpoints", model: nn.Module, optimizer: torch.optim.Optimizer,
                expected: dict[str, tuple[tuple[int, ...], str]] | None, fresh: bool = False) -> Manifest | None:
    """What `CheckpointManager.load_latest` does (collective): load the newest checkpoint that passes
    every check, and return its manifest; None if there is no checkpoint at all. If none loads,
    CheckpointError names each one and its first problem, and nothing is moved. `expected` (canonical
    name -> (global shape, dtype)) lets the check reject another model's checkpoint before any read.
    `fresh`: the model and optimizer hold no values yet (a trainer being built), so blocks may be read
    straight into them (`read_into(in_place=True)`); a candidate that fails its checksums then leaves
    bad bytes there, which the next candidate's load overwrites, or which are discarded with the
    trainer when none loads."""
    comm, st = mgr._comm, mgr.storage
    names = comm.broadcast(list_step_dirs(st) if mgr.rank == 0 else None)
    skipped: list[tuple[str, list[str], bool]] = []  # (path, problems, committed)
    for _, name in names:
        path = st.join(st.root, name)
        for attempt in range(READ_ATTEMPTS):
            out = _attempt(mgr, path, model, optimizer, expected, fresh)
            if not out.transient or out.problems:
                break
            if attempt + 1 < READ_ATTEMPTS:
                pause = RETRY_PAUSE_S * 2 ** attempt
                if mgr.rank == 0:
                    log.warning("checkpoint %s could not be read (%s); trying again in %.1f s", path,
                                _first(out.transient), pause)
                time.sleep(pause)
        if out.transient and not out.problems:
            raise CheckpointError(
                f"checkpoint {path} could not be read after {READ_ATTEMPTS} attempts: {_first(out.transient)}. "
                "It was neither skipped nor set aside, and no older checkpoint was loaded, so no progress "
                "is lost: resume again once the storage is reachable")
        if not out.problems:
            if skipped and mgr.rank == 0 and not mgr.read_only:  # another job's checkpoints stay as they are
                _set_aside(mgr, skipped)
                log.warning("resumed from %s after skipping %d newer checkpoint(s)", path, len(skipped))
            return out.manifest
        skipped.append((path, out.problems, out.committed))
    if skipped:
        raise CheckpointError(
            f"no loadable checkpoint under {st.root}: "
            + "; ".join(f"{p.rstrip('/').rsplit('/', 1)[-1]}: {_first(problems)}" for p, problems, _ in skipped)
            + ". To resume, use the job config these checkpoints were saved with (see `elastron ckpt "
              "inspect`) or restore a good one; to start over, use a new run directory")
    return None


def _set_aside(mgr: "Checkpoints", skipped: list[tuple[str, list[str], bool]]) -> None:
    """Rank 0, after a fallback: log each skipped checkpoint and set the committed ones aside."""
    st = mgr.storage
    for path, problems, committed in skipped:
        note = ""
        if committed:
            try:
                moved = st.set_aside(path)
            except OSError:
                log.warning("could not set %s aside", path, exc_info=True)
                moved = None
            if moved is None:
                mgr._unloadable.add(path.rstrip("/").rsplit("/", 1)[-1])
                note = "; kept in place until its step is saved again"
            else:
                note = f"; moved to {moved} for inspection (delete it when done)"
        log.warning("checkpoint %s cannot be loaded: %s%s; falling back to an older checkpoint",
                    path, _first(problems), note)
