"""Tiny random Hugging Face models of every family the model implements (no download), for the tier-1
and tier-2 family tests. Every parameter, biases and norm weights included, is drawn at random, so a
misplaced bias or an unpermuted norm weight cannot hide behind a zero or a one."""

from __future__ import annotations

BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
            intermediate_size=48, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

FAMILIES: dict[str, tuple[str, dict]] = {
    # Llama 3.2 1B/3B: tied embeddings and llama3 RoPE scaling (64 / 4 = 16 < wavelengths < 64 are blended).
    "llama3.2": ("LlamaConfig", dict(tie_word_embeddings=True, max_position_embeddings=128, rope_scaling=LLAMA3)),
    "llama-linear-bias": ("LlamaConfig", dict(attention_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Dynamic NTK: tests run 20 tokens past max_position_embeddings=16, where the base is rescaled.
    "llama-dynamic": ("LlamaConfig", dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "qwen2.5": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),  # head_dim != hidden / heads
    "mistral": ("MistralConfig", dict(sliding_window=32)),
}


def make_hf(family: str, path, *, seed: int = 0):
    """Save a random `family` model under `path`; returns it (fp32, eval mode)."""
    import torch
    import transformers

    cls, overrides = FAMILIES[family]
    config = getattr(transformers, cls)(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model
