"""Tensor keys: how a checkpoint names its tensors (``model.<p>``, ``optim.<state>.<p>``), the order a
keyed index lists them in, and the crc32 that ties an index to that order."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from parallel.checkpoint.errors import ManifestError

MODEL_PREFIX = "model."
"""Tensor keys of model parameters: ``model.<canonical name>``."""
OPTIM_PREFIX = "optim."
"""Tensor keys of optimizer state: ``optim.<state name>.<canonical name>`` (e.g. optim.exp_avg.output.weight)."""


def param_of(key: str) -> str:
    """``model.<p>``, ``optim.<state>.<p>`` -> ``<p>``."""
    if key.startswith(OPTIM_PREFIX):
        return key[len(OPTIM_PREFIX):].split(".", 1)[1]
    return key.removeprefix(MODEL_PREFIX)


def spell_keys(params: Any, states: Any) -> dict[str, Any]:
    """A format-3 top manifest's (or a format-4 section's) tensors from its parameters and optimizer state
    names: each parameter's entry under its model key and under the key of each of its states."""
    if not isinstance(params, dict) or not isinstance(states, list) or not all(
            isinstance(s, str) and s and "." not in s for s in states):
        raise ManifestError("manifest params must be an object and optimizer.states a list of names")
    return {f"{p}{n}": v for n, v in params.items() for p in (MODEL_PREFIX, *(f"{OPTIM_PREFIX}{s}." for s in states))}


def key_order(tensors) -> list[str]:
    """The order a keyed index's table lists the checkpoint's keys in: sorted."""
    return sorted(tensors)


def keys_crc(keys: list[str]) -> int:
    """The crc32 of the keys in order, which a keyed index's header and a format-4 header record."""
    return zlib.crc32("\n".join(keys).encode())


@dataclass(frozen=True, slots=True)
class KeyOrder:
    """The checkpoint's keys in the order a keyed index's table lists them (sorted), as far as a reader
    knows them: how many there are and the crc32 of the whole list (which an index header must match),
    and the place of each key it knows. A format-4 top manifest read in part knows the keys of its
    sections read only."""

    count: int
    crc32: int
    at: dict[int, str]
    """Place in the order -> key, for the keys known."""

    @classmethod
    def of(cls, keys: list[str]) -> "KeyOrder":
        """The order of every key (`keys`, already in order)."""
        return cls(len(keys), keys_crc(keys), dict(enumerate(keys)))
