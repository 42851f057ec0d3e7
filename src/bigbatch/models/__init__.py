"""The models: the GPT-2 architecture (:mod:`.gpt.model`), a Llama-style one (:mod:`.llama.model`) and any local
Hugging Face causal LM (:mod:`.hf_causal`, ``hf:DIR``); how they are sharded (:mod:`.sharding`: each family names
its FSDP2 units); Hugging Face interop (:mod:`.gpt.hf` for GPT-2, :mod:`.llama.hf` for Llama, :mod:`.pretrained`
for a directory of either, :mod:`.hf_files` for the directory itself); their loss (:mod:`.lm_output`,
:mod:`.head_loss`, whose ``IGNORE_INDEX`` batches follow), attention over packed rows (:mod:`.attention`), the
module types that couple a batch's samples (:mod:`.coupling`) and sampling (:mod:`.sampling`). They know nothing of
batches, accumulation or files beyond their own weights."""

from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.models.gpt.hf import load_hf_gpt2, save_hf_gpt2
from bigbatch.models.gpt.model import GPT, MODEL_PRESETS, GPTConfig, pad_vocab, preset
from bigbatch.models.hf_causal import HF_PREFIX, HFCausalLM, HFConfig, build_hf_model, is_hf_name, read_hf_config
from bigbatch.models.llama.hf import load_hf_llama, read_hf_llama_config, save_hf_llama
from bigbatch.models.llama.model import LLAMA_PRESETS, Llama, LlamaConfig, RopeScaling, llama_preset
from bigbatch.models.sharding import fsdp_units

ModelConfig = GPTConfig | LlamaConfig | HFConfig
"""The shape of any family; :func:`build_model` (``GPT(config)``, ``Llama(config)`` or a Hugging Face model from
its config.json) builds it."""

LanguageModel = GPT | Llama | HFCausalLM
"""A model of any family: ``config``, ``activation_checkpointing``, ``num_params`` and ``flops_per_token``."""

FAMILIES = ("gpt", "llama", "hf")
"""The model families, as checkpoints record them (``model_family``; a checkpoint without one is ``gpt``)."""


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """A named shape (``nano``, ``llama-nano``, ..., ``hf:DIR``), optionally with fields replaced."""
    if is_hf_name(name):
        return hf_shape(name, **overrides)
    if name in LLAMA_PRESETS:
        return llama_preset(name, **overrides)
    if name in MODEL_PRESETS:
        return preset(name, **overrides)
    known = ", ".join([*MODEL_PRESETS, *LLAMA_PRESETS, "hf:DIR"])
    raise ConfigError(f"unknown model preset {name!r}; choose one of: {known}")


def hf_shape(name: str, **overrides: Any) -> HFConfig:
    """The shape of ``hf:DIR``: its config.json decides; an override that would change it is refused in one line
    (dropout is no part of the shape: the builder sets the config's dropout probabilities to ``--dropout``)."""
    shape = read_hf_config(name[len(HF_PREFIX) :])
    for key, value in overrides.items():
        if key == "dropout":
            continue
        if key in ("vocab_size", "block_size") and value == getattr(shape, key):
            continue
        what = {"vocab_size": "vocabulary", "block_size": "context length", "dropout": "dropout"}.get(key, key)
        raise ConfigError(f"the {what} of {name} is its config.json's, not bigbatch's to change (asked: {key} {value})")
    return shape


def build_model(config: ModelConfig) -> LanguageModel:
    """The model of ``config``'s family, freshly initialised (a Hugging Face one from its config.json, without
    reading its weights)."""
    if isinstance(config, HFConfig):
        return build_hf_model(config)
    return Llama(config) if isinstance(config, LlamaConfig) else GPT(config)


def family_of(model_or_config: LanguageModel | ModelConfig) -> str:
    """``gpt``, ``llama`` or ``hf``: the family of a model or of its shape."""
    config = model_or_config.config if isinstance(model_or_config, (GPT, Llama, HFCausalLM)) else model_or_config
    if isinstance(config, HFConfig):
        return "hf"
    return "llama" if isinstance(config, LlamaConfig) else "gpt"


def model_config_from_dict(family: str, values: dict[str, Any]) -> ModelConfig:
    """The shape stored as ``config.to_dict()`` beside ``family`` (a checkpoint's ``model_config``)."""
    if family == "llama":
        return LlamaConfig.from_dict(values)
    if family == "hf":
        return HFConfig.from_dict(values)
    if family == "gpt":
        return GPTConfig(**values)
    raise ConfigError(f"unknown model family {family!r}; this bigbatch knows {', '.join(FAMILIES)}")


__all__ = [
    "FAMILIES",
    "GPT",
    "LLAMA_PRESETS",
    "MODEL_PRESETS",
    "GPTConfig",
    "HFCausalLM",
    "HFConfig",
    "LanguageModel",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "RopeScaling",
    "build_model",
    "model_config_from_dict",
    "family_of",
    "fsdp_units",
    "hf_shape",
    "is_hf_name",
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
