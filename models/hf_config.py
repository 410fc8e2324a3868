"""A Hugging Face Llama-family directory's config.json as our ModelConfig. Pure: json only, no torch, so the
edges that check a job (`elastron run`/`train`, the REST API) can read a model's shape cheaply; the
weights are `parallel.hf_import`'s business."""

from __future__ import annotations

import json
import os
from pathlib import Path

from models.config import FAMILIES, ROPE_SCALING_KEYS, ModelConfig, check_rope_scaling


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


def _rope(d: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from transformers 4.x's rope_scaling + rope_theta or 5.x's
    rope_parameters."""
    params = d.get("rope_parameters") or {}
    scaling = {**params, **(d.get("rope_scaling") or {})}
    theta = float(d.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if float(scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
        raise HFImportError(f"{where}: partial_rotary_factor is not supported (RoPE must cover the whole head); "
                            "pick a model without it")
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_KEYS:
        raise HFImportError(f"{where}: rope_scaling type {kind!r} is not supported (supported: default, "
                            f"{', '.join(sorted(ROPE_SCALING_KEYS))}); pick a model without it")
    if kind == "dynamic":  # transformers scales dynamic RoPE from max_position_embeddings
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings", 2048)
    try:
        out = {"rope_type": kind, **{k: scaling[k] for k in ROPE_SCALING_KEYS[kind]}}
        check_rope_scaling(out)
    except KeyError as e:
        raise HFImportError(f"{where}: rope_scaling ({kind}) lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise HFImportError(f"{where}: {e}") from None
    return theta, out


def _sliding_window(d: dict, model_type: str) -> int | None:
    """The attention window, when the model uses one: Mistral's sliding_window; Qwen's only when
    use_sliding_window (or a layer_types entry) turns it on."""
    window = d.get("sliding_window")
    if model_type == "mistral":
        return window
    uses = d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or ())
    return window if uses else None


def model_config_from_hf(directory: str | os.PathLike[str], *, max_seq_len: int | None = None) -> ModelConfig:
    """Our ModelConfig for the Llama-family model in `directory` (config.json only): Llama (incl. 3.1/3.2
    RoPE scaling and tied embeddings), Mistral, Qwen2/2.5 and Qwen3."""
    directory = Path(directory)
    d = _config(directory)
    where = f"model.init_from: {directory / 'config.json'}"
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise HFImportError(f"{where}: model_type {model_type!r} is not supported; supported: "
                            f"{', '.join(FAMILIES)}")
    if d.get("hidden_act", "silu") != "silu":
        raise HFImportError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported; only 'silu' MLPs "
                            "(SwiGLU) can be started from: pick a model with hidden_act 'silu'")
    if d.get("mlp_bias"):
        raise HFImportError(f"{where}: mlp_bias is not supported; only MLPs without biases can be started from: "
                            "pick a model with mlp_bias false")
    theta, scaling = _rope(d, where)
    attention_bias = bool(d.get("attention_bias"))
    try:
        n_heads = int(d["num_attention_heads"])
        dim = int(d["hidden_size"])
        head_dim = d.get("head_dim")
        cfg = ModelConfig(
            dim=dim, n_layers=int(d["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads), vocab_size=int(d["vocab_size"]),
            ffn_hidden=int(d["intermediate_size"]),
            max_seq_len=int(max_seq_len or d.get("max_position_embeddings", 2048)),
            norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            head_size=int(head_dim) if head_dim not in (None, dim // n_heads) else None,
            rope_scaling=scaling,
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            out_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window(d, model_type),
            family=model_type,
        )
    except KeyError as e:
        raise HFImportError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise HFImportError(f"{where}: {e}") from None
    return cfg
