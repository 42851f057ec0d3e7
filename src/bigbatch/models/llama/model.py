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

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.models.decoder import LayerCache, StackedDecoderLM, causal_attention, document_causal_mask
from bigbatch.models.llama.config import LLAMA_PRESETS, LlamaConfig, RopeScaling, llama_preset

__all__ = ["LLAMA_PRESETS", "Llama", "LlamaConfig", "RopeScaling", "llama_preset"]


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
    """Grouped-query attention with rotary positions; ``qk_norm``: each query and key head RMS-normalised before
    the rotation (Qwen3's ``q_norm`` and ``k_norm``)."""

    def __init__(self, config: LlamaConfig, qk_norm: bool = False) -> None:
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
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if qk_norm else None
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # the earlier tokens' rotated keys and values first: (B, n_kv_head, cached + T, head_dim)
            k, v = cache.append(k, v)  # cached before the grouping's repeat: n_kv_head heads, not n_head
        if self.n_kv_head != self.n_head:
            # Query head h reads key/value head h // group. Repeated explicitly rather than with SDPA's
            # enable_gqa, which needs torch 2.5 and not every attention kernel supports.
            group = self.n_head // self.n_kv_head
            k = k.repeat_interleave(group, dim=1)  # (B, n_head, S, head_dim), S keys (T, or cached + T)
            v = v.repeat_interleave(group, dim=1)  # (B, n_head, S, head_dim)
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
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    """The embedding, decoder layers and final norm (parameter names ``model.embed_tokens.weight``, ...): Llama's
    decoder layers, or the ``layers`` given (a mixture of experts' share the rest)."""

    def __init__(self, config: LlamaConfig, layers: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(
            layers if layers is not None else [DecoderLayer(config) for _ in range(config.n_layer)]
        )
        self.norm = RMSNorm(config.n_embd, config.norm_eps)


class RotaryDecoderLM(StackedDecoderLM):
    """Llama's embedding, rotary positions (restarting at each packed document), final RMSNorm and head, optionally
    tied to the embedding, around the decoder layers a subclass builds: ``self.model`` holds ``embed_tokens``,
    ``layers`` and ``norm``, ``self.lm_head`` the head, and :meth:`rope_shape` gives the rotary settings."""

    model: LlamaModel
    lm_head: nn.Linear
    supports_kv_cache = True  # the layers take ``cache=``; :meth:`embed_at` rotates by the positions after the cache

    def rope_shape(self) -> LlamaConfig:
        """The shape whose rotary settings (base, scaling, head_dim) the positions use."""
        shape: LlamaConfig = self.config
        return shape

    def tie_head(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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

    def embed(
        self, idx: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        cos, sin = rope_cos_sin(self.rope_shape(), idx.size(1), idx.device)  # (T, head_dim) each, shared by every layer
        mask = None
        if positions is not None:  # packed documents: each token's own angles, attention within its document
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, T, head_dim)
            mask = document_causal_mask(positions)  # (B, 1, T, T)
        return self.model.embed_tokens(idx), (cos, sin, mask)  # (B, T, C)

    def embed_at(self, idx: torch.Tensor, start: int) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        # The angles of positions 0 ... start + T - 1, cut to the new tokens': each position's angles are computed
        # alone, so they are those the full forward gives it, bit for bit.
        cos, sin = rope_cos_sin(self.rope_shape(), start + idx.size(1), idx.device)  # (start + T, head_dim) each
        mask = None  # the attention orders the new queries after the cached keys
        return self.model.embed_tokens(idx), (cos[start:], sin[start:], mask)  # (B, T, C); (T, head_dim) each

    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def lookup_only_parameters(self) -> int:
        """An untied input embedding is a lookup, not a matmul; a tied one is also the head's."""
        return 0 if self.config.tie_embeddings else self.model.embed_tokens.weight.numel()


class Llama(RotaryDecoderLM):
    """A Llama-style decoder on :class:`~bigbatch.models.decoder.StackedDecoderLM` (its forward, loss and
    counts): rotary positions restart at each packed document."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_head()
        self.activation_checkpointing = False
        self.chunked_loss = True
        self.apply(self._init_weights)
