"""Llama-style decoder. Knows nothing about meshes.

Pipeline stages are made by deleting modules (`tok_embeddings`, `norm`, `output` set to None, entries of
`layers` removed); the forward skips what is missing, so every stage keeps the canonical parameter names
of the unsplit model. Attention infers the local head count from tensor shapes (`view(..., -1, head_dim)`)
so tensor parallelism can shard wq/wk/wv without the model knowing.

Mixed precision without a wrapper: every weight is cast to the compute dtype where it is used (`Linear`
and `RMSNorm` to their input's dtype, `Embedding` to its `compute_dtype`), and the cast is a no-op
wherever the weight already has it (fp32 training; bf16 under FSDP2's mixed precision, which casts when it
unshards). So the cast points are the same with or without FSDP2: each weight is rounded to bf16 once per
forward, every matmul and the embedding gather take bf16 operands, norms and RoPE upcast inside. Gradients
flow back through the cast into the fp32 parameters (`parallel.precision`).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.emulation import device_time
from models.init import normal_box


class Linear(nn.Linear):
    """`nn.Linear` computing in its input's dtype: the weight is cast at use."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class Embedding(nn.Embedding):
    """`nn.Embedding` that gathers from its table cast to `compute_dtype` (None: the table's own dtype).
    The table is cast before the gather, as FSDP2 casts it when it unshards, so the gradient of repeated
    tokens accumulates in the same dtype under every layout."""

    compute_dtype: torch.dtype | None = None

    def reset_parameters(self) -> None:
        # A table on the meta device has no values to draw (`init_into` gives it its value once it is
        # materialized), and `normal_` on a meta tensor runs torch's Python reference, whose first call
        # imports torch._dynamo: over a second of a fresh process's build, for nothing.
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.compute_dtype is None else self.weight.to(self.compute_dtype)
        return F.embedding(x, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                           self.sparse)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.to(x.dtype).float()).type_as(x)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None, *, seq_len: int = 0,
                     device=None) -> torch.Tensor:
    """RoPE's inverse frequencies, one per pair, with `scaling` applied as transformers applies it:
    linear divides them by the factor; dynamic (NTK) raises the base once `seq_len` passes the original
    context; llama3 divides the low frequencies by the factor and blends the middle band."""
    kind = (scaling or {}).get("rope_type")
    if kind == "dynamic":
        orig = scaling["original_max_position_embeddings"]
        n, f = max(seq_len, orig), scaling["factor"]
        theta = theta * ((f * n / orig) - (f - 1)) ** (head_dim / (head_dim - 2))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        f, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv = torch.where(medium, blended, scaled)
    return inv


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = rope_frequencies(head_dim, theta, scaling, device=device)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # [T, head_dim/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; rotate interleaved pairs (x0, x1) like the original Llama."""
    T = x.shape[1]
    c = cos[:T].view(1, T, 1, -1)
    s = sin[:T].view(1, T, 1, -1)
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


