"""The mixture-of-experts family's shape and presets (no torch: the command line's help lists the presets)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.models.family import check_sizes
from bigbatch.models.llama.config import LlamaConfig


@dataclass(frozen=True)
class MoEConfig:
    """Shape of a Llama-attention decoder whose every MLP is a mixture of ``n_expert`` SwiGLU experts of width
    ``ffn_hidden``, ``top_k`` of them per token (softmax over the experts, then top-k; ``norm_topk_prob``: the k
    weights renormalised to sum to 1), dropless: every token reaches its k experts. ``shared_ffn_hidden`` > 0
    adds a shared expert every token passes through, gated by a sigmoid (Qwen2-MoE's). ``qk_norm``: an RMSNorm of
    each query and key head before the rotation (Qwen3-MoE's). ``router_aux_coef`` and ``router_z_coef`` are the
    coefficients of the load-balancing loss and the router z-loss training uses unless told otherwise."""

    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    ffn_hidden: int  # each expert's SwiGLU width
    n_expert: int
    top_k: int
    block_size: int
    vocab_size: int = 50257
    shared_ffn_hidden: int = 0
    norm_topk_prob: bool = True
    qk_norm: bool = False
    router_aux_coef: float = 0.01
    router_z_coef: float = 0.0
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_sizes(self, ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "block_size", "vocab_size"))
        if self.n_expert < 2:
            raise ConfigError(f"model n_expert must be at least 2 (a mixture), got {self.n_expert}")
        if not 1 <= self.top_k <= self.n_expert:
            raise ConfigError(f"model top_k must be between 1 and n_expert={self.n_expert}, got {self.top_k}")
        if self.shared_ffn_hidden < 0:
            raise ConfigError(f"model shared_ffn_hidden must be 0 (none) or positive, got {self.shared_ffn_hidden}")
        if self.router_aux_coef < 0 or self.router_z_coef < 0:
            raise ConfigError("model router_aux_coef and router_z_coef must be non-negative")
        self.llama  # noqa: B018 - the attention's checks (grouped heads, even head_dim, rope base, norm eps, dropout)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def llama(self) -> LlamaConfig:
        """The Llama shape of the attention, norms and embeddings (its ``ffn_hidden`` is an expert's)."""
        return LlamaConfig(
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_kv_head=self.n_kv_head,
            n_embd=self.n_embd,
            ffn_hidden=self.ffn_hidden,
            block_size=self.block_size,
            vocab_size=self.vocab_size,
            rope_base=self.rope_base,
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
            dropout=self.dropout,
        )

    def expert_parameters(self) -> int:
        """One routed expert's parameters (gate, up and down matrices)."""
        return 3 * self.n_embd * self.ffn_hidden

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MoEConfig:
        return cls(**values)


MOE_PRESETS: dict[str, MoEConfig] = {
    # The Llama presets' attention with 4 (pico) and 8 (nano) experts, 2 per token, each expert as wide as the
    # model (so a token's active MLP is twice its width, about the dense presets' 8/3).
    "moe-pico": MoEConfig(
        n_layer=2,
        n_head=2,
        n_kv_head=1,
        n_embd=32,
        ffn_hidden=32,
        n_expert=4,
        top_k=2,
        block_size=64,
        tie_embeddings=True,
    ),
    "moe-nano": MoEConfig(
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        n_embd=128,
        ffn_hidden=128,
        n_expert=8,
        top_k=2,
        block_size=256,
        tie_embeddings=True,
    ),
    # Mistral's Mixtral 8x7B (46.7B parameters, 12.9B active per token), for plan and memory.
    "mixtral-8x7b": MoEConfig(
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        n_embd=4096,
        ffn_hidden=14336,
        n_expert=8,
        top_k=2,
        block_size=32768,
        vocab_size=32000,
        router_aux_coef=0.02,
        rope_base=1_000_000.0,
    ),
}


def moe_preset(name: str, **overrides: Any) -> MoEConfig:
    """A named MoE shape, optionally with fields replaced."""
    if name not in MOE_PRESETS:
        raise ConfigError(f"unknown MoE preset {name!r}; choose one of: {', '.join(MOE_PRESETS)}")
    return replace(MOE_PRESETS[name], **overrides)
