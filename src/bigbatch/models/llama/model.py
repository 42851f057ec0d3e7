"""A Llama-style decoder, readable in one sitting.

Token embedding (no position table), pre-RMSNorm blocks whose attention rotates
queries and keys by their position (RoPE) and shares each key/value head among a
group of query heads (grouped-query attention), a SwiGLU MLP without biases, a
final RMSNorm and an LM head, optionally tied to the embedding.

Parameter names are those of Hugging Face's ``LlamaForCausalLM``
(``model.layers.0.self_attn.q_proj.weight``, ...) and the rotary embedding uses
its convention (the two halves of each head are rotated against each other), so
its weights load by name, without permutation (see :mod:`bigbatch.models.llama.hf`). Like
:class:`~bigbatch.models.GPT`, the model knows nothing of batches, accumulation,
devices or files.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bigbatch.errors import ConfigError
from bigbatch.models.attention import causal_attention, document_causal_mask
from bigbatch.models.lm_output import logits_or_loss


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's stretch of the rotary frequencies for contexts longer than pre-training's.

    Wavelengths longer than ``original_max_position / low_freq_factor`` are slowed by
    ``factor``, those shorter than ``original_max_position / high_freq_factor`` are
    kept, and those between are blended smoothly (``rope_type: llama3`` in Hugging Face).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ConfigError(f"rope scaling factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                f"rope scaling needs 0 < low_freq_factor < high_freq_factor, got {self.low_freq_factor} and "
                f"{self.high_freq_factor}; Llama 3 uses 1 and 4"
            )
        if self.original_max_position < 1:
            raise ConfigError(f"rope scaling original_max_position must be positive, got {self.original_max_position}")


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style model."""

    n_layer: int
    n_head: int
    n_kv_head: int  # key/value heads; each serves n_head // n_kv_head query heads
    n_embd: int
    ffn_hidden: int  # width of the SwiGLU MLP's gate and up projections
    block_size: int  # the longest sequence accepted (rotary has no table: any length up to this works)
    vocab_size: int = 50257  # the GPT-2 tokenizer's, like the GPT presets; training uses the data's vocabulary
    rope_base: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "block_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {name} must be a positive integer, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"model n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "choose n_embd as a multiple of n_head"
            )
        if self.n_head % self.n_kv_head != 0:
            raise ConfigError(
                f"model n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}; "
                "choose n_kv_head as a divisor of n_head"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(
                f"model head_dim={self.head_dim} (n_embd / n_head) is odd; rotary embeddings rotate pairs, "
                "choose n_embd / n_head even"
            )
        if not self.rope_base > 0:
            raise ConfigError(f"model rope_base must be positive, got {self.rope_base}")
        if not self.norm_eps > 0:
            raise ConfigError(f"model norm_eps must be positive, got {self.norm_eps}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """The embedding's rows: the vocabulary itself (no padding, so Hugging Face weights load as they are)."""
        return self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (``rope_scaling`` a dict or None); :meth:`from_dict` reads them back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LlamaConfig:
        values = dict(values)
        scaling = values.get("rope_scaling")
        if isinstance(scaling, dict):
            values["rope_scaling"] = RopeScaling(**scaling)
        return cls(**values)


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    # The budgets of the GPT presets pico and nano, with half as many key/value heads as query heads (so
    # grouped-query attention is exercised) and an MLP of about 8/3 x width, a multiple of 32, as SwiGLU
    # has three matrices where GELU has two.
    "llama-pico": LlamaConfig(
        n_layer=2, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=96, block_size=64, tie_embeddings=True
    ),
    "llama-nano": LlamaConfig(
        n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn_hidden=352, block_size=256, tie_embeddings=True
    ),
    # Meta's Llama 3.2 1B (1.24B parameters). It was trained to 131,072 tokens, but training's seq_len defaults
    # to the block size and 131,072-token sequences rarely fit: 8,192 (its pre-training context) is the
    # default here, and --block-size raises it (rotary has no table to outgrow).
    "llama3.2-1b": LlamaConfig(
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        ffn_hidden=8192,
        block_size=8192,
        vocab_size=128_256,
        rope_base=500_000.0,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192),
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
}


def llama_preset(name: str, **overrides: Any) -> LlamaConfig:
    """A named Llama shape, optionally with fields replaced (e.g. ``vocab_size=256``)."""
    if name not in LLAMA_PRESETS:
        known = ", ".join(LLAMA_PRESETS)
        raise ConfigError(f"unknown Llama preset {name!r}; choose one of: {known}")
    return replace(LLAMA_PRESETS[name], **overrides)


def rope_inverse_frequencies(config: LlamaConfig, device: torch.device | None = None) -> torch.Tensor:
    """The rotation speed (radians per position) of each pair of head dimensions, shape (head_dim / 2,), fp32."""
    dim = config.head_dim
    # Computed in fp32 exactly as Hugging Face does, so the angles (position x frequency) agree bit for bit.
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim  # (dim/2,)
    inv_freq = 1.0 / (config.rope_base**exponents)  # (dim/2,)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq  # positions per full turn
    long_wavelength = scaling.original_max_position / scaling.low_freq_factor
    short_wavelength = scaling.original_max_position / scaling.high_freq_factor
    # 0 at the long-wavelength edge, 1 at the short one: how much of the original frequency to keep.
    keep = (scaling.original_max_position / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - keep) * inv_freq / scaling.factor + keep * inv_freq
    slowed = torch.where(wavelength > long_wavelength, inv_freq / scaling.factor, blended)
    return torch.where(wavelength < short_wavelength, inv_freq, slowed)


def rope_cos_sin(config: LlamaConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, shape (seq_len, head_dim), fp32.

    Computed per forward rather than kept as a buffer: a few tiny kernels, and nothing to go stale when the
    model is built on the ``meta`` device and materialised later (non-persistent buffers are not in a state
    dict, so loading one would leave them uninitialised).
    """
    inv_freq = rope_inverse_frequencies(config, device)  # (head_dim/2,)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    angles = positions[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim): the first and second halves share angles
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, head_dim) by position: dimension i pairs with i + head_dim/2."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    rotated = torch.cat([-second, first], dim=-1)  # (B, heads, T, head_dim): the pair's 90-degree turn
    # In x's dtype, as Hugging Face does, so bf16 runs round the same way.
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned gain (no mean, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The statistics in fp32 even for bf16 activations; the gain is applied in the input's dtype.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        self.o_proj.residual_projection = True  # type: ignore[assignment]  # scaled init
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_head != self.n_head:
            # Query head h reads key/value head h // group. Repeated explicitly rather than with SDPA's
            # enable_gqa, which needs torch 2.5 and not every attention kernel supports.
            group = self.n_head // self.n_kv_head
            k = k.repeat_interleave(group, dim=1)  # (B, n_head, T, head_dim)
            v = v.repeat_interleave(group, dim=1)  # (B, n_head, T, head_dim)
        y = causal_attention(q, k, v, mask, self.dropout if self.training else 0.0)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.o_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)
        self.down_proj.residual_projection = True  # type: ignore[assignment]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, ffn_hidden)
        return self.dropout(self.down_proj(hidden))  # (B, T, C)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    """The embedding, decoder layers and final norm (parameter names ``model.embed_tokens.weight``, ...)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)


class Llama(nn.Module):
    """A Llama-style decoder. ``forward(idx)`` returns the logits, shape (B, T, vocab_size).

    The same interface as :class:`~bigbatch.models.GPT`: ``forward(idx, targets, positions)`` (the summed loss;
    rotary positions restart at each packed document), ``config``, ``activation_checkpointing``, ``chunked_loss``,
    ``num_params``, ``flops_per_token`` and ``fsdp_units``.
    """

    computes_loss = True

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Recompute each layer in backward instead of keeping its activations (less memory, ~1/3 more compute).
        self.activation_checkpointing = False
        self.chunked_loss = True  # the loss from chunks of rows, never the whole (B, T, V) logits
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_projection", False):
                # Each layer adds two projections to the residual stream: keep its variance from growing with depth.
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's block_size {self.config.block_size}")
        cos, sin = rope_cos_sin(self.config, T, idx.device)  # (T, head_dim) each, shared by every layer
        mask = None
        if positions is not None:  # packed documents: each token's own angles, attention within its document
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, T, head_dim)
            mask = document_causal_mask(positions)  # (B, 1, T, T)
        x = self.model.embed_tokens(idx)  # (B, T, C)
        for layer in self.model.layers:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        if targets is None and not last_only:
            return self.lm_head(x)  # (B, T, vocab)
        return logits_or_loss(x, self.lm_head.weight, targets, chunked=self.chunked_loss, last_only=last_only)

    def fsdp_units(self) -> list[nn.Module]:
        """What FSDP2 shards as units before the root (see :func:`bigbatch.models.sharding.fsdp_units`): the
        decoder layers; the embedding, final norm and head stay with the root."""
        return list(self.model.layers)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; tied weights are counted once. ``non_embedding`` drops an untied input embedding
        (a lookup, not a matmul); a tied one stays, as it is also the LM head's matmul."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_embeddings:
            n -= self.model.embed_tokens.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): ``6N + 12 * L * H * Q * T``.

        ``N`` counts the parameters that take part in matmuls (:meth:`num_params` with
        ``non_embedding``); the second term is attention over ``seq_len`` with ``H``
        query heads of ``Q`` dimensions (grouped key/value heads do not shrink it).
        """
        cfg = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len
