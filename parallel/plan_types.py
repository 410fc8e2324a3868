"""What the planner takes and gives: `Constraints` in, a `Plan` (or a `PlanError`) out. Pure, like the
planner (`parallel/planner.py`), which re-exports these names."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout import Layout

DP_MODES = ("auto", "shard", "replicate")


class PlanError(ValueError):
    """No valid layout exists for the offered workers; the message says why, with numbers."""


def check_int(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Constraints:
    """What the planner must respect besides the model shape."""

    global_batch_size: int
    """Samples per optimizer step (the job's train.global_batch_size), fixed under every layout."""
    micro_batch_size: int
    """Preferred (largest) samples per forward/backward per DP rank."""
    seq_len: int
    """Tokens per sample."""
    dp_mode: str = "shard"
    """"shard": dp goes to dp_shard (FSDP); "replicate": dp goes to dp_replicate; "auto": dp_replicate
    where the replicas fit (`replicate_fits`), dp_shard otherwise."""
    device_type: str | None = None
    """"cpu" or "cuda" where the job runs, None if not known. Only dp_mode "auto" reads it."""
    layout: Layout | None = None
    """Force this exact layout. It fixes the worker count (min_workers and max_workers do not apply)."""
    tp: int | None = None
    """Force this TP degree (not with `layout`, which fixes it)."""
    pp: int | None = None
    """Force this PP degree (not with `layout`, which fixes it)."""
    max_tp: int | None = None
    """Upper bound on the TP degree."""
    max_pp: int | None = None
    """Upper bound on the PP degree."""
    gpus_per_node: int | None = None
    """Devices per node: a TP group must fit inside one, so tp must divide it."""
    memory_budget_bytes: float | None = None
    """Per-device memory budget; None means unlimited."""
    param_bytes: int = 4
    """Bytes per parameter of the weights (4 for fp32, 2 for bf16)."""
    min_workers: int = 1
    """Fewest workers a plan may use."""
    max_workers: int | None = None
    """Most workers a plan may use."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "seq_len", "param_bytes", "min_workers"):
            check_int(name, getattr(self, name))
        for name in ("tp", "pp", "max_tp", "max_pp", "gpus_per_node", "max_workers"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise ValueError(f"layout must be a Layout, got {self.layout!r}")
        if self.layout is not None and (self.tp is not None or self.pp is not None):
            raise ValueError(f"a forced layout {self.layout} fixes tp and pp; do not force them as well")
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode must be one of {DP_MODES}, got {self.dp_mode!r}")
        if self.device_type not in ("cpu", "cuda", None):
            raise ValueError(f"device_type must be 'cpu', 'cuda' or None, got {self.device_type!r}")
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes > 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes!r}")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"min_workers={self.min_workers} is greater than max_workers={self.max_workers}")
        for forced, cap in (("tp", "max_tp"), ("pp", "max_pp")):
            f, m = getattr(self, forced), getattr(self, cap)
            if f is not None and m is not None and f > m:
                raise ValueError(f"forced {forced}={f} exceeds {cap}={m}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The chosen layout for one world size, its micro batch, and why. The contract with the workers:
    it crosses to every rank whole (`to_dict`/`from_dict`), and the trainer runs exactly this."""

    layout: Layout
    world_size: int
    """Workers used (= layout.world_size)."""
    available: int
    """Workers offered."""
    micro_batch_size: int
    grad_accum_steps: int
    """Microbatches per DP rank per optimizer step = global_batch_size / (micro_batch_size * dp)."""
    memory_bytes: float
    """Estimated peak per device (see the module docstring)."""
    reasons: tuple[str, ...]
    """Why this layout, and why any offered workers are left unused."""

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "world_size": self.world_size, "available": self.available,
                "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
                "memory_bytes": self.memory_bytes, "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(layout=Layout.from_dict(d["layout"]), world_size=int(d["world_size"]),
                   available=int(d["available"]), micro_batch_size=int(d["micro_batch_size"]),
                   grad_accum_steps=int(d["grad_accum_steps"]), memory_bytes=float(d["memory_bytes"]),
                   reasons=tuple(d.get("reasons", ())))
