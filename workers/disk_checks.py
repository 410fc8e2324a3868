"""The job config's checks that look at the disk, made where a path is read and early at the edges that
share its filesystem (the CLI, the API server), never by a config's constructor, which runs wherever the
config travels."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from workers.config import DataConfig, JobConfig
from workers.strict import ConfigError


def check_data_path(data: DataConfig) -> None:
    """data.path must be there, of the right kind, and readable by this process: called where the path
    is read (the data source of every rank) and early at the edges that share its filesystem (the CLI,
    the API server), never by the config's constructor, which runs wherever the config travels.
    ConfigError naming the field, in one line."""
    if data.source == "synthetic":
        return
    for name, path in (("data.path", data.path), ("data.val_path", data.val_path)):
        if path is not None:
            _check_path(name, path, data)


def _check_path(name: str, path: str, data: DataConfig) -> None:
    p = Path(path).expanduser()
    want_dir = data.source == "corpus"
    if not p.exists():
        raise ConfigError(f"{name} {path!r} does not exist", loc=("data", name.split(".")[1]))
    if want_dir and not p.is_dir():
        raise ConfigError(f"{name} {path!r} must be a directory for source 'corpus'", loc=("data", name.split(".")[1]))
    if not want_dir and not p.is_file():
        raise ConfigError(f"{name} {path!r} must be a file for source 'tokens'", loc=("data", name.split(".")[1]))
    if not os.access(p, os.R_OK | (os.X_OK if want_dir else 0)):
        raise ConfigError(f"{name} {path!r} is not readable by this user; fix its permissions",
                          loc=("data", name.split(".")[1]))
    if want_dir and not _has_file(p, tuple(data.suffixes)):
        raise ConfigError(f"{name} {path!r} holds no readable file ending with {data.suffixes} "
                          "(see data.suffixes)", loc=("data", name.split(".")[1]))


def _has_file(root: Path, suffixes: tuple[str, ...]) -> bool:
    """Whether the corpus under `root` has a readable file ending with `suffixes` (stops at the first)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(suffixes) and os.access(os.path.join(dirpath, name), os.R_OK):
                return True
    return False


def resolve_init_from(cfg: JobConfig, *, weights: bool = True) -> JobConfig:
    """`cfg` with the model's shape read from model.init_from's config.json (`cfg` itself without it),
    where a job enters (`elastron run`/`train`, the REST API) and a rank starts (workers.train). With
    `weights`, the safetensors headers (names, shapes, dtypes) are checked against it too. ConfigError in
    one line for a missing, unreadable, incomplete or mismatched directory."""
    m = cfg.model
    if m.init_from is None:
        return cfg
    from models.hf_config import HFImportError, model_config_from_hf

    directory = Path(m.init_from).expanduser()
    try:
        shape = model_config_from_hf(directory)
        if weights:
            from parallel.hf_import import check_hf_dir  # torch: only where weights are checked
            check_hf_dir(directory, shape)
    except HFImportError as e:
        raise ConfigError(str(e), loc=("model", "init_from")) from None
    except OSError as e:  # a path that cannot even be looked at (name too long, ...)
        raise ConfigError(f"model.init_from {m.init_from!r} cannot be read: {e.strerror or e}",
                          loc=('model', 'init_from')) from None
    # Absolute, as the caller meant it: the ranks may start in another working directory.
    return dataclasses.replace(cfg, model=dataclasses.replace(m, init_from=str(directory.absolute()), resolved=shape))
