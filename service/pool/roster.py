"""Who a worker group holds: one `WorkerHandle` per worker actor, whatever its `Role`, all in one `Roster`
(the members first, in rank order). A handle's `ping` is its last `info` (or `claim`) call; `answer`,
`sound` and `idle` read it without waiting."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup

from workers.report import WorkerInfo

__all__ = ["Role", "Roster", "WorkerHandle"]


class Role(StrEnum):
    MEMBER = "member"
    """A rank of the group, in its placement group."""
    SPARE = "spare"
    """Started in a placement group of its own but not a rank: ahead of a growth (`prewarm`), or a member
    a salvage kept idle; the next start takes it."""
    STANDBY = "standby"
    """Idle on its node, reserving nothing until a start claims it with a placement group."""


@dataclass(eq=False, slots=True)
class WorkerHandle:
    """One worker actor of the group, whatever its role."""

    actor: Any
    node_id: str
    pg: PlacementGroup | None
    """Its placement group (None for a standby)."""
    role: Role
    ip: str = ""
    ping: Any = None
    """Ref of its last `info` call (a standby's ping, a starting worker's answer) or, claimed, its `claim`."""
    rejoins: bool = False
    """A member a salvage kept as a spare: taken back by a start, it counts as rejoined, not started."""

    def answer(self) -> WorkerInfo | None:
        """What its `info` (or `claim`) call `ping` answered; None while it runs, or if it failed."""
        try:
            return ray.get(self.ping, timeout=0)
        except RayError:  # GetTimeoutError too
            return None

    def sound(self) -> bool:
        """Whether its `ping` has not failed (finished well, or still running)."""
        done, _ = ray.wait([self.ping], timeout=0)
        return not done or self.answer() is not None

    def idle(self) -> bool:
        """Whether its finished `ping` says it is a standby still: alive, holding no placement group."""
        answer = self.answer()
        return answer is not None and answer.pg is None


class Roster:
    """Every worker a group holds, in one list: the members first, in rank order, then spares and standbys."""

    def __init__(self) -> None:
        self.workers: list[WorkerHandle] = []

    def with_role(self, role: Role) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role is role]

    @property
    def members(self) -> list[WorkerHandle]:
        """The ranks, in rank order."""
        return self.with_role(Role.MEMBER)

    @property
    def spares(self) -> list[WorkerHandle]:
        return self.with_role(Role.SPARE)

    @property
    def standby(self) -> list[WorkerHandle]:
        return self.with_role(Role.STANDBY)

    def member_nodes(self) -> list[str]:
        """The nodes the members run on, each once, sorted."""
        return sorted({m.node_id for m in self.members})

    def set_members(self, members: list[WorkerHandle]) -> None:
        """`members` become the ranks, in this order; every other handle keeps its role (a member left
        out must have been stopped, or be given another role, by the caller)."""
        for m in members:
            m.role = Role.MEMBER
        rest = [w for w in self.workers if w.role is not Role.MEMBER and all(w is not m for m in members)]
        self.workers = list(members) + rest

    def add(self, handles: Iterable[WorkerHandle]) -> None:
        self.workers += handles

    def drop(self, handles: Iterable[WorkerHandle]) -> None:
        """Take these handles out of the roster (by identity: a handle compares by identity only)."""
        handles = list(handles)
        self.workers = [w for w in self.workers if all(w is not h for h in handles)]
