"""Model configuration and presets. Pure: no torch import, so the planner can use it anywhere."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA, untied embedding/output)."""

    dim: int
    """Hidden size."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention (query) heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); must divide n_heads."""
    vocab_size: int
    """Embedding and output rows."""
    ffn_hidden: int
    """Hidden size of the SwiGLU MLP."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE table covers."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""

    def __post_init__(self) -> None:
        for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model.{f} must be a positive integer, got {v!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, *, embedding: bool = True) -> int:
        """Exact parameter count of the unsplit model."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv * 2
        mlp = 3 * self.dim * self.ffn_hidden
        per_layer = attn + mlp + 2 * self.dim
        total = self.n_layers * per_layer + self.dim + self.vocab_size * self.dim  # + final norm, output
        if embedding:
            total += self.vocab_size * self.dim
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x (non-embedding params) + attention scores (PaLM appendix B)."""
        n = self.num_params(embedding=False)
        return 6.0 * n + 12.0 * self.n_layers * self.dim * seq_len

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


PRESETS: dict[str, ModelConfig] = {
    # ~0.9M params, byte-level vocabulary: a CPU step in milliseconds.
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=384,
                        max_seq_len=512),
    # ~24M params.
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_hidden=1408,
                         max_seq_len=1024),
    # ~125M params (GPT-2-small scale with a Llama body and a 32k vocabulary).
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, ffn_hidden=2048,
                        max_seq_len=2048),
    # ~1.1B params (TinyLlama shape).
    "1b": ModelConfig(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000, ffn_hidden=5632,
                      max_seq_len=2048, rope_theta=10000.0),
    # ~8.0B params (Llama-3-8B shape).
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336,
                      max_seq_len=8192, rope_theta=500000.0),
}


def model_config(preset: str, /, **overrides) -> ModelConfig:
    """A preset, optionally with some fields replaced."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    if overrides:
        known = {f.name for f in fields(ModelConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown model field(s) {unknown}; known: {sorted(known)}")
        cfg = replace(cfg, **overrides)
    return cfg
