"""Model configuration and presets. Pure: no torch import, so the planner can use it anywhere."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA). The options below the RoPE base turn it
    into the other families' variants of the same block (models/FAMILIES.md maps each to its
    Hugging Face field)."""

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
    head_size: int | None = None
    """Size of one attention head; None: dim // n_heads (Qwen3 sets it independently of dim)."""
    rope_scaling: dict | None = None
    """RoPE frequency scaling, keys as transformers names them: {"rope_type": "linear", "factor"},
    {"rope_type": "dynamic", "factor", "original_max_position_embeddings"} or {"rope_type": "llama3",
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}; None: plain RoPE."""
    tie_embeddings: bool = False
    """The output projection is the embedding table (one tensor, `tok_embeddings.weight`)."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2, and Llama's attention_bias)."""
    out_bias: bool = False
    """A bias on the attention output projection (Llama's attention_bias)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Sliding-window attention span (Mistral); sequences longer than it are refused, shorter ones are plain
    causal attention."""
    family: str = "llama"
    """The Hugging Face model_type the model is exported as: llama, mistral, qwen2 or qwen3."""
    emulate_s_per_sample: float = 0.0
    """Emulated accelerator time per sample of a micro-batch, in seconds (0: none). Each forward of the
    whole model (or of the pipeline's first stage) waits a third of micro-batch samples x this, its
    backward the other two thirds, on top of the real computation: the host waits as it waits for a GPU
    (`models.emulation`). For benchmarks on CPUs where throughput must scale with workers as on
    accelerators; it changes no value the model computes."""

    def __post_init__(self) -> None:
        for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model.{f} must be a positive integer, got {v!r}")
        if self.head_size is None and self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.head_size is not None and (not isinstance(self.head_size, int) or self.head_size <= 0):
            raise ValueError(f"model.head_size must be a positive integer or null, got {self.head_size!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for RoPE")
        check_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"model.sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        e = self.emulate_s_per_sample
        if isinstance(e, bool) or not isinstance(e, int | float) or not 0 <= e <= 3600:
            raise ValueError(f"model.emulate_s_per_sample must be a number of seconds in [0, 3600], got {e!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"model.family {self.family!r} is not one of {FAMILIES}")
        check_family(self)

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.dim // self.n_heads

    def num_params(self, *, embedding: bool = True) -> int:
        """Exact parameter count of the unsplit model (`embedding=False`: without the input table; a tied
        output projection is that same table, so it is then not counted either)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q * 2 + self.dim * kv * 2
        attn += (q + 2 * kv) * self.qkv_bias + self.dim * self.out_bias + 2 * self.head_dim * self.qk_norm
        mlp = 3 * self.dim * self.ffn_hidden
        per_layer = attn + mlp + 2 * self.dim
        total = self.n_layers * per_layer + self.dim  # + final norm
        if not self.tie_embeddings:
            total += self.vocab_size * self.dim  # output
        if embedding:
            total += self.vocab_size * self.dim
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x (non-embedding params) + attention scores (PaLM appendix B)."""
        n = self.num_params(embedding=False) + self.vocab_size * self.dim * self.tie_embeddings  # output matmul
        return 6.0 * n + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
"""RoPE scaling types the model implements, with the keys each needs (as transformers names them)."""


def check_rope_scaling(scaling: dict | None) -> None:
    """ValueError in one line for a RoPE scaling the model does not implement or that lacks a key."""
    if scaling is None:
        return
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"model.rope_scaling {scaling!r}: rope_type must be one of {sorted(ROPE_SCALING_KEYS)}")
    for k in ROPE_SCALING_KEYS[kind]:
        v = scaling.get(k)
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ValueError(f"model.rope_scaling ({kind}) needs a positive number {k!r}, got {v!r}")


def check_family(cfg: ModelConfig) -> None:
    """The options must be ones `cfg.family`'s Hugging Face class has, so that an export loads as it
    trained: Qwen2 has q/k/v biases only, Qwen3 q/k norms (and biases on all four projections or none),
    Llama biases on all four or none, Mistral none."""
    f = cfg.family
    if f == "qwen2" and not (cfg.qkv_bias and not cfg.out_bias):
        raise ValueError("model.family qwen2 has biases on q/k/v and none on the output: set qkv_bias: true, "
                         "out_bias: false")
    if (f == "qwen3") != cfg.qk_norm:
        raise ValueError(f"model.qk_norm={cfg.qk_norm} with model.family {f!r}: q/k norms are Qwen3's; "
                         "set family: qwen3 together with qk_norm: true")
    if f in ("llama", "qwen3") and cfg.qkv_bias != cfg.out_bias:
        raise ValueError(f"model.family {f!r} biases all four attention projections or none: set qkv_bias and "
                         "out_bias alike (q/k/v only is family: qwen2)")
    if f == "mistral" and (cfg.qkv_bias or cfg.out_bias):
        raise ValueError("model.family mistral has no attention biases: set qkv_bias and out_bias to false")


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
