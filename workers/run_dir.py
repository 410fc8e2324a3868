"""Whether a run can write where it was told to, checked before anything starts (`elastron train`, the
torchrun entry, `elastron run`): a path that cannot hold metrics or checkpoints fails in one line rather
than after the first interval of training."""

from __future__ import annotations

import os
from pathlib import Path

from workers.config import JobConfig


def check_run_dir(cfg: JobConfig, run_dir: str | Path) -> None:
    """The run directory (and a local checkpoint.dir) must be a directory this process can write, or one
    it can create: checked up front, creating nothing, so that a path that cannot hold metrics or
    checkpoints fails here in one line rather than after the first interval of training."""
    dirs = [("run directory", str(run_dir), "--run-dir")]
    ck = cfg.checkpoint.dir
    if ck and ("://" not in ck or ck.startswith("file://")):
        dirs.append(("checkpoint.dir", ck.removeprefix("file://"), "checkpoint.dir"))
    for what, d, where in dirs:
        near = Path(d).expanduser().absolute()
        while not near.exists() and near != near.parent:
            near = near.parent  # the nearest existing ancestor: where the directory would be created
        if not near.is_dir():
            raise ValueError(f"{what} {d!r} cannot be created: {str(near)!r} is not a directory; "
                             f"pick another path ({where})")
        if not os.access(near, os.W_OK | os.X_OK):
            raise ValueError(f"{what} {d!r} is not writable: permission denied on {str(near)!r}; "
                             f"pick another path ({where}) or fix its permissions")
