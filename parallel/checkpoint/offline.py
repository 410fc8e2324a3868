"""Single-process tools on checkpoints, no process group: `inspect` (for `elastron ckpt inspect`) and
`load_full_model_state` (for HF export and evaluation).

Both accept a checkpoint directory (``.../checkpoints/step-00000100``) or a checkpoints root, which
resolves to what `latest` names (else the newest step directory). Both verify every byte of the
checkpoint, model and optimizer alike, before answering: an export never comes from a checkpoint that a
training run would refuse.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.formats import MANIFEST_NAME
from parallel.checkpoint.keys import MODEL_PREFIX
from parallel.checkpoint.storage import Storage, open_storage
from parallel.checkpoint.validate import check_checkpoint, list_step_dirs, parse_step, read_latest

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)


def _candidates(path: str, storage_options: dict[str, Any]) -> tuple[Storage, list[str]]:
    """Checkpoint directories `path` may mean, preferred first."""
    storage = open_storage(path, **storage_options)
    root = storage.root
    if not storage.exists(root):  # checked first: a missing path must not pass for a step directory
        raise CheckpointError(f"{root} does not exist")
    if storage.exists(storage.join(root, MANIFEST_NAME)) or parse_step(os.path.basename(root.rstrip("/"))) is not None:
        return storage, [root]
    names = [n for _, n in list_step_dirs(storage)]
    latest = read_latest(storage)
    if latest in names:
        names.remove(latest)
        names.insert(0, latest)
    if not names:
        raise CheckpointError(f"{root} is neither a checkpoint directory nor a checkpoints root with "
                              "step-* directories")
    return storage, [storage.join(root, n) for n in names]


def inspect(path: str | os.PathLike[str], *, checksums: bool = True, **storage_options: Any) -> dict[str, Any]:
    """What a checkpoint holds and whether it is loadable: step, layout, tensors (global shape, dtype),
    files (size, checksum algorithm, digest), `valid` and `problems` (empty when valid). Raises CheckpointError only when
    `path` holds no checkpoint at all; a broken one is reported, not raised."""
    storage, paths = _candidates(os.fspath(path), storage_options)
    ckpt = paths[0]
    check = check_checkpoint(storage, ckpt, checksums=checksums)
    m = check.manifest
    out: dict[str, Any] = {
        "path": ckpt,
        "step": m.step if m else parse_step(ckpt.rstrip("/").rsplit("/", 1)[-1]),
        "valid": check.ok,
        "problems": list(check.problems),
        "format_version": m.format_version if m else None,
        "layout": m.layout if m else None,
        "world_size": m.state.get("world_size") if m else None,
        "model_config": m.state.get("model_config") if m else None,
        "job_config_digest": m.state.get("job_config_digest") if m else None,
        "data": m.state.get("data") if m else None,
        "lr_schedule": m.state.get("lr_schedule") if m else None,
        "created": m.created if m else None,
        "tensors": {k: {"shape": list(t.shape), "dtype": t.dtype} for k, t in sorted(m.tensors.items())} if m else {},
        "files": {k: {"size": f.size, "algorithm": f.algorithm, "digest": f.digest}
                  for k, f in sorted(m.files.items())} if m else {},
    }
    out["total_bytes"] = sum(f["size"] for f in out["files"].values())
    return out


def load_full_model_state(path: str | os.PathLike[str], **storage_options: Any
                          ) -> tuple[dict[str, "torch.Tensor"], dict[str, Any]]:
    """(full unsharded model parameters by canonical name, manifest as a dict), assembled in this process
    from the safetensors shards. Given a checkpoints root, the newest valid checkpoint is used (skipped
    ones are logged); given one checkpoint directory, any problem raises CheckpointError."""
    from parallel.checkpoint.tensor_io import assemble

    storage, paths = _candidates(os.fspath(path), storage_options)
    reasons = []
    for ckpt in paths:
        check = check_checkpoint(storage, ckpt)
        if check.ok:
            m = check.manifest
            keys = [k for k in m.tensors if k.startswith(MODEL_PREFIX)]
            full = assemble(storage, ckpt, m, keys)
            return {k[len(MODEL_PREFIX):]: v for k, v in full.items()}, m.to_dict()
        reason = "; ".join(check.problems)
        if len(paths) > 1:
            log.warning("checkpoint %s cannot be loaded: %s; trying the previous one", ckpt, reason)
        reasons.append(f"{ckpt}: {reason}")
    raise CheckpointError("no loadable checkpoint: " + " | ".join(reasons))
