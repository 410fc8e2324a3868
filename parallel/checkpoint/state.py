"""Turning a rank's model and optimizer into the flat tensor dict a checkpoint stores, and back.

Keys are layout-free: ``model.<canonical name>`` and ``optim.<state>.<canonical name>`` (DCP's
`get_state_dict` keys optimizer state by parameter FQN, and pipeline stages keep canonical names), and
values are this rank's DTensor shards or plain tensors, so DCP can reshard them on load into any layout.
Only tensors with at least one dimension go into the files: AdamW's 0-d `step` counters are returned
separately and stored in the manifest (FACTS.md: non-tensor leaves corrupt HF safetensors files, and
consolidation zeroes 0-d tensors).
"""

from __future__ import annotations

import base64
import random
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from parallel.checkpoint.manifest import MODEL_PREFIX, OPTIM_PREFIX, CheckpointError


def _optim_key(state_name: str, fqn: str) -> str:
    return f"{OPTIM_PREFIX}{state_name}.{fqn}"


def collect(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(tensors by checkpoint key, optimizer step counters by canonical name). The tensors are the live
    parameters and optimizer buffers (no copy): stage them before training continues."""
    msd, osd = get_state_dict(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in msd.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"model state {name!r} is a {type(t).__name__}, not a tensor")
        tensors[MODEL_PREFIX + name] = t
    steps: dict[str, int] = {}
    for fqn, st in osd.get("state", {}).items():
        for sname, v in st.items():
            if sname == "step":
                steps[fqn] = int(v.item() if isinstance(v, torch.Tensor) else v)
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                tensors[_optim_key(sname, fqn)] = v
            else:
                raise CheckpointError(f"optimizer state {sname!r} of {fqn} is not a tensor with dimensions; "
                                      "only AdamW-style state (tensors plus a step counter) is supported")
    return tensors, steps


class Stager:
    """Copies state off the compute buffers into reusable CPU buffers: the only part of an async save
    that blocks training. Buffers are allocated on first use and kept, so later saves are pure copies
    (pinned memory on CUDA, so the copy overlaps nothing else and runs at full PCIe bandwidth)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        cuda = False
        with torch.no_grad():
            for key, t in tensors.items():
                local = t.to_local() if isinstance(t, DTensor) else t
                buf = self._buffers.get(key)
                if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                    buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
                    self._buffers[key] = buf
                buf.copy_(local.detach(), non_blocking=local.is_cuda)
                cuda = cuda or local.is_cuda
                if isinstance(t, DTensor):
                    # Same mesh and placements: DCP computes this shard's global offsets from them.
                    out[key] = DTensor.from_local(buf, t.device_mesh, t.placements, run_check=False,
                                                  shape=t.shape, stride=t.stride())
                else:
                    out[key] = buf
        if cuda:
            torch.cuda.synchronize()
        return out


def load(model: nn.Module, optimizer: torch.optim.Optimizer, read: Callable[[dict[str, torch.Tensor]], None],
         optimizer_steps: dict[str, int]) -> None:
    """Fill `model` and `optimizer` in place: `read(targets)` copies the checkpoint into the given
    (sharded) tensors; step counters come from the manifest. Optimizer state is created first (DCP's
    `get_state_dict` runs a zero-LR step for that), so every target exists with its final sharding."""
    msd, osd = get_state_dict(model, optimizer)
    targets = {MODEL_PREFIX + k: v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for sname, v in st.items():
            if sname == "step":
                if fqn not in optimizer_steps:
                    raise CheckpointError(f"checkpoint has no optimizer step counter for {fqn}")
                if isinstance(v, torch.Tensor):
                    v.fill_(optimizer_steps[fqn])
                else:
                    st[sname] = optimizer_steps[fqn]
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                targets[_optim_key(sname, fqn)] = v
    read(targets)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


# -- RNG ---------------------------------------------------------------------------------------------

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU (and CUDA) generator states as JSON-able values."""
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(d: Any) -> None:
    """Inverse of `capture_rng`; raises ValueError if the saved states are malformed."""
    try:
        version, state, gauss = d["python"]
        random.setstate((int(version), tuple(int(x) for x in state), gauss))
        name, keys, pos, has_gauss, cached = d["numpy"]
        np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
        torch.set_rng_state(_unb64(d["torch"]))
        if "cuda" in d and torch.cuda.is_available():
            states = [_unb64(s) for s in d["cuda"]]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"malformed RNG state: {e}") from None
