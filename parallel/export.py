"""Export a model state to the Hugging Face layout of its family (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`: safetensors + config.json).

Our attention rotates interleaved pairs (x0, x1), (x2, x3), ... like Meta's original Llama, while HF's
Llama rotates the two halves of each head (`rotate_half`). The rows of wq and wk are therefore permuted
per head so that pair i lands in rows i and i + head_dim/2; this is the same permutation as HF's
`convert_llama_weights_to_hf.py`. q and k get the same permutation, so q.k per head is unchanged and
wv/wo need nothing; their biases are permuted with their rows, and the per-head q/k norm weights
(Qwen3) as one head. A tied output projection is not written: `lm_head` is `embed_tokens` in transformers too.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from models.config import ModelConfig

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> global shape of every parameter of the unsplit model."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (cfg.vocab_size, cfg.dim),
        "norm.weight": (cfg.dim,),
    }
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
    per_layer = {
        "attention.wq.weight": (q, cfg.dim),
        "attention.wk.weight": (kv, cfg.dim),
        "attention.wv.weight": (kv, cfg.dim),
        "attention.wo.weight": (cfg.dim, q),
        "feed_forward.w1.weight": (cfg.ffn_hidden, cfg.dim),
        "feed_forward.w2.weight": (cfg.dim, cfg.ffn_hidden),
        "feed_forward.w3.weight": (cfg.ffn_hidden, cfg.dim),
        "attention_norm.weight": (cfg.dim,),
        "ffn_norm.weight": (cfg.dim,),
    }
    if cfg.qkv_bias:
        per_layer.update({"attention.wq.bias": (q,), "attention.wk.bias": (kv,), "attention.wv.bias": (kv,)})
    if cfg.out_bias:
        per_layer["attention.wo.bias"] = (cfg.dim,)
    if cfg.qk_norm:
        per_layer.update({"attention.q_norm.weight": (cfg.head_dim,), "attention.k_norm.weight": (cfg.head_dim,)})
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def hf_name(name: str) -> str:
    """The Hugging Face Llama name of our canonical parameter `name`."""
    if name in _TOP:
        return _TOP[name]
    _, i, rest = name.split(".", 2)  # "layers", index, suffix
    return f"model.layers.{i}.{_LAYER[rest]}"


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection, per head, from interleaved RoPE pairs to halves.

    Within a head of size D, new row j = old row 2j and new row D/2 + j = old row 2j + 1 (j < D/2).
    A 1-D `w` (a bias, a per-head norm weight) is permuted as one column.
    """
    if w.dim() == 1:
        return interleaved_to_halves(w[:, None], n_heads)[:, 0]
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `interleaved_to_halves`: q/k rows of a Hugging Face checkpoint into our RoPE order."""
    if w.dim() == 1:
        return halves_to_interleaved(w[:, None], n_heads)[:, 0]
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _short(names: list[str], limit: int = 8) -> str:
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our canonical full-model state -> HF Llama names, with q/k rows permuted for `rotate_half` RoPE."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing key(s): {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected key(s): {_short(unexpected)}")
    bad = [f"{k} {tuple(state[k].shape)} != {v}" for k, v in expected.items()
           if k in state and tuple(state[k].shape) != v]
    if bad:
        problems.append(f"shape mismatch(es): {_short(bad)}")
    if problems:
        raise ValueError(f"state does not match model config ({cfg.n_layers} layers, dim {cfg.dim}): "
                         + "; ".join(problems))

    out: dict[str, torch.Tensor] = {}
    for name in expected:
        t = state[name].detach()
        if (heads := rope_heads(cfg, name)) is not None:
            t = interleaved_to_halves(t, heads)
        out[hf_name(name)] = t
    return out


def rope_heads(cfg: ModelConfig, name: str) -> int | None:
    """How many heads the rows of parameter `name` span when they are in RoPE order (q/k weights and
    biases, q/k norm weights: one head), so they are permuted between ours and Hugging Face's; else None."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return cfg.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return cfg.n_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def hf_config(cfg: ModelConfig, *, dtype: str = "float32") -> dict:
    """config.json for the family's `*ForCausalLM` (fields understood by transformers 4.x and 5.x)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    max_positions = cfg.max_seq_len
    if cfg.rope_scaling:
        rope.update(cfg.rope_scaling)
        if cfg.rope_scaling["rope_type"] == "dynamic":
            # transformers scales dynamic RoPE from max_position_embeddings itself.
            max_positions = rope.pop("original_max_position_embeddings")
    window = {}
    if cfg.family == "mistral":
        window = {"sliding_window": cfg.sliding_window}
    elif cfg.family in ("qwen2", "qwen3"):
        window = {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window}
    return {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 4.x reads the top-level rope_theta; 5.x reads rope_parameters (and folds a
        # top-level rope_theta into it), so both are written and agree.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        **({"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} if cfg.rope_scaling else {}),
        **window,
        "hidden_act": "silu",
        "attention_bias": cfg.out_bias,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        # LlamaConfig defaults to bos=1/eos=2 (Llama-2's SentencePiece ids), which mean nothing for our
        # vocabularies; None keeps generate() from stopping on an arbitrary token.
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype,
    }


def _dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    if len(dtypes) != 1:
        raise ValueError(f"state mixes dtypes {dtypes}; cast it to one dtype before exporting")
    return dtypes[0].removeprefix("torch.")


def _for_safetensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two tensors sharing storage (save_file refuses shared storage)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        out[name] = t
    return out


def write_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *,
             overwrite: bool = False) -> Path:
    """Write out_dir/model.safetensors and out_dir/config.json; returns out_dir.

    Everything is written into a sibling temporary directory that is renamed into place at the end,
    so an interrupted export leaves either the old directory or the new one, never half of one.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"export target {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"export target {out_dir} is not empty; pass overwrite=True to replace it")
    hf_state = _for_safetensors(to_hf_state_dict(state, cfg))  # validate before touching the disk
    config = hf_config(cfg, dtype=_dtype_name(hf_state))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old = None
    try:
        save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out_dir.is_dir():
            # Move the old export aside rather than deleting it first, so a failed rename loses nothing.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "export")
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            if not out_dir.exists():
                (old / "export").rename(out_dir)  # if this fails too, the old export stays in `old`
            with contextlib.suppress(OSError):
                old.rmdir()  # only if empty
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def export_checkpoint(path: str, out_dir: str, *, overwrite: bool = False) -> Path:
    """Load a training checkpoint (any layout) and write it as a Hugging Face Llama directory."""
    from parallel.checkpoint import load_full_model_state  # lazy: write_hf needs none of it

    state, manifest = load_full_model_state(path)
    if "model_config" not in manifest:
        raise ValueError(f"checkpoint manifest at {path} has no 'model_config'; cannot export")
    cfg = ModelConfig.from_dict(manifest["model_config"])
    return write_hf(state, cfg, out_dir, overwrite=overwrite)
