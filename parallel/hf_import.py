"""Start from a Hugging Face Llama directory: its config.json becomes our ModelConfig, and its weights go
straight into any layout, each rank reading only the rows of the slices it owns.

A directory holds config.json and either model.safetensors, or shards listed by
model.safetensors.index.json (its weight_map), or shards alone. Everything is checked before a weight is
read (`check_hf_dir`): a missing or unreadable file, another architecture, an unknown RoPE scaling, a missing tensor or a shape that disagrees with config.json is one line naming it.

The weights are read by the checkpoint reader (`tensor_io.read_into`): each safetensors file becomes a
chunk of its tensors, so the same box intersection that reshards our checkpoints slices them. q and k
rows (and their biases, and the q/k norm weights) are in Hugging Face's RoPE order (halves of each
head); they are read a whole head at a time and put back into ours with `export.halves_to_interleaved`,
the inverse of what `elastron export` applies.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.config import ModelConfig
from models.hf_config import HFImportError, model_config_from_hf
from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.keys import MODEL_PREFIX
from parallel.checkpoint.manifest import Manifest
from parallel.checkpoint.state import local_box, named_state
from parallel.checkpoint.storage import LocalStorage
from parallel.checkpoint.tensor_io import SAFETENSORS_DTYPES, Target, dtype_name, read_header, read_into
from parallel.export import expected_shapes, halves_to_interleaved, hf_name, rope_heads

INDEX = "model.safetensors.index.json"


@dataclass(slots=True)
class HFWeights:
    """The directory's weights described as a checkpoint manifest (one chunk per tensor, no checksums)."""

    directory: Path
    manifest: Manifest
    file_keys: dict[str, str]
    """Our checkpoint key -> the tensor's name in the files."""


def _weight_files(directory: Path) -> dict[str, str | None]:
    """File name -> None, or, from the index, hf name -> file."""
    index = directory / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFImportError(f"model.init_from: cannot read {index}: {e}") from None
        return dict(weight_map)
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise HFImportError(f"model.init_from: {directory} has no *.safetensors weights")
    return dict.fromkeys(files)


def check_hf_dir(directory: str | os.PathLike[str], cfg: ModelConfig | None = None) -> HFWeights:
    """Everything that can be checked without reading a weight: config, files, names, shapes, dtypes."""
    directory = Path(directory)
    cfg = cfg or model_config_from_hf(directory)
    listed = _weight_files(directory)
    names = sorted(set(listed.values())) if any(listed.values()) else sorted(listed)
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}  # hf name -> (file, shape, dtype)
    files: dict[str, FileEntry] = {}
    for fname in names:
        if "/" in fname or fname in ("", ".", ".."):
            raise HFImportError(f"model.init_from: {directory / INDEX} names a file outside the directory: {fname!r}")
        path = directory / fname
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                header, _ = read_header(f, file_size=size, where=str(path))
        except FileNotFoundError:
            raise HFImportError(f"model.init_from: {path} is missing (listed in {INDEX})") from None
        except (OSError, CheckpointError) as e:
            raise HFImportError(f"model.init_from: cannot read {path}: {e}") from None
        files[fname] = FileEntry(size=size, digest="", algorithm="none")
        for k, v in header.items():
            if k != "__metadata__":
                found[k] = (fname, tuple(int(x) for x in v["shape"]), dtype_name(SAFETENSORS_DTYPES[v["dtype"]]))
    tensors: dict[str, TensorEntry] = {}
    file_keys: dict[str, str] = {}
    missing, wrong = [], []
    for name, shape in expected_shapes(cfg).items():
        h = hf_name(name)
        if h not in found:
            missing.append(h)
            continue
        fname, have, dt = found[h]
        if have != shape:
            wrong.append(f"{h} is {list(have)}, config.json implies {list(shape)}")
            continue
        tensors[MODEL_PREFIX + name] = TensorEntry(shape=shape, dtype=dt, chunks=(Chunk(fname, (0,) * len(shape), shape),))
        file_keys[MODEL_PREFIX + name] = h
    if missing:
        raise HFImportError(f"model.init_from: {directory} lacks {len(missing)} tensor(s) the model needs, e.g. "
                            f"{missing[0]} (an incomplete download, or not a Llama checkpoint)")
    if wrong:
        raise HFImportError(f"model.init_from: {directory}: {wrong[0]}" + (f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    return HFWeights(directory=directory, manifest=Manifest(step=0, tensors=tensors, files=files), file_keys=file_keys)


def load_hf_weights(model: nn.Module, weights: HFWeights, cfg: ModelConfig, *, threads: int = 2) -> int:
    """Copy the Hugging Face weights into this rank's shards of `model` (any layout); returns bytes read."""
    targets: dict[str, Target] = {}
    fixups: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
    for name, t in named_state(model).items():
        local, offsets = local_box(t)
        if not local.numel():
            continue
        key = MODEL_PREFIX + name
        if rope_heads(cfg, name) is not None:
            # Whole heads, in Hugging Face's row order; permuted into ours after the read.
            hd = cfg.head_dim
            h0, h1 = offsets[0] // hd, -(-(offsets[0] + local.shape[0]) // hd)
            whole = torch.empty(((h1 - h0) * hd, *local.shape[1:]), dtype=local.dtype, device=local.device)
            targets[key] = Target(whole, (h0 * hd, *offsets[1:]))
            fixups.append((whole, local, offsets[0] - h0 * hd, h1 - h0))
        else:
            targets[key] = Target(local, offsets)
    n = read_into(LocalStorage(str(weights.directory)), str(weights.directory), weights.manifest, targets,
                  threads=threads, verify=False, file_keys=weights.file_keys, read_through=False)
    with torch.no_grad():
        for whole, local, start, heads in fixups:
            local.copy_(halves_to_interleaved(whole, heads)[start:start + local.shape[0]])
    return n
