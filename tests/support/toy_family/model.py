"""The toy decoder on bigbatch's shared base: each block is a LayerNorm and one causal attention head."""

from __future__ import annotations

import torch
import torch.nn as nn

from bigbatch.models.decoder import StackedDecoderLM, causal_attention, document_causal_mask

from .config import ToyConfig


class ToyBlock(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.n_embd)
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).unsqueeze(1).chunk(3, dim=-1)  # (B, 1, T, C) each
        return x + self.proj(causal_attention(q, k, v, mask, 0.0).squeeze(1))


class ToyLM(StackedDecoderLM):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([ToyBlock(config) for _ in range(config.n_layer)])
        self.norm = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def embed(
        self, idx: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None]]:
        mask = None if positions is None else document_causal_mask(positions)  # (B, 1, T, T)
        return self.embed_tokens(idx), (mask,)

    def blocks(self) -> nn.ModuleList:
        return self.layers

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def lookup_only_parameters(self) -> int:
        return self.embed_tokens.weight.numel()