def gqa_in_kernel(q: torch.Tensor) -> bool:
    """Whether SDPA's kernel for `q` takes fewer K/V heads than query heads (`enable_gqa`) without
    repeating them itself. CPU's flash kernel does (any dtype); on CUDA the flash and cuDNN kernels do,
    but they take only fp16/bf16: fp32 would fall back from the memory-efficient kernel (no GQA) to the
    math one, which materialises the T x T scores, so fp32 on CUDA repeats K/V instead."""
    return q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA on [B, H, T, D] tensors where k and v may have fewer heads than q (GQA).

    Head counts come from the tensors, so under TP they are the local ones: n_heads/tp query heads over
    n_kv_heads/tp K/V heads keep the global ratio, and query head i still reads K/V head i // n_rep.
    Either way the result is the same (bitwise on CPU); `enable_gqa` just does not copy K/V n_rep times.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq == hkv:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if hq % hkv:
        raise ValueError(f"{hq} local query heads are not a multiple of {hkv} local K/V heads")
    if gqa_in_kernel(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    n_rep = hq // hkv
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wq = Linear(cfg.dim, q, bias=cfg.qkv_bias)
        self.wk = Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.wv = Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.wo = Linear(q, cfg.dim, bias=cfg.out_bias)
        # Per-head norms (Qwen3): their weight spans one head, so under TP every rank holds all of it.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        return self.wo(causal_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens [B, T] -> logits [B, T, vocab]. On a pipeline stage: hidden [B, T, dim] in and/or out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: Embedding | None = Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by the global layer index keeps names stable when stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: Linear | None = Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Placeholders of the tables' shape: `init_buffers` computes them where they live. (Computing them
        # on the meta device would run torch's Python references, whose first call imports torch._dynamo.)
        shape = (cfg.max_seq_len, cfg.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape, dtype=torch.float32, device="meta"),
                             persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape, dtype=torch.float32, device="meta"),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        cos, sin = self._rope(h.shape[1])
        # An emulated accelerator's time for this micro-batch (models.emulation), spread over the layers as
        # a device's compute is: each layer waits its share before it runs, in the forward and (after the
        # layer's own backward) in the backward, so gradient reductions launched as a layer's gradients
        # are ready overlap the waits of the layers still to run, as they overlap compute on a GPU. A
        # pipeline stage waits for the layers it holds.
        per_layer = self.cfg.emulate_s_per_sample / self.cfg.n_layers
        for layer in self.layers.values():
            if per_layer:
                h = device_time(h, samples=x.shape[0], s_per_sample=per_layer)
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def tie_weights(self) -> None:
        """With tied embeddings, make the output projection hold the embedding's Parameter (again: sharding
        and `to_empty` each make two of it). A pipeline's last stage has no embedding and keeps its own
        copy, which `parallel.pipeline.sync_tied_grads` keeps equal."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _rope(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables for a sequence of T tokens: the precomputed ones, except that dynamic scaling
        past its original context depends on T (as in transformers)."""
        cfg = self.cfg
        if cfg.sliding_window is not None and T > cfg.sliding_window:
            raise ValueError(f"a sequence of {T} tokens is longer than model.sliding_window={cfg.sliding_window}; "
                             "sliding-window attention is not implemented: use data.seq_len <= the window")
        s = cfg.rope_scaling or {}
        if s.get("rope_type") == "dynamic" and T > s["original_max_position_embeddings"]:
            inv = rope_frequencies(cfg.head_dim, cfg.rope_theta, s, seq_len=T, device=self.rope_cos.device)
            freqs = torch.outer(torch.arange(T, device=inv.device, dtype=torch.float32), inv)
            return freqs.cos(), freqs.sin()
        return self.rope_cos, self.rope_sin

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        device = device if device is not None else self.rope_cos.device
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=device,
                               scaling=self.cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos, sin


TIED = {"output.weight": "tok_embeddings.weight"}
"""With tied embeddings: the name a tensor is held under on a module -> the one name it has everywhere
else (initial values, checkpoints, exports)."""


def canonical_name(cfg: ModelConfig, name: str) -> str:
    """The one name of parameter `name`: a tied output projection is the embedding table."""
    return TIED.get(name, name) if cfg.tie_embeddings else name


def param_seed(seed: int, name: str) -> int:
    """Seed for one parameter, from the job seed and its canonical name only (never the layout)."""
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, name: str, shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """The global initial value of parameter `name` (fp32, on CPU): `init_into` over the whole tensor."""
    out = torch.empty(tuple(shape), dtype=torch.float32)
    init_into(cfg, name, tuple(shape), seed, out)
    return out


def init_into(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int, out: torch.Tensor,
              offsets: tuple[int, ...] | None = None) -> int:
    """Write into `out` (any device) the box of parameter `name`'s global initial value (global `shape`)
    that starts at `offsets` (default: the origin); returns how many random values it drew. The one place
    that says how each parameter starts: every layout's shards come from here, so every layout starts
    from the same global weights, and a rank draws only the values of its own box (`models.init`).

    Norm weights are 1; biases 0; embeddings N(0, 1) (N(0, 1/dim) when tied, the output projection's
    scale); linear weights N(0, init_std), with the residual output projections (wo, w2) scaled by
    1/sqrt(2 * n_layers) as in GPT-2 / torchtitan. A tied output projection gets the embedding's value.
    """
    name = canonical_name(cfg, name)
    if name.endswith("norm.weight"):
        out.fill_(1.0)
        return 0
    if name.endswith(".bias"):
        out.zero_()
        return 0
    std = cfg.init_std
    if name.startswith("tok_embeddings"):
        std = cfg.dim ** -0.5 if cfg.tie_embeddings else 1.0
    elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    elif name == "output.weight":
        std = cfg.dim ** -0.5
    offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
    return normal_box(out, tuple(shape), offsets, key=param_seed(seed, name), std=std)


def build_model(cfg: ModelConfig) -> Transformer:
    """A model on the meta device: no memory, no values. Parallelize it, then call `materialize`."""
    with torch.device("meta"):
        return Transformer(cfg)
