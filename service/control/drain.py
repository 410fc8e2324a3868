"""How long before a drain's deadline the group moves off the noticed node: the drain's lead.

A drain notice with a deadline (AWS: 120 s) need not cost the noticed node's throughput for the whole
notice. The group trains on with it while `now < deadline - lead` (the scaling policy, rule 3:
service.control.policy) and moves off it once the lead is reached. The policy decides only between
training calls, so the lead must cover the call that a hold lets run, plus the move off the node (the
part of a move that still needs it: the hand-over and the transfer; forming the new group and its first
step come after):

    lead = max(floor_s, margin x (call_s + move_s))

`call_s`: the longest a training call between two decisions lasts (the last step, or the coordinator's
chunk when that is longer). `move_s`: the last measured move off a node, or `default_move_s` until one
is measured. margin 0 means no lead at all: the group moves off at once, whatever the deadline.
Pure: the coordinator measures, this computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.config import ParallelConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class DrainLead:
    margin: float
    """The lead's factor over the measured call and move; 0: move off at once (parallel.drain_margin)."""
    floor_s: float
    """The shortest lead (parallel.drain_floor_s)."""
    default_move_s: float
    """The move assumed before one is measured (parallel.drain_move_s)."""

    def __post_init__(self) -> None:
        for name in ("margin", "floor_s", "default_move_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def of(cls, p: ParallelConfig) -> DrainLead:
        """The job's lead rule, from its parallel section."""
        return cls(margin=p.drain_margin, floor_s=p.drain_floor_s, default_move_s=p.drain_move_s)

    def lead_s(self, *, call_s: float, move_s: float | None) -> float | None:
        """Seconds before a deadline to start moving off its node; None: move off at once (margin 0).
        `call_s`: the longest training call between two decisions; `move_s`: the last measured move off
        a node (None: none measured yet)."""
        for name, v in (("call_s", call_s), ("move_s", 0.0 if move_s is None else move_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
        if self.margin == 0:
            return None
        move = self.default_move_s if move_s is None else move_s
        return max(self.floor_s, self.margin * (call_s + move))
