"""Turning a rank's model and optimizer into the flat tensor dict a checkpoint stores, and back.

Keys are layout-free: ``model.<canonical name>`` and ``optim.<state>.<canonical name>`` (optimizer
state is keyed by the FQN of its parameter, and pipeline stages keep canonical names), and each rank
stores the box of the global tensor it holds (its DTensor shard, or the whole plain tensor) with its
offsets, so a load into any layout intersects boxes (tensor_io). No torch.distributed.checkpoint: its
planner, its collectives and its zero-LR optimizer step are not needed for boxes.
Only tensors with at least one dimension go into the files: AdamW's 0-d `step` counters are returned
separately and stored in the manifest (FACTS.md: non-tensor leaves corrupt HF safetensors files, and
consolidation zeroes 0-d tensors).
"""

from __future__ import annotations

import base64
import random
import threading
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.optim.optimizer import _get_scalar_dtype

from models.llama import canonical_name
from parallel.checkpoint.host_pool import HostPool
from parallel.checkpoint.host_pool import layout as pool_layout
from parallel.checkpoint.errors import CheckpointError
from parallel.checkpoint.keys import MODEL_PREFIX, OPTIM_PREFIX, param_of
from parallel.checkpoint.tensor_io import Target
from parallel.checkpoint.writer import Piece
from parallel.unset import mark_unset


