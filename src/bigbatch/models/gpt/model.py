"""The GPT-2 architecture, readable in one sitting.

Token + learned position embeddings, pre-LayerNorm transformer blocks with causal
self-attention (``scaled_dot_product_attention``) and a tanh-GELU MLP, a final
LayerNorm and an LM head tied to the token embedding. The model knows nothing of
batches, accumulation, devices or files.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.models.decoder import LayerCache, StackedDecoderLM, causal_attention, document_causal_mask
from bigbatch.models.gpt.config import MODEL_PRESETS, GPTConfig, pad_vocab, preset
from bigbatch.models.matrix_layout import MatrixLayout

__all__ = ["GPT", "MODEL_PRESETS", "GPTConfig", "pad_vocab", "preset"]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.residual_projection = True  # type: ignore[assignment]  # scaled init
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if cache is not None:  # the earlier tokens' keys and values first: (B, n_head, cached + T, head_dim)
            k, v = cache.append(k, v)
        y = causal_attention(q, k, v, mask, self.dropout if self.training else 0.0)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.residual_projection = True  # type: ignore[assignment]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class Transformer(nn.Module):
    """The embeddings, blocks and final norm (parameter names ``transformer.wte.weight``, ... as in GPT-2)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)


class GPT(StackedDecoderLM):
    """GPT-2 on :class:`~bigbatch.models.decoder.StackedDecoderLM` (its forward, loss and counts); the learned
    positions restart at each packed document.

    The embedding table is padded to a multiple of 64 for speed, but the padded
    columns are cut off so they never enter a softmax.
    """

    supports_kv_cache = True  # the blocks take ``cache=``; :meth:`embed_at` offsets the learned positions

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.activation_checkpointing = False
        self.chunked_loss = True
        self.apply(self._init_weights)
        with torch.no_grad():
            # Padding rows are never looked up and never reach a softmax: keep them at zero (they stay there).
            self.transformer.wte.weight[config.vocab_size :].zero_()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_projection", False):
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def embed(
        self, idx: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None]]:
        pos = torch.arange(idx.size(1), device=idx.device) if positions is None else positions  # (T,) or (B, T)
        mask = None if positions is None else document_causal_mask(positions)  # (B, 1, T, T)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        return self.transformer.drop(x), (mask,)

    def embed_at(self, idx: torch.Tensor, start: int) -> tuple[torch.Tensor, tuple[torch.Tensor | None]]:
        pos = torch.arange(start, start + idx.size(1), device=idx.device)  # (T,): the learned positions after the cache
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        return self.transformer.drop(x), (None,)  # no mask: the attention orders queries after the cached keys

    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    def matrix_layout(self, path: str, module: nn.Module, name: str, param: torch.Tensor) -> MatrixLayout:
        """``attn.c_attn`` stacks the q, k and v maps in its rows: three matrices."""
        return MatrixLayout(3, -2) if (path, name) == ("attn.c_attn", "weight") else MatrixLayout()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer.ln_f(x)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight[: self.config.vocab_size]  # the padded rows never reach a softmax

    def lookup_only_parameters(self) -> int:
        return self.transformer.wpe.weight.numel()  # the position table (the tied token table is the head's matmul)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.padded_vocab_size == self.config.vocab_size:
            return self.lm_head(x)  # (B, T, vocab)
        if x.device.type == "cpu":
            # The head's first ``vocab`` rows only: contiguous logits, no logits-sized copy for the slice nor a
            # zero-padded logits gradient in backward (the same numbers; measured ~13% faster forward + backward
            # for nano at the GPT-2 vocabulary on CPU).
            return F.linear(x, self.head_weight())  # (B, T, vocab)
        # On GPUs the padded matmul keeps the logits' rows aligned; its slice is copied by the loss's cast.
        return self.lm_head(x)[..., : self.config.vocab_size]  # (B, T, vocab)
