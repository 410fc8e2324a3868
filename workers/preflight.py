"""The checks a job passes before any worker starts, in one function for every edge (`elastron train`'s
ranks, `elastron run`, the REST submit, `ray job submit`): the model's config.json and safetensors
headers (`resolve_init_from`), the data path, and for token files their meta.json and sizes (never
their contents): dtype, vocabulary, length, the tokenizer they were made with against the model's own,
and whether the held-out split fills one evaluation batch. A configuration error is a ConfigError in
one line, found here in milliseconds rather than by workers that fail and are restarted."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workers.config import ConfigError, JobConfig
from workers.disk_checks import check_data_path, resolve_init_from


@dataclass(frozen=True, slots=True)
class Preflight:
    """A job that passed: its config with the model's shape resolved, and what is worth a warning."""

    cfg: JobConfig
    warnings: tuple[str, ...] = ()


def preflight(cfg: JobConfig, *, weights: bool = True) -> Preflight:
    """Every check that needs no worker: ConfigError in one line naming the field and the fix. With
    `weights`, init_from's safetensors headers are checked too (names, shapes, dtypes)."""
    cfg = resolve_init_from(cfg, weights=weights)
    check_data_path(cfg.data)
    warnings: list[str] = []
    if cfg.data.source == "tokens":
        warnings += _check_tokens(cfg)
    return Preflight(cfg=cfg, warnings=tuple(warnings))


def _check_tokens(cfg: JobConfig) -> list[str]:
    from workers.data import build_source, build_val_source
    from workers.prepare import read_meta, tokenizer_digest

    d, t = cfg.data, cfg.train
    vocab = cfg.model.build().vocab_size
    try:  # a token source reads only meta.json and the file's size when it is made
        build_source(d, seed=t.seed, vocab_size=vocab)
        val = build_val_source(d, seed=t.seed, vocab_size=vocab) if t.eval_interval else None
    except ValueError as e:
        raise ConfigError(f"data: {e}", loc=('data',)) from None
    meta = read_meta(d.path) or {}
    if cfg.model.init_from is not None and meta.get("tokenizer_sha256") and not d.allow_tokenizer_mismatch:
        own = tokenizer_digest(Path(cfg.model.init_from))
        if own is not None and own != meta["tokenizer_sha256"]:
            raise ConfigError(
                f"data.path {d.path} was tokenised with another tokenizer (meta.json: {meta.get('tokenizer')}, "
                f"sha256 {meta['tokenizer_sha256'][:12]}) than model.init_from's tokenizer.json (sha256 "
                f"{own[:12]}); prepare the data again with --tokenizer {cfg.model.init_from}, or set "
                "data.allow_tokenizer_mismatch: true", loc=('data', 'path'))
    out = []
    if val is not None and len(val) < t.global_batch_size:
        out.append(f"data: the validation split holds {len(val)} sample(s) of seq_len + 1 = {d.seq_len + 1} tokens, "
                   f"fewer than one eval batch of train.global_batch_size={t.global_batch_size}: every eval "
                   f"repeats them ({t.eval_batches} batch(es)); give data prepare a larger --val-fraction")
    return out
