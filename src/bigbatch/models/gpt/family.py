"""The GPT-2 family as the registry lists it (see :mod:`bigbatch.models.family`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bigbatch.models.family import ModelFamily
from bigbatch.models.gpt.config import MODEL_PRESETS, GPTConfig

if TYPE_CHECKING:
    from bigbatch.models.gpt.model import GPT


def build(config: GPTConfig) -> GPT:
    from bigbatch.models.gpt.model import GPT

    return GPT(config)


def read_hf_config(directory: Path) -> GPTConfig:
    from bigbatch.models.gpt.hf import read_hf_gpt_config

    return read_hf_gpt_config(directory)


def load_hf(directory: Path) -> GPT:
    from bigbatch.models.gpt.hf import load_hf_gpt2

    return load_hf_gpt2(directory)


def save_hf(model: GPT, directory: Path) -> Path:
    from bigbatch.models.gpt.hf import save_hf_gpt2

    return save_hf_gpt2(model, directory)


def layer_bytes_per_token(config: GPTConfig, act_bytes: int) -> int:
    """What a GPT block keeps for backward per token: ``34 x C`` bytes at 16-bit activations, i.e. 17 values of
    the width (attention scores are not stored by fused SDPA)."""
    return 17 * config.n_embd * act_bytes


def describe_shape(config: GPTConfig) -> str:
    return f"{config.n_layer} layers, {config.n_head} heads, {config.n_embd} wide"


def _from_dict(values: dict[str, Any]) -> GPTConfig:
    return GPTConfig(**values)


FAMILY = ModelFamily(
    name="gpt",
    description="GPT-2: learned positions, LayerNorm, tanh-GELU MLP, head tied to the embedding",
    config_type=GPTConfig,
    presets=MODEL_PRESETS,
    build=build,
    config_from_dict=_from_dict,
    describe_shape=describe_shape,
    save_hf=save_hf,
    hf_layout_name="GPT-2",
    hf_class_name=lambda config: "GPT2LMHeadModel",
    layer_bytes_per_token=layer_bytes_per_token,
    hf_model_types=("gpt2",),
    read_hf_config=read_hf_config,
    load_hf=load_hf,
)
