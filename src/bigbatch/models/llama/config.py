"""The Llama family's shape and presets (no torch: the command line's help lists the presets)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.models.family import check_sizes


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
        check_sizes(self, ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "block_size", "vocab_size"))
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
