"""Where the next worker group gets its state: the one decision behind every reconfiguration.

`choose_source` is pure: given the policy's decision, whether the running group is sound (a planned
change: every rank holds its state), what a failed group's survivors hold, and `parallel.reshard`, it
says which of five sources the coordinator uses. The coordinator acts on the answer in one place
(service.control.reconfigure, `Reconfigure.carry_out`). What a failed group's survivors offer (`Heal`,
`Memory`, or nothing) is the recovery's judgement (service.control.failure.judge).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from parallel.planner import Plan
from service.control.policy import Resize, Wait


@dataclass(frozen=True, slots=True)
class Live:
    """The sound running group sends its shards straight to the new layout's workers (no storage)."""

    old: Plan


@dataclass(frozen=True, slots=True)
class Heal:
    """A failed group's survivors hold every shard of `old` between them: the new group is formed from
    their state, as a live move from those ranks."""

    old: Plan
    ranks: tuple[int, ...]
    """Their ranks in `old`, which are also their order in the group."""


@dataclass(frozen=True, slots=True)
class Memory:
    """A failed group's survivors hold, in their peer snapshots (their own and their buddies' copies),
    every shard of `old` at snapshot `step`: the new group is formed from those copies by the exchange
    a live move uses, each old rank's boxes sent by the survivor that holds its copy."""

    old: Plan
    step: int
    serve: tuple[tuple[int, int], ...]
    """(old rank, survivor's old rank) for every old rank whose copy is used, ascending."""


@dataclass(frozen=True, slots=True)
class Restore:
    """The new group loads the last committed checkpoint. `flush`: the group is sound, so it saves the
    current step first and nothing is redone."""

    flush: bool = False


@dataclass(frozen=True, slots=True)
class Release:
    """No group: every worker is released while the job waits. `flush`: save the current step first."""

    flush: bool = False


Source = Live | Heal | Memory | Restore | Release
Survivors = Heal | Memory


class ReshardMode(StrEnum):
    """How state may move between layouts (`parallel.reshard`)."""

    LIVE = "live"
    """Between workers over the network, or through storage where that is all there is."""
    STORAGE = "storage"
    """Only through checkpoints."""



def choose_source(*, decision: Resize | Wait, sound: Plan | None, survivors: Survivors | None,
                  reshard: ReshardMode | str) -> Source:
    """`sound`: the plan of a running group whose every rank holds its state (a planned change), None
    when no group runs or it failed. `survivors`: after a failure, what the survivors can form the next
    group from (`service.control.failure.judge`; None when nothing, or there was no failure)."""
    if reshard not in set(ReshardMode):
        raise ValueError(f"reshard must be one of {[str(m) for m in ReshardMode]}, got {reshard!r}")
    if sound is not None and survivors is not None:
        raise ValueError("a group is either sound or the survivors of a failure, not both")
    if isinstance(decision, Wait):
        return Release(flush=sound is not None)  # survivors cannot wait holding state: storage has it
    if not isinstance(decision, Resize):
        raise ValueError(f"only a Resize or a Wait changes the group, got {type(decision).__name__}")
    if sound is not None:
        return Live(sound) if reshard == ReshardMode.LIVE else Restore(flush=True)
    if survivors is not None and reshard == ReshardMode.LIVE:
        return survivors
    return Restore()
