"""bigbatch: train GPT-style models with exact gradient accumulation."""

from bigbatch.model import GPT, GPTConfig, preset

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "preset", "__version__"]