def _optim_key(state_name: str, fqn: str) -> str:
    return f"{OPTIM_PREFIX}{state_name}.{fqn}"


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by their one canonical name. state_dict (not named_parameters): FSDP2's hooks
    hand out the sharded parameters, and persistent buffers are included; keep_vars keeps the very objects
    the optimizer's state is keyed by. A tied table appears once, as `tok_embeddings.weight`, also where a
    pipeline's last stage holds it as the output projection (a replica of the first stage's box)."""
    cfg = getattr(model, "cfg", None)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = canonical_name(cfg, name) if cfg is not None else name
        if key in out:
            if out[key] is not t:
                raise CheckpointError(f"{name} and {key} are tied but hold different tensors")
            continue
        out[key] = t
    return out



def collect(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(tensors by checkpoint key, optimizer step counters by canonical name). The tensors are the live
    parameters and optimizer buffers (no copy; DTensors stay DTensors): stage them before training
    continues."""
    named = named_state(model)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"model state {name!r} is a {type(t).__name__}, not a tensor")
        tensors[MODEL_PREFIX + name] = t
    fqns = {id(t): n for n, t in named.items()}
    steps: dict[str, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            fqn = fqns.get(id(p))
            if fqn is None:
                raise CheckpointError("the optimizer holds a parameter that is not in the model's state dict")
            for sname, v in st.items():
                if sname == "step":
                    steps[fqn] = int(v.item() if isinstance(v, torch.Tensor) else v)
                elif isinstance(v, torch.Tensor) and v.dim() > 0:
                    tensors[_optim_key(sname, fqn)] = v
                else:
                    raise CheckpointError(f"optimizer state {sname!r} of {fqn} is not a tensor with dimensions; "
                                          "only AdamW-style state (tensors plus a step counter) is supported")
    return tensors, steps


def collect_planned(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The tensors a save will hold once the optimizer has stepped: `collect`'s, plus, for each parameter
    that has no Adam/AdamW state yet, the moments its first step creates (the parameter stands in for
    them: same box, same dtype). For sizing what a save needs before the first step."""
    tensors, _ = collect(model, optimizer)
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return tensors
    fqns = {id(t): n for n, t in named_state(model).items()}
    for group in optimizer.param_groups:
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
        for p in group["params"]:
            if not optimizer.state.get(p) and id(p) in fqns:
                for sname in names:
                    tensors[_optim_key(sname, fqns[id(p)])] = p
    return tensors


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this rank's part of `t`, detached, and its offsets in the global tensor). A DTensor's box comes
    from its mesh and placements (uneven FSDP shards and TP-inside-FSDP strided shards included)."""
    if isinstance(t, DTensor):
        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local().detach()
        if tuple(local.shape) != tuple(shape):
            raise CheckpointError(f"a DTensor's local shard is {list(local.shape)}, its placements say {list(shape)}")
        return local, tuple(int(o) for o in offsets)
    return t.detach(), (0,) * t.dim()


def boxes_to_load(model: nn.Module, keys) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Key -> (offsets, sizes) of this rank's box, for each of `keys` (``model.<p>``, ``optim.<state>.<p>``)
    whose parameter this rank holds a non-empty box of: what a load reads, before any optimizer state
    exists (moments have their parameter's box). No data is touched."""
    mine: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, t in named_state(model).items():
        if isinstance(t, DTensor):
            shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            box = (tuple(int(o) for o in offsets), tuple(int(s) for s in shape))
        else:
            box = ((0,) * t.dim(), tuple(t.shape))
        if all(s > 0 for s in box[1]):
            mine[name] = box
    return {k: mine[p] for k in keys if (p := param_of(k)) in mine}


def pieces(tensors: dict[str, torch.Tensor]) -> list[Piece]:
    """This rank's non-empty boxes of every tensor, as writer pieces over the live memory."""
    out = []
    for key, t in tensors.items():
        local, offsets = local_box(t)
        if local.numel():
            out.append(Piece(key=key, data=local, offsets=offsets))
    return out


def assign_writers(plans: list[list[tuple[str, tuple[int, ...], tuple[int, ...], int]]]) -> list[set[tuple[str, tuple[int, ...]]]]:
    """Which rank writes which chunk. `plans[r]` lists rank r's boxes as (key, offsets, sizes, bytes);
    a box held by several ranks (data-parallel replicas, TP-replicated norms) is written once, by the
    holder with the fewest bytes so far (largest boxes first), so replicas share the writing. Pure and
    deterministic: every rank computes the same answer from the same gathered plans."""
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    nbytes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    for r, plan in enumerate(plans):
        for key, offsets, sizes, n in plan:
            item = (key, tuple(offsets), tuple(sizes))
            holders.setdefault(item, []).append(r)
            nbytes[item] = n
    load = [0] * len(plans)
    out: list[set[tuple[str, tuple[int, ...]]]] = [set() for _ in plans]
    for item in sorted(holders, key=lambda i: (-nbytes[i], i)):
        r = min(holders[item], key=lambda r: (load[r], r))
        load[r] += nbytes[item]
        out[r].add((item[0], item[1]))
    return out


class Stager:
    """Copies the pieces a rank writes off the compute buffers into one host buffer (`HostPool`),
    allocated once and reused while the pieces keep their shapes: the only part of an async save that
    blocks training. On CUDA the buffer is pinned and the copies run on a side stream, so they go at full
    PCIe bandwidth."""

    def __init__(self) -> None:
        self._pool: HostPool | None = None
        self._signature: tuple | None = None
        self._views: list[torch.Tensor] = []
        self._stream = None
        self._reserving: threading.Thread | None = None
        self.allocations = 0
        """Pools allocated so far (a reservation included)."""

    @staticmethod
    def pool_bytes(items: list[Piece]) -> int:
        """Bytes of the pool that holds `items` (each aligned)."""
        return pool_layout([p.nbytes for p in items])[1]

    def reserve(self, sizes: list[int], *, pin: bool) -> None:
        """Allocate a pool for pieces of `sizes` bytes now, in a background thread (pages faulted in, and
        pinned when `pin`), so the first `stage()` of such pieces finds it ready instead of paying for
        it; `stage()` waits for a reservation still under way."""
        self._wait_reserved()
        if self._fits(sizes, pin):
            return

        def allocate() -> None:
            self._replace(HostPool(sizes, pin=pin))

        self._reserving = threading.Thread(target=allocate, name="ckpt-stage-reserve", daemon=True)
        self._reserving.start()

    def _fits(self, sizes: list[int], pin: bool) -> bool:
        return self._pool is not None and self._pool.pinned == pin and self._pool.fits(sizes)

    def _replace(self, pool: HostPool) -> None:
        if self._pool is not None:
            self._pool.release()
        self._pool, self._signature = pool, None
        self.allocations += 1

    def _wait_reserved(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def stage(self, items: list[Piece], *, after: Any = None) -> list[Piece]:
        """Copies of `items` in the pool; on CUDA the copies wait for the CUDA event `after` (if given)
        instead of everything queued on the current stream."""
        self._wait_reserved()
        signature = tuple((p.key, tuple(p.data.shape), p.data.dtype, p.data.is_cuda) for p in items)
        cuda = any(p.data.is_cuda for p in items)
        if signature != self._signature:
            self._allocate(items, pin=cuda)
            self._signature = signature
        with torch.no_grad():
            if cuda:
                # The writer thread that may run this starts on device 0: name the shards' device.
                device = next(p.data.device for p in items if p.data.is_cuda)
                with torch.cuda.device(device):
                    if self._stream is None or self._stream.device != device:
                        self._stream = torch.cuda.Stream(device=device)
                    if after is not None:
                        self._stream.wait_event(after)
                    else:
                        self._stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(self._stream):
                        for p, buf in zip(items, self._views):
                            buf.copy_(p.data, non_blocking=True)
                    self._stream.synchronize()
            else:
                for p, buf in zip(items, self._views):
                    buf.copy_(p.data)
        return [Piece(key=p.key, data=buf, offsets=p.offsets) for p, buf in zip(items, self._views)]

    def _allocate(self, items: list[Piece], *, pin: bool) -> None:
        """Views of the pool for `items`; a new pool only if the one there (e.g. reserved) cannot hold them."""
        sizes = [p.nbytes for p in items]
        if not self._fits(sizes, pin):
            self._views = []
            self._replace(HostPool(sizes, pin=pin))
        self._views = self._pool.views([p.data for p in items])


def ensure_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], *,
                           zero: bool = True) -> None:
    """Create AdamW's state (zero step, zero moments) for each of `params` that has none yet, exactly as
    AdamW's first step would, so a fresh trainer can be loaded into without a dummy optimizer step.
    `zero=False`: the moments are allocated but left unset (`parallel.unset`), for a caller that writes
    every element of them next."""
    missing = [p for p in params if not optimizer.state.get(p)]
    if not missing:
        return
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise CheckpointError(f"cannot create the state of a {type(optimizer).__name__} before loading; "
                              "only Adam/AdamW are supported")
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for p in missing:
        group = group_of[id(p)]
        fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
        moment = torch.zeros_like if zero else torch.empty_like
        st: dict[str, Any] = {
            "step": (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
                     if fused or capturable else torch.tensor(0.0, dtype=_get_scalar_dtype())),
            "exp_avg": moment(p, memory_format=torch.preserve_format),
            "exp_avg_sq": moment(p, memory_format=torch.preserve_format),
        }
        if group.get("amsgrad"):
            st["max_exp_avg_sq"] = moment(p, memory_format=torch.preserve_format)
        if not zero:
            mark_unset(v for k, v in st.items() if k != "step")
        optimizer.state[p] = st


def load(model: nn.Module, optimizer: torch.optim.Optimizer, read: Callable[[dict[str, Target]], Any],
         optimizer_steps: dict[str, int]) -> None:
    """Fill `model` and `optimizer` in place: `read(targets)` copies the checkpoint into this rank's boxes
    of every tensor (the live shards themselves, so nothing is written back afterwards). A parameter has
    optimizer state after the load exactly when the checkpoint has a step counter for it: missing state is
    created (`ensure_optimizer_state`), state the checkpoint does not have (saved before the first step)
    is dropped. Moments created here are not zeroed first: `read` writes every element of them (the
    manifest's chunks cover each tensor exactly; a live fill checks its coverage)."""
    fqns = {id(t): n for n, t in named_state(model).items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unknown = [p for p in params if id(p) not in fqns]
    if unknown:
        raise CheckpointError("the optimizer holds a parameter that is not in the model's state dict")
    with_state = [p for p in params if fqns[id(p)] in optimizer_steps]
    for p in params:
        if fqns[id(p)] not in optimizer_steps:
            optimizer.state.pop(p, None)
    ensure_optimizer_state(optimizer, with_state, zero=False)
    for p in with_state:
        st = optimizer.state[p]
        n = optimizer_steps[fqns[id(p)]]
        if isinstance(st.get("step"), torch.Tensor):
            st["step"].fill_(n)
        else:
            st["step"] = n
    tensors, _ = collect(model, optimizer)
    read({k: Target(*local_box(t)) for k, t in tensors.items()})


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
