"""The DP x TP x PP layout: the single source of truth for how ranks form a mesh.

Pure: importing this module does not import torch.distributed; `build_mesh()` does, lazily.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh


class MeshAxis(StrEnum):
    """Mesh axis names, outermost first. TP is innermost so a TP group is a run of adjacent ranks
    (and therefore lands on one node when ranks are packed node by node)."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP = "tp"


AXIS_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.TP)

_KEYS = ("dp", "dp_replicate", "dp_shard", "tp", "pp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Degrees of each parallel axis. world_size = dp_replicate * dp_shard * tp * pp."""

    dp_replicate: int = 1
    """Replicas that each hold a full copy of the (TP/PP-local) parameters; gradients all-reduced."""
    dp_shard: int = 1
    """FSDP2 shards: parameters, gradients and optimizer state split across these ranks."""
    tp: int = 1
    """Tensor-parallel degree (DTensor column/row parallel)."""
    pp: int = 1
    """Pipeline stages (torch.distributed.pipelining); 1 means no pipeline code on the path."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"layout {name} must be an integer >= 1, got {v!r}")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    def degree(self, axis: MeshAxis | str) -> int:
        return getattr(self, MeshAxis(axis).value)

    def coords(self, rank: int) -> dict[MeshAxis, int]:
        """Position of `rank` on each axis (row-major over AXIS_ORDER, as DeviceMesh lays it out)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size} of layout {self}")
        out: dict[MeshAxis, int] = {}
        rest = rank
        for axis in reversed(AXIS_ORDER):
            d = self.degree(axis)
            out[axis] = rest % d
            rest //= d
        return {a: out[a] for a in AXIS_ORDER}

    @property
    def places(self) -> int:
        """Distinct boxes of the state: one per (pipeline stage, FSDP shard, TP shard); replicas share one."""
        return self.pp * self.dp_shard * self.tp

    def place(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, FSDP shard, TP shard) of `rank`: which box of the state it holds (ranks that
        differ only in their replica hold the same one). Arithmetic on the degrees, as `coords` lays the
        ranks out, without building the coordinates: the failure paths ask it of every rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size} of layout {self}")
        return rank // (self.dp * self.tp), rank // self.tp % self.dp_shard, rank % self.tp

    def dp_rank(self, rank: int) -> int:
        """Index of `rank` among the dp = dp_replicate x dp_shard data-parallel groups."""
        c = self.coords(rank)
        return c[MeshAxis.DP_REPLICATE] * self.dp_shard + c[MeshAxis.DP_SHARD]

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(
                f"layout {self} needs {self.world_size} ranks "
                f"(dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} x pp={self.pp}) "
                f"but there are {world_size}"
            )

    # -- text --------------------------------------------------------------------------------------
    def __str__(self) -> str:
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp = f"dp_replicate={self.dp_replicate},dp_shard={self.dp_shard}"
        elif self.dp_replicate > 1:
            dp = f"dp_replicate={self.dp_replicate}"
        else:
            dp = f"dp={self.dp_shard}"
        return f"{dp},tp={self.tp},pp={self.pp}"

    def short(self) -> str:
        """Compact form for tables: dp x tp x pp (with 'r' for replicated dp)."""
        dp = f"{self.dp_replicate}r" if self.dp_shard == 1 and self.dp_replicate > 1 else str(self.dp)
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp = f"{self.dp_replicate}rx{self.dp_shard}"
        return f"{dp}x{self.tp}x{self.pp}"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        unknown = sorted(set(d) - {"dp_replicate", "dp_shard", "tp", "pp"})
        if unknown:
            raise ValueError(f"unknown layout key(s) {unknown}; use dp_replicate, dp_shard, tp, pp")
        return cls(**{k: int(v) for k, v in d.items()})

    @classmethod
    def parse(cls, text: str, *, dp_mode: str = "shard") -> "Layout":
        """Parse "dp=2,tp=2,pp=1" (dp=N means N-way data parallel in `dp_mode`: "shard" = FSDP,
        "replicate" = DDP-style, "auto" = shard: the planner's "auto" chooses for the layouts it plans,
        a written layout says what it means) or the explicit "dp_replicate=2,dp_shard=2,tp=1,pp=1".
        Unspecified axes default to 1."""
        if dp_mode not in ("auto", "shard", "replicate"):
            raise ValueError(f"dp_mode must be 'auto', 'shard' or 'replicate', got {dp_mode!r}")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("empty layout; expected something like 'dp=2,tp=2,pp=1'")
        values: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            m = re.fullmatch(r"([a-z_]+)=(\d+)", part)
            if not m:
                raise ValueError(f"bad layout item {part!r} in {text!r}; expected KEY=N with KEY in {_KEYS}")
            key, val = m.group(1), int(m.group(2))
            if key not in _KEYS:
                raise ValueError(f"unknown layout key {key!r} in {text!r}; expected one of {_KEYS}")
            if key in values:
                raise ValueError(f"layout key {key!r} given twice in {text!r}")
            values[key] = val
        if "dp" in values and ({"dp_replicate", "dp_shard"} & values.keys()):
            raise ValueError(f"give either dp= or dp_replicate=/dp_shard= in {text!r}, not both")
        dp = values.pop("dp", None)
        if dp is not None:
            values["dp_replicate" if dp_mode == "replicate" else "dp_shard"] = dp
        return cls(**values)

    # -- mesh --------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str = "cpu") -> "DeviceMesh":
        """A 4-D DeviceMesh with axes named by MeshAxis. Requires an initialised process group of
        `world_size` ranks; every rank calls it.

        Each rank makes only its own group on each axis (`new_group` with local synchronization: only
        the members take part), the default group standing for an axis that spans the world: four
        `new_group` calls per rank at most. torch's `init_device_mesh` on gloo has every rank call
        `new_group` for every group of every axis instead, the sum of world / degree over the axes:
        3N calls per rank for dp=N (its three axes of degree 1 are N singleton groups each).
        The members of a group agree on its name because torch names a locally synchronised group by its
        ranks and the number of groups the process already has: every rank must have made as many groups
        since the default group was formed (the trainer builds its mesh before its per-stage groups)."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        self.check_world_size(dist.get_world_size())
        ranks = torch.arange(self.world_size).reshape(tuple(self.degree(a) for a in AXIS_ORDER))
        at = self.coords(dist.get_rank())
        groups = []
        for axis in AXIS_ORDER:
            line = ranks[tuple(slice(None) if a is axis else at[a] for a in AXIS_ORDER)].tolist()
            groups.append(dist.group.WORLD if len(line) == self.world_size else
                          dist.new_group(line, use_local_synchronization=True, group_desc=f"mesh_{axis.value}"))
        return DeviceMesh.from_group(groups, device_type, mesh=ranks,
                                     mesh_dim_names=tuple(a.value for a in AXIS_ORDER))
