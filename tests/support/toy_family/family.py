"""The toy family's record for the registry."""

from __future__ import annotations

from typing import Any

from bigbatch.models.family import ModelFamily

from .config import TOY_PRESETS, ToyConfig


def build(config: ToyConfig) -> Any:
    from .model import ToyLM

    return ToyLM(config)


def read_hf_config(directory: Any) -> ToyConfig:
    from .hf import read_toy_config

    return read_toy_config(directory)


def load_hf(directory: Any) -> Any:
    from .hf import load_toy

    return load_toy(directory)


def save_hf(model: Any, directory: Any) -> Any:
    from .hf import save_toy

    return save_toy(model, directory)


def layer_bytes_per_token(config: ToyConfig, act_bytes: int) -> int:
    """The norm's input and output, q, k, v, the attention's output: six values of the width."""
    return 6 * config.n_embd * act_bytes


FAMILY = ModelFamily(
    name="toy",
    description="a toy decoder: one attention head per layer, no position table",
    config_type=ToyConfig,
    presets=TOY_PRESETS,
    build=build,
    config_from_dict=lambda values: ToyConfig(**values),
    describe_shape=lambda config: f"toy: {config.n_layer} layers, {config.n_embd} wide",
    save_hf=save_hf,
    hf_layout_name="toy",
    hf_class_name=lambda config: "ToyForCausalLM",
    layer_bytes_per_token=layer_bytes_per_token,
    hf_model_types=("bigbatch-toy",),
    read_hf_config=read_hf_config,
    load_hf=load_hf,
)
