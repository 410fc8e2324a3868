"""Whether a worker's state can be trusted after a peer failed: one pure rule over facts the worker
reports about itself (`Worker.salvage` gathers them, asks `trust`, and acts on the answer before it replies).

It lives in workers/ because the worker must act on it at once (keep its shards for a heal, or drop them)
and workers/ cannot import service/; the coordinator's recovery decisions (service.control.failure) take
its answer, carried in `Salvaged`, from there on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Distrust(StrEnum):
    """Why a worker's live shards cannot heal the next group."""

    NO_TRAINER = "no trainer"
    """It was in no training group (a spare, or one that had already left)."""
    SAVE_RUNNING = "a checkpoint save was still running"
    """A save it started outlived its bounded wait: it could still write, so the process is stopped."""
    AFTER_UPDATE = "the failure struck after a weight update"
    """Its weights moved past the last step the coordinator saw."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateFacts:
    """What a worker knows about its own state once a peer has failed."""

    has_trainer: bool
    """It held a trainer of the failed group."""
    updated_mid_step: bool = False
    """The failure struck after the step's weight update, before its loss was out (`Trainer.salvage_state`)."""
    save_running: bool = False
    """A checkpoint save was still running after the bounded wait of `Trainer.close`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Trust:
    """The decision: whether the shards are held for a heal; if not, why, and whether the process can join
    the next group as a freshly started worker would."""

    held: bool
    why: Distrust | None = None
    reusable: bool = False


def trust(f: StateFacts) -> Trust:
    """Held only with a trainer, no save left running and weights at the last step the coordinator saw.
    A running save outranks the rest: it makes the whole process untrustworthy, not only its shards."""
    if not f.has_trainer:
        return Trust(held=False, why=Distrust.NO_TRAINER, reusable=True)
    if f.save_running:
        return Trust(held=False, why=Distrust.SAVE_RUNNING, reusable=False)
    if f.updated_mid_step:
        return Trust(held=False, why=Distrust.AFTER_UPDATE, reusable=True)
    return Trust(held=True)
