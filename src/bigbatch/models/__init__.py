"""The models: each family in a folder of its own (:mod:`.gpt`, :mod:`.llama`, :mod:`.hf` for any local Hugging Face
causal LM), described to the rest of bigbatch by its :class:`~.family.ModelFamily` and listed in :mod:`.registry`;
the forward pieces they share (:mod:`.decoder`: the block loop, attention over packed rows, the FSDP2 units), their
loss (:mod:`.lm_output`, :mod:`.head_loss`, whose ``IGNORE_INDEX`` batches follow), Hugging Face directories
(:mod:`.hf_files` for the directory itself, :mod:`.pretrained` for ``--init-from`` and export), the module types
that couple a batch's samples (:mod:`.coupling`) and sampling (:mod:`.sampling`). They know nothing of batches,
accumulation or files beyond their own weights.

Each name below is imported on first use, so the registry (and the command line's help, which lists the presets)
needs no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_NAMES = {
    "ModelFamily": "bigbatch.models.family",
    "ModelShape": "bigbatch.models.family",
    "FAMILIES": "bigbatch.models.registry",
    "build_model": "bigbatch.models.registry",
    "family_for_model_name": "bigbatch.models.registry",
    "family_named": "bigbatch.models.registry",
    "family_of": "bigbatch.models.registry",
    "model_config_from_dict": "bigbatch.models.registry",
    "model_preset": "bigbatch.models.registry",
    "preset_names": "bigbatch.models.registry",
    "ModelConfig": "bigbatch.models.family",
    "DecoderLM": "bigbatch.models.decoder",
    "LanguageModel": "bigbatch.models.decoder",
    "fsdp_units": "bigbatch.models.decoder",
    "GPT": "bigbatch.models.gpt.model",
    "GPTConfig": "bigbatch.models.gpt.config",
    "MODEL_PRESETS": "bigbatch.models.gpt.config",
    "pad_vocab": "bigbatch.models.gpt.config",
    "preset": "bigbatch.models.gpt.config",
    "load_hf_gpt2": "bigbatch.models.gpt.hf",
    "save_hf_gpt2": "bigbatch.models.gpt.hf",
    "Llama": "bigbatch.models.llama.model",
    "LlamaConfig": "bigbatch.models.llama.config",
    "LLAMA_PRESETS": "bigbatch.models.llama.config",
    "RopeScaling": "bigbatch.models.llama.config",
    "llama_preset": "bigbatch.models.llama.config",
    "load_hf_llama": "bigbatch.models.llama.hf",
    "read_hf_llama_config": "bigbatch.models.llama.hf",
    "save_hf_llama": "bigbatch.models.llama.hf",
    "HFCausalLM": "bigbatch.models.hf.model",
    "HFConfig": "bigbatch.models.hf.config",
}

__all__ = [
    "DecoderLM",
    "FAMILIES",
    "GPT",
    "GPTConfig",
    "HFCausalLM",
    "HFConfig",
    "LLAMA_PRESETS",
    "LanguageModel",
    "Llama",
    "LlamaConfig",
    "MODEL_PRESETS",
    "ModelConfig",
    "ModelFamily",
    "ModelShape",
    "RopeScaling",
    "build_model",
    "family_for_model_name",
    "family_named",
    "family_of",
    "fsdp_units",
    "llama_preset",
    "load_hf_gpt2",
    "load_hf_llama",
    "model_config_from_dict",
    "model_preset",
    "pad_vocab",
    "preset",
    "preset_names",
    "read_hf_llama_config",
    "save_hf_gpt2",
    "save_hf_llama",
]

if TYPE_CHECKING:
    from bigbatch.models.decoder import DecoderLM, LanguageModel, fsdp_units
    from bigbatch.models.family import ModelConfig, ModelFamily, ModelShape
    from bigbatch.models.gpt.config import MODEL_PRESETS, GPTConfig, pad_vocab, preset
    from bigbatch.models.gpt.hf import load_hf_gpt2, save_hf_gpt2
    from bigbatch.models.gpt.model import GPT
    from bigbatch.models.hf.config import HFConfig
    from bigbatch.models.hf.model import HFCausalLM
    from bigbatch.models.llama.config import LLAMA_PRESETS, LlamaConfig, RopeScaling, llama_preset
    from bigbatch.models.llama.hf import load_hf_llama, read_hf_llama_config, save_hf_llama
    from bigbatch.models.llama.model import Llama
    from bigbatch.models.registry import (
        FAMILIES,
        build_model,
        family_for_model_name,
        family_named,
        family_of,
        model_config_from_dict,
        model_preset,
        preset_names,
    )


def __getattr__(name: str) -> Any:
    """``bigbatch.models.GPT`` and the rest, imported on first use."""
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'bigbatch.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
