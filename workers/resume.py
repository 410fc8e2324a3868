"""Whose checkpoint a job may resume from: its own, or one the user names in `checkpoint.resume_from`.

A checkpoint carries the job name and model config that wrote it. Resuming another job's checkpoint (a
`checkpoint.dir` shared by mistake) or one written under another model config would silently continue
someone else's run, so it is refused in one line unless the user says so with `checkpoint.resume_from`.
Checkpoints written before the job name was recorded are judged on the model config alone.
"""

from __future__ import annotations

from typing import Any

from parallel.checkpoint.errors import CheckpointError


def refuse_foreign(state: dict[str, Any], *, job_name: str, model_config: dict[str, Any], where: str) -> None:
    """Raise CheckpointError if `state` (a checkpoint's JSON state) was written by another job or under
    another model config."""
    theirs = state.get("job_name")
    if theirs is not None and theirs != job_name:
        why = f"job {theirs!r} wrote it and this job is {job_name!r}"
    elif state.get("model_config") is not None and state["model_config"] != model_config:
        diff = sorted(k for k in set(state["model_config"]) | set(model_config)
                      if state["model_config"].get(k) != model_config.get(k))
        why = f"it was written under another model config ({', '.join(diff)} differ)"
    else:
        return
    raise CheckpointError(f"{where}: {why}; refusing to resume from it. Use a checkpoint.dir of this job's "
                          "own, or set checkpoint.resume_from to that directory to start from it on purpose")
