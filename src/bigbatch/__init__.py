"""bigbatch: train GPT-style models (GPT-2 and Llama) with exact gradient accumulation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "model_preset", "preset", "__version__"]

if TYPE_CHECKING:
    from bigbatch.model import GPT, GPTConfig, Llama, LlamaConfig, model_preset, preset


def __getattr__(name: str) -> Any:
    """``bigbatch.GPT`` and friends, imported on first use: ``import bigbatch`` (and ``bigbatch --help``) stays
    free of torch."""
    if name in ("GPT", "GPTConfig", "Llama", "LlamaConfig", "model_preset", "preset"):
        from bigbatch import model

        return getattr(model, name)
    raise AttributeError(f"module 'bigbatch' has no attribute {name!r}")
