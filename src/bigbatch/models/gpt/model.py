"""The GPT-2 architecture, readable in one sitting.

Token + learned position embeddings, pre-LayerNorm transformer blocks with causal
self-attention (``scaled_dot_product_attention``) and a tanh-GELU MLP, a final
LayerNorm and an LM head tied to the token embedding. The model knows nothing of
batches, accumulation, devices or files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bigbatch.errors import ConfigError
from bigbatch.models.attention import causal_attention, document_causal_mask
from bigbatch.models.lm_output import logits_or_loss


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the vocabulary up to a multiple of ``multiple`` (50257 -> 50304) for faster matmuls."""
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-style model."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50257
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {name} must be a positive integer, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"model n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "choose n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model dropout must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab_size(self) -> int:
        return pad_vocab(self.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


MODEL_PRESETS: dict[str, GPTConfig] = {
    # A CPU demo size: trains in minutes on two cores.
    "nano": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256),
    # Smaller still, for tests.
    "pico": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    # About 1.1B parameters at a 4,096-token context (the 8-GPU example in configs/).
    "gpt-1b": GPTConfig(n_layer=20, n_head=16, n_embd=2048, block_size=4096),
}


def preset(name: str, **overrides: Any) -> GPTConfig:
    """A named model shape, optionally with fields replaced (e.g. ``vocab_size=256``)."""
    if name not in MODEL_PRESETS:
        known = ", ".join(MODEL_PRESETS)
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {known}")
    return replace(MODEL_PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.residual_projection = True  # type: ignore[assignment]  # scaled init
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
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


class GPT(nn.Module):
    """GPT-2. ``forward(idx)`` returns the logits, shape (B, T, vocab_size); ``forward(idx, targets)`` the summed
    next-token loss over the targets that are not -100 (:func:`bigbatch.models.lm_output.logits_or_loss`: in
    chunks of rows, never the whole logits, unless ``chunked_loss`` is off). ``positions`` (B, T), for rows packed
    with several documents, restarts the learned positions at each document and confines attention to it.

    The embedding table is padded to a multiple of 64 for speed, but the padded
    columns are cut off so they never enter a softmax.
    """

    computes_loss = True  # forward(idx, targets) returns the loss sum (bigbatch.engine.accumulate.token_loss_sum asks)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        # Recompute each block in backward instead of keeping its activations (less memory, ~1/3 more compute).
        self.activation_checkpointing = False
        self.chunked_loss = True  # the loss from chunks of rows, never the whole (B, T, V) logits
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
        pos = torch.arange(T, device=idx.device) if positions is None else positions  # (T,) or (B, T)
        mask = None if positions is None else document_causal_mask(positions)  # (B, 1, T, T)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        x = self.transformer.ln_f(x)
        vocab = self.config.vocab_size
        if targets is not None or last_only:
            # The head's first ``vocab`` rows only: the padded rows never reach a softmax.
            weight = self.lm_head.weight[:vocab]
            return logits_or_loss(x, weight, targets, chunked=self.chunked_loss, last_only=last_only)
        if self.config.padded_vocab_size == vocab:
            return self.lm_head(x)  # (B, T, vocab)
        if x.device.type == "cpu":
            # The head's first ``vocab`` rows only: contiguous logits, no logits-sized copy for the slice nor a
            # zero-padded logits gradient in backward (the same numbers; measured ~13% faster forward + backward
            # for nano at the GPT-2 vocabulary on CPU).
            return F.linear(x, self.lm_head.weight[:vocab])  # (B, T, vocab)
        # On GPUs the padded matmul keeps the logits' rows aligned; its slice is copied by the loss's cast.
        return self.lm_head(x)[..., :vocab]  # (B, T, vocab)

    def fsdp_units(self) -> list[nn.Module]:
        """What FSDP2 shards as units before the root (see :func:`bigbatch.models.sharding.fsdp_units`): the
        transformer blocks; the embeddings, final norm and head stay with the root."""
        return list(self.transformer.h)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; tied weights are counted once. ``non_embedding`` drops the position table."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): ``6N + 12 * L * H * Q * T``.

        ``N`` counts parameters without the position table (the tied token table is
        the LM head's matmul); the second term is attention over ``seq_len``.
        """
        cfg = self.config
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len
