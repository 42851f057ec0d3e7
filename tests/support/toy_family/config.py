"""The toy family's shape and presets: no position table (attention alone orders the tokens), one head per
layer, an untied head. No torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ToyConfig:
    n_layer: int = 2
    n_embd: int = 16
    block_size: int = 64
    vocab_size: int = 256
    dropout: float = 0.0
    n_head: int = 1

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


TOY_PRESETS = {"toy-pico": ToyConfig()}
