"""The models: the GPT-2 architecture (:mod:`.gpt`) and a Llama-style one (:mod:`.llama`), how they are sharded
(:mod:`.parallel`), Hugging Face interop (:mod:`.hf` for GPT-2, :mod:`.llama_hf` for Llama, :mod:`.pretrained`
for a directory of either) and sampling (:mod:`.sampling`). They know nothing of batches, accumulation or files
beyond their own weights."""

from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.model.gpt import GPT, MODEL_PRESETS, GPTConfig, pad_vocab, preset
from bigbatch.model.hf import load_hf_gpt2, save_hf_gpt2
from bigbatch.model.llama import LLAMA_PRESETS, Llama, LlamaConfig, RopeScaling, llama_preset
from bigbatch.model.llama_hf import load_hf_llama, read_hf_llama_config, save_hf_llama
from bigbatch.model.parallel import fsdp_units

ModelConfig = GPTConfig | LlamaConfig
"""The shape of either family; :func:`build_model` (``GPT(config)`` or ``Llama(config)``) builds it."""

LanguageModel = GPT | Llama
"""A model of either family: ``config``, ``activation_checkpointing``, ``num_params`` and ``flops_per_token``."""

FAMILIES = ("gpt", "llama")
"""The model families, as checkpoints record them (``model_family``; a checkpoint without one is ``gpt``)."""


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """A named shape of either family (``nano``, ``llama-nano``, ...), optionally with fields replaced."""
    if name in LLAMA_PRESETS:
        return llama_preset(name, **overrides)
    if name in MODEL_PRESETS:
        return preset(name, **overrides)
    known = ", ".join([*MODEL_PRESETS, *LLAMA_PRESETS])
    raise ConfigError(f"unknown model preset {name!r}; choose one of: {known}")


def build_model(config: ModelConfig) -> LanguageModel:
    """The model of ``config``'s family, freshly initialised."""
    return Llama(config) if isinstance(config, LlamaConfig) else GPT(config)


def family_of(model_or_config: LanguageModel | ModelConfig) -> str:
    """``gpt`` or ``llama``: the family of a model or of its shape."""
    config = model_or_config.config if isinstance(model_or_config, (GPT, Llama)) else model_or_config
    return "llama" if isinstance(config, LlamaConfig) else "gpt"


def config_from_dict(family: str, values: dict[str, Any]) -> ModelConfig:
    """The shape stored as ``config.to_dict()`` beside ``family`` (a checkpoint's ``model_config``)."""
    if family == "llama":
        return LlamaConfig.from_dict(values)
    if family == "gpt":
        return GPTConfig(**values)
    raise ConfigError(f"unknown model family {family!r}; this bigbatch knows {', '.join(FAMILIES)}")


__all__ = [
    "FAMILIES",
    "GPT",
    "LLAMA_PRESETS",
    "MODEL_PRESETS",
    "GPTConfig",
    "LanguageModel",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "RopeScaling",
    "build_model",
    "config_from_dict",
    "family_of",
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
