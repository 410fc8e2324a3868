"""Checkpoint errors: the exceptions a save or a load raises, and the one line a failure is reported as."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or none can be loaded; the message names the checkpoint and why."""


class ManifestError(CheckpointError):
    """A manifest that is not valid JSON or does not have the expected structure."""


def describe(e: BaseException) -> str:
    """One line for a failure: a CheckpointError's own message, else the exception type and message."""
    if isinstance(e, CheckpointError):
        return str(e)[:1000]
    return f"{type(e).__name__}: {str(e)[:1000]}"
