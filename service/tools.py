"""Checkpoint tools the CLI offers (`elastron ckpt inspect`, `elastron export`), through service/ so that
api/ needs nothing below it. Imports are lazy: they bring torch in."""

from __future__ import annotations

from pathlib import Path


def inspect_checkpoint(path: str | Path) -> dict:
    """A checkpoint's step, layout, tensors, files and validity (parallel.checkpoint.inspect)."""
    from parallel.checkpoint import inspect

    return inspect(path)


def export_checkpoint(path: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """The checkpoint at `path` as a Hugging Face Llama model in `out` (parallel.export)."""
    from parallel.export import export_checkpoint as export

    return export(path, out, overwrite=overwrite)
