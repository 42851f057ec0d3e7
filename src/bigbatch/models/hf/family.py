"""The ``hf:DIR`` family as the registry lists it (see :mod:`bigbatch.models.family`): any local Hugging Face
causal LM, its shape its config.json's."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from bigbatch.models.family import ModelFamily
from bigbatch.models.hf.config import HF_PREFIX, HFConfig, dropout_note, training_notes

if TYPE_CHECKING:
    import torch.nn as nn

    from bigbatch.models.hf.model import HFCausalLM


def build(config: HFConfig) -> HFCausalLM:
    """Freshly initialised from config.json, without reading its weights."""
    from bigbatch.models.hf.model import build_hf_model

    return build_hf_model(config)


def build_for_training(config: HFConfig, dropout: float) -> HFCausalLM:
    """Its directory's weights when it has them, else seeded from config.json; ``--dropout`` replaces its own."""
    from bigbatch.models.hf.model import build_hf_model

    return build_hf_model(config, weights=True, dropout=dropout)


def shape_from_name(name: str) -> HFConfig:
    from bigbatch.models.hf.model import read_hf_config

    return read_hf_config(name[len(HF_PREFIX) :])


def save_hf(model: HFCausalLM, directory: Path) -> Path:
    from bigbatch.models.hf.model import save_hf_model

    return save_hf_model(model, directory)


def compile_or_eager(module: nn.Module) -> nn.Module:
    """An architecture of any kind may not compile: it then trains eagerly (said once)."""
    from bigbatch.models.hf.model import CompiledOrEager

    return CompiledOrEager(module)


def describe_shape(config: HFConfig) -> str:
    kv = f" ({config.n_kv_head} key/value)" if config.n_kv_head != config.n_head else ""
    experts = f", {config.experts} experts" if config.experts else ""
    return (
        f"hf {config.architecture}: {config.n_layer} layers, {config.n_head} heads{kv}, {config.n_embd} wide{experts}"
    )


FAMILY = ModelFamily(
    name="hf",
    description="any local Hugging Face causal LM (hf:DIR), run by transformers with bigbatch's loss",
    config_type=HFConfig,
    presets={},
    build=build,
    config_from_dict=HFConfig.from_dict,
    describe_shape=describe_shape,
    save_hf=save_hf,
    hf_class_name=lambda config: config.architecture,
    no_estimate_reason="the analytic memory estimate is unavailable for hf: models (any architecture)",
    name_prefix=HF_PREFIX,
    location_help="a local Hugging Face causal LM",
    shape_from_name=shape_from_name,
    fixed_shape=True,
    build_for_training=build_for_training,
    training_notes=training_notes,
    dropout_note=dropout_note,
    compile=compile_or_eager,
)
