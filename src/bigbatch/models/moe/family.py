"""The mixture-of-experts family as the registry lists it (see :mod:`bigbatch.models.family`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from bigbatch.models.family import ModelFamily
from bigbatch.models.llama.family import layer_bytes_per_token as llama_layer_bytes
from bigbatch.models.moe.config import MOE_PRESETS, MoEConfig

if TYPE_CHECKING:
    from bigbatch.models.moe.model import MoE


def build(config: MoEConfig) -> MoE:
    from bigbatch.models.moe.model import MoE

    return MoE(config)


def read_hf_config(directory: Path) -> MoEConfig:
    from bigbatch.models.moe.hf import read_hf_moe_config

    return read_hf_moe_config(directory)


def load_hf(directory: Path) -> MoE:
    from bigbatch.models.moe.hf import load_hf_moe

    return load_hf_moe(directory)


def save_hf(model: MoE, directory: Path) -> Path:
    from bigbatch.models.moe.hf import save_hf_moe

    return save_hf_moe(model, directory)


def hf_class_name(config: MoEConfig) -> str:
    from bigbatch.models.moe.hf import hf_layout

    return hf_layout(config)


def layer_bytes_per_token(config: MoEConfig, act_bytes: int) -> int:
    """What a layer keeps for backward per token: the attention and norms as Llama's (its MLP term replaced), the
    router's logits, probabilities and top-k weights in fp32, and for each of the token's k experts its gathered
    input, gate, SiLU, up, their product and the weighted output; a shared expert as a Llama MLP with its gate."""
    c, f, k = config.n_embd, config.ffn_hidden, config.top_k
    attention_and_norms = llama_layer_bytes(config.llama, act_bytes) - 4 * f * act_bytes
    router = (2 * config.n_expert + 2 * k) * 4
    experts = k * (2 * c + 4 * f) * act_bytes
    shared = (4 * config.shared_ffn_hidden + 2) * act_bytes if config.shared_ffn_hidden else 0
    return attention_and_norms + router + experts + shared


def describe_shape(config: MoEConfig) -> str:
    shared = f" + shared {config.shared_ffn_hidden}" if config.shared_ffn_hidden else ""
    return (
        f"moe: {config.n_layer} layers, {config.n_head} heads ({config.n_kv_head} key/value), {config.n_embd} wide, "
        f"{config.n_expert} experts of {config.ffn_hidden}{shared}, top-{config.top_k}"
    )


FAMILY = ModelFamily(
    name="moe",
    description="mixture of experts: Llama attention, top-k routed SwiGLU experts (dropless), optional shared expert",
    config_type=MoEConfig,
    presets=MOE_PRESETS,
    build=build,
    config_from_dict=MoEConfig.from_dict,
    describe_shape=describe_shape,
    save_hf=save_hf,
    hf_class_name=hf_class_name,
    layer_bytes_per_token=layer_bytes_per_token,
    hf_model_types=("mixtral", "qwen3_moe"),
    hf_read_name="Mixtral, Qwen3-MoE",
    read_hf_config=read_hf_config,
    load_hf=load_hf,
)
