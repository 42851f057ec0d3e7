"""The models: the GPT-2 architecture (:mod:`.gpt`) and a Llama-style one (:mod:`.llama`), how they are sharded
(:mod:`.parallel`), Hugging Face interop (:mod:`.hf` for GPT-2, :mod:`.llama_hf` for Llama) and sampling
(:mod:`.sampling`). They know nothing of batches, accumulation or files beyond their own weights."""

from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.model.gpt import GPT, MODEL_PRESETS, GPTConfig, pad_vocab, preset
from bigbatch.model.hf import load_hf_gpt2, save_hf_gpt2
from bigbatch.model.llama import LLAMA_PRESETS, Llama, LlamaConfig, RopeScaling, llama_preset
from bigbatch.model.llama_hf import load_hf_llama, read_hf_llama_config, save_hf_llama
from bigbatch.model.parallel import fsdp_units

ModelConfig = GPTConfig | LlamaConfig
"""The shape of either family; ``GPT(config)`` or ``Llama(config)`` builds it."""


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """A named shape of either family (``nano``, ``llama-nano``, ...), optionally with fields replaced."""
    if name in LLAMA_PRESETS:
        return llama_preset(name, **overrides)
    if name in MODEL_PRESETS:
        return preset(name, **overrides)
    known = ", ".join([*MODEL_PRESETS, *LLAMA_PRESETS])
    raise ConfigError(f"unknown model preset {name!r}; choose one of: {known}")


__all__ = [
    "GPT",
    "LLAMA_PRESETS",
    "MODEL_PRESETS",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "RopeScaling",
    "fsdp_units",
    "llama_preset",
    "load_hf_gpt2",
    "load_hf_llama",
    "model_preset",
    "pad_vocab",
    "preset",
    "read_hf_llama_config",
    "save_hf_gpt2",
    "save_hf_llama",
]
