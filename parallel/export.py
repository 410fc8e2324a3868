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

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
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
        # vocabularies: None unless the source's or the tokenizer's ids are known (`write_hf`).
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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
"""The tokenizer files an export copies from its source, when they are there."""
INDEX = "model.safetensors.index.json"


def _is_written_by_export(name: str) -> bool:
    """Whether `name` is a file an export writes (so `overwrite` may replace or remove it)."""
    return (name in ("config.json", "generation_config.json", "model.safetensors", INDEX, *TOKENIZER_FILES)
            or (name.startswith("model-") and name.endswith(".safetensors")))


@dataclass(frozen=True, slots=True)
class ExportSource:
    """Where the files beside the weights come from: the Hugging Face directory training started from
    (`model.init_from`: token ids, generation config, tokenizer, dtype) and the tokenizer `elastron data
    prepare` recorded in the data's meta.json (with its EOS id), used when the first has no tokenizer."""

    model_dir: Path | None = None
    tokenizer: Path | None = None
    """A tokenizer.json, or a directory holding tokenizer files."""
    eos_id: int | None = None


def parse_size(size: int | str) -> int:
    """Bytes from 123, "500MB", "2GB", "10KiB" (decimal and binary units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        text = str(size).strip().upper().replace(" ", "")
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
        unit = next((u for u in units if text.endswith(u)), "")
        try:
            n = int(float(text[:len(text) - len(unit)]) * units.get(unit, 1))
        except ValueError:
            raise ValueError(f"--max-shard-size {size!r} is not a size; write e.g. 2GB, 500MB or 1000000") from None
    if n <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {size!r}")
    return n


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into groups of at most `max_bytes` (a larger tensor alone in its group)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if max_bytes is not None and groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += n
    return groups


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _source_dtype(source: ExportSource | None) -> str | None:
    if source is None or source.model_dir is None:
        return None
    d = _read_json(source.model_dir / "config.json")
    name = d.get("torch_dtype") or d.get("dtype")
    return name if name in DTYPES else None


def _tokenizer_dir(source: ExportSource | None) -> tuple[Path | None, list[str]]:
    """(directory, tokenizer file names in it) to copy: init_from's, else the recorded tokenizer's."""
    if source is None:
        return None, []
    if source.model_dir is not None:
        names = [n for n in TOKENIZER_FILES if (source.model_dir / n).is_file()]
        if "tokenizer.json" in names or "tokenizer.model" in names:
            return source.model_dir, names
    if source.tokenizer is not None:
        t = source.tokenizer
        d = t if t.is_dir() else t.parent
        names = [n for n in TOKENIZER_FILES if (d / n).is_file()]
        if not t.is_dir() and t.name != "tokenizer.json":  # a tokenizer file under another name
            return d, [t.name]
        return d, names
    return None, []


def _special_ids(source: ExportSource | None, tok_dir: Path | None) -> dict[str, int]:
    """bos/eos/pad ids: the source model's config.json or generation_config.json, else the tokenizer's
    (tokenizer_config.json's tokens, or the EOS id data prepare recorded)."""
    ids: dict[str, int] = {}
    if source is not None and source.model_dir is not None:
        for f in ("generation_config.json", "config.json"):
            d = _read_json(source.model_dir / f)
            ids.update({k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if d.get(k) is not None})
    if tok_dir is not None and (tok_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        tc = _read_json(tok_dir / "tokenizer_config.json")
        for key in ("bos", "eos", "pad"):
            name = tc.get(f"{key}_token")
            name = name.get("content") if isinstance(name, dict) else name
            if isinstance(name, str) and tok.token_to_id(name) is not None:
                ids.setdefault(f"{key}_token_id", tok.token_to_id(name))
    if source is not None and source.eos_id is not None:
        ids.setdefault("eos_token_id", source.eos_id)
    return ids


def _tokenizer_config(tok_dir: Path, ids: dict[str, int]) -> dict:
    """A tokenizer_config.json for a bare tokenizer.json, naming its special tokens so AutoTokenizer
    knows where a document ends."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    out: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key in ("bos", "eos", "pad"):
        if (i := ids.get(f"{key}_token_id")) is not None and isinstance(i, int) and tok.id_to_token(i) is not None:
            out[f"{key}_token"] = tok.id_to_token(i)
    return out


def _umask() -> int:
    """This process's umask, read without changing it where /proc allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *,
             overwrite: bool = False, dtype: str | None = None, max_shard_size: int | str | None = None,
             source: ExportSource | None = None) -> Path:
    """Write a complete Hugging Face model into out_dir: weights (one model.safetensors, or shards of at
    most `max_shard_size` with model.safetensors.index.json), config.json with the bos/eos/pad ids,
    generation_config.json and the tokenizer files of `source`. `dtype`: float32, bfloat16 or float16
    (default: the source model's, else the state's). Returns out_dir.

    Everything is written into a sibling temporary directory first, then moved in file by file,
    config.json last; `overwrite` replaces (or removes, for shards no longer written) only files an
    export writes, and keeps any other file. The files get the usual permissions (umask)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"export target {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"export target {out_dir} is not empty; pass --overwrite to replace the files an "
                              "export writes there (other files are kept)")
    dtype = dtype or _source_dtype(source)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    max_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    hf_state = to_hf_state_dict(state, cfg)  # validate before touching the disk
    if dtype is not None:
        hf_state = {k: v.to(DTYPES[dtype]) for k, v in hf_state.items()}
    hf_state = _for_safetensors(hf_state)
    tok_dir, tok_files = _tokenizer_dir(source)
    ids = _special_ids(source, tok_dir)
    config = {**hf_config(cfg, dtype=_dtype_name(hf_state)), **ids}

    groups = _shards(hf_state, max_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for name, group in zip(names, groups):
            save_file(group, str(tmp / name), metadata={"format": "pt"})
        written = list(names)
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in hf_state.values())},
                     "weight_map": {k: n for n, g in zip(names, groups) for k in g}}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            written.append(INDEX)
        for name in tok_files:
            shutil.copyfile(tok_dir / name, tmp / name)  # contents only: permissions from the umask
            written.append(name)
        if tok_dir is not None and "tokenizer.json" in tok_files and "tokenizer_config.json" not in tok_files:
            (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok_dir, ids), indent=2) + "\n")
            written.append("tokenizer_config.json")
        gen = _read_json(source.model_dir / "generation_config.json") if source and source.model_dir else {}
        gen.update(ids)
        if gen:
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            written.append("generation_config.json")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        written.append("config.json")
        mode = 0o666 & ~_umask()
        for name in written:  # safetensors writes its files 0600
            os.chmod(tmp / name, mode)
        out_dir.mkdir(exist_ok=True)
        stale = [p for p in out_dir.iterdir() if _is_written_by_export(p.name) and p.name not in written]
        for p in stale:  # an older export's files this one does not write (e.g. its other shards)
            p.unlink()
        for name in written:  # config.json last: until it is there, nothing loads a half export
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def export_checkpoint(path: str, out_dir: str, *, overwrite: bool = False, dtype: str | None = None,
                      max_shard_size: int | str | None = None) -> Path:
    """Load a training checkpoint (any layout) and write it as a Hugging Face model directory, with the
    token ids, generation config and tokenizer of the run's `model.init_from` or prepared data."""
    from parallel.checkpoint import load_full_model_state  # lazy: write_hf needs none of it

    state, manifest = load_full_model_state(path)
    if "model_config" not in manifest:
        raise ValueError(f"checkpoint manifest at {path} has no 'model_config'; cannot export")
    cfg = ModelConfig.from_dict(manifest["model_config"])
    src = manifest.get("sources") or {}
    source = ExportSource(model_dir=Path(src["init_from"]) if src.get("init_from") else None,
                          tokenizer=Path(src["tokenizer"]) if src.get("tokenizer") else None,
                          eos_id=src.get("eos_id"))
    return write_hf(state, cfg, out_dir, overwrite=overwrite, dtype=dtype, max_shard_size=max_shard_size,
                    source=source)
