"""The Llama family as the registry lists it (see :mod:`bigbatch.models.family`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from bigbatch.models.family import ModelFamily
from bigbatch.models.llama.config import LLAMA_PRESETS, LlamaConfig

if TYPE_CHECKING:
    from bigbatch.models.llama.model import Llama


def build(config: LlamaConfig) -> Llama:
    from bigbatch.models.llama.model import Llama

    return Llama(config)


def read_hf_config(directory: Path) -> LlamaConfig:
    from bigbatch.models.llama.hf import read_hf_llama_config

    return read_hf_llama_config(directory)


def load_hf(directory: Path) -> Llama:
    from bigbatch.models.llama.hf import load_hf_llama

    return load_hf_llama(directory)


def save_hf(model: Llama, directory: Path) -> Path:
    from bigbatch.models.llama.hf import save_hf_llama

    return save_hf_llama(model, directory)


def layer_bytes_per_token(config: LlamaConfig, act_bytes: int) -> int:
    """What a Llama decoder layer keeps for backward per token, counted from its operations:

    * each RMSNorm: its input and normalised vector in fp32 (the residual stream and the statistics are fp32
      whatever the precision), and its output, the projections' input;
    * attention: the attention's inputs (queries ``C`` wide; keys and values repeated to every query head when
      grouped, else ``kv`` wide each) and output, and the output projection's input. The rotation (RoPE) keeps
      nothing: it multiplies by cos and sin, constants that need no gradient;
    * the SwiGLU MLP: gate, its SiLU, up and their product, each ``ffn_hidden`` wide.

    No position table, no biases, no attention scores (fused SDPA). On CPU in fp32 this is within a few percent
    of the measured forward peak (``bigbatch memory --model llama-nano``)."""
    c, kv, ffn = config.n_embd, config.n_kv_head * config.head_dim, config.ffn_hidden
    norms = 2 * (2 * c * 4 + c * act_bytes)
    grouped = config.n_kv_head != config.n_head
    attention = c + (2 * c if grouped else 2 * kv) + c + c
    return norms + (attention + 4 * ffn) * act_bytes


def describe_shape(config: LlamaConfig) -> str:
    return (
        f"llama: {config.n_layer} layers, {config.n_head} heads ({config.n_kv_head} key/value), {config.n_embd} "
        f"wide, ffn {config.ffn_hidden}"
    )


FAMILY = ModelFamily(
    name="llama",
    description="Llama: rotary positions, RMSNorm, grouped-query attention, SwiGLU MLP",
    config_type=LlamaConfig,
    presets=LLAMA_PRESETS,
    build=build,
    config_from_dict=LlamaConfig.from_dict,
    describe_shape=describe_shape,
    save_hf=save_hf,
    hf_layout_name="Llama",
    hf_class_name=lambda config: "LlamaForCausalLM",
    layer_bytes_per_token=layer_bytes_per_token,
    hf_model_types=("llama",),
    read_hf_config=read_hf_config,
    load_hf=load_hf,
)
