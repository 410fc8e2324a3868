"""Tools the CLI offers (`elastron ckpt inspect`, `elastron export`, `elastron data prepare`), through
service/ so that api/ needs nothing below it. Imports are lazy: they bring torch in."""

from __future__ import annotations

from pathlib import Path


def inspect_checkpoint(path: str | Path) -> dict:
    """A checkpoint's step, layout, tensors, files and validity (parallel.checkpoint.inspect)."""
    from parallel.checkpoint import inspect

    return inspect(path)


def export_checkpoint(path: str | Path, out: str | Path, *, overwrite: bool = False, dtype: str | None = None,
                      max_shard_size: int | str | None = None) -> Path:
    """The checkpoint at `path` as a Hugging Face model in `out` (parallel.export)."""
    from parallel.export import export_checkpoint as export

    return export(str(path), str(out), overwrite=overwrite, dtype=dtype, max_shard_size=max_shard_size)


def prepare_data(inputs: list[str], out: str | Path, *, tokenizer: str | Path, text_field: str = "text",
                 val_fraction: float = 0.01, seed: int = 0, progress=None, add_bos: bool | None = None) -> dict:
    """Token files for `data.source: tokens` from text/JSONL/Parquet (workers.prepare); the sidecar."""
    from workers.prepare import prepare

    return prepare(inputs, out, tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction, seed=seed,
                   progress=progress, add_bos=add_bos)
