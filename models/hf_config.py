"""A Hugging Face Llama directory's config.json as our ModelConfig. Pure: json only, no torch, so the
edges that check a job (`elastron run`/`train`, the REST API) can read a model's shape cheaply; the
weights are `parallel.hf_import`'s business."""

from __future__ import annotations

import json
import os
from pathlib import Path

from models.config import ModelConfig


class HFImportError(ValueError):
    """A Hugging Face model directory that cannot be started from; the message says what and where."""


def _config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFImportError(f"model.init_from: {path} does not exist; point init_from at a Hugging Face model "
                            "directory (config.json + *.safetensors)") from None
    except (OSError, ValueError) as e:
        raise HFImportError(f"model.init_from: cannot read {path}: {e}") from None
    if not isinstance(d, dict):
        raise HFImportError(f"model.init_from: {path} is not a JSON object")
    return d


def model_config_from_hf(directory: str | os.PathLike[str], *, max_seq_len: int | None = None) -> ModelConfig:
    """Our ModelConfig for the Llama-family model in `directory` (config.json only)."""
    directory = Path(directory)
    d = _config(directory)
    where = f"model.init_from: {directory / 'config.json'}"
    if d.get("model_type") != "llama":
        raise HFImportError(f"{where}: model_type {d.get('model_type')!r} is not supported; only Llama-family "
                            "models (model_type 'llama') can be started from")
    if d.get("tie_word_embeddings"):
        raise HFImportError(f"{where}: tied input/output embeddings are not supported (this model has a separate "
                            "output projection); untie them (copy embed_tokens into lm_head) and save again")
    if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias") or d.get("mlp_bias"):
        raise HFImportError(f"{where}: only SiLU MLPs without biases are supported")
    scaling = d.get("rope_scaling") or {}
    params = d.get("rope_parameters") or {}
    if (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")) or \
            params.get("rope_type", "default") != "default":
        raise HFImportError(f"{where}: RoPE scaling {scaling or params} is not supported")
    try:
        n_heads = int(d["num_attention_heads"])
        cfg = ModelConfig(
            dim=int(d["hidden_size"]), n_layers=int(d["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads), vocab_size=int(d["vocab_size"]),
            ffn_hidden=int(d["intermediate_size"]),
            max_seq_len=int(max_seq_len or d.get("max_position_embeddings", 2048)),
            norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", params.get("rope_theta", 10000.0))),
        )
    except KeyError as e:
        raise HFImportError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise HFImportError(f"{where}: {e}") from None
    if d.get("head_dim") not in (None, cfg.head_dim):
        raise HFImportError(f"{where}: head_dim {d['head_dim']} differs from hidden_size / num_attention_heads = "
                            f"{cfg.head_dim}; such models are not supported")
    return cfg
