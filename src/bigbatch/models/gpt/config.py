"""The GPT-2 family's shape and presets (no torch: the command line's help lists the presets)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.models.family import check_sizes


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
        check_sizes(self, ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"))
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
