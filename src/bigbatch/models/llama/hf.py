"""Llama weights in the Hugging Face layout: load into :class:`~bigbatch.models.Llama`, write back out.

A ``LlamaForCausalLM`` directory holds ``config.json`` and ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``). The native model uses the
same parameter names and the same rotary convention, so the weights map one to
one: nothing is transposed or permuted. Only variants the native model computes
exactly are accepted; the others are refused in one line that names what differs.
Nothing here touches the network: give a local directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.models.hf_files import (
    check_new_directory,
    load_fitting_weights,
    read_config,
    read_weights,
    write_hf_directory,
)
from bigbatch.models.llama.model import Llama, LlamaConfig, RopeScaling

# Rotary frequency tables that some older checkpoints saved with the weights; they are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_HEAD = "lm_head.weight"
_EMBEDDING = "model.embed_tokens.weight"


def _rope_settings(config: dict[str, Any], problems: list[str]) -> tuple[float, RopeScaling | None]:
    """RoPE base and Llama-3 scaling, from transformers 5's ``rope_parameters`` or 4.x's ``rope_theta`` and
    ``rope_scaling`` (which wins when both are given, as in transformers)."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        problems.append(f"rope parameters {params!r} (expected one object)")
        return 10_000.0, None
    base = float(params.get("rope_theta", config.get("rope_theta", 10_000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        problems.append("a partial rotary factor (bigbatch rotates every head dimension)")
    if rope_type == "default":
        return base, None
    if rope_type != "llama3":
        problems.append(f"rope_type {rope_type!r} (bigbatch implements default and llama3)")
        return base, None
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(
                params.get("original_max_position_embeddings", config.get("max_position_embeddings", 2048))
            ),
        )
    except KeyError as exc:
        problems.append(f"llama3 rope scaling without {exc.args[0]}")
        return base, None
    except ConfigError as exc:
        problems.append(str(exc))
        return base, None
    return base, scaling


def llama_config_from_hf(config: dict[str, Any]) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face Llama ``config.json``; refuses variants this Llama does not
    implement. Missing fields take transformers' ``LlamaConfig`` defaults."""
    if config.get("model_type") != "llama":
        raise CheckpointError(f"model_type {config.get('model_type')!r} is not llama")
    n_embd = int(config.get("hidden_size", 4096))
    n_head = int(config.get("num_attention_heads", 32))
    problems = []
    if config.get("attention_bias"):
        problems.append("attention biases")
    if config.get("mlp_bias"):
        problems.append("MLP biases")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')!r} (bigbatch uses SiLU)")
    head_dim = config.get("head_dim")
    if head_dim is not None and n_head > 0 and int(head_dim) * n_head != n_embd:
        problems.append(f"head_dim {head_dim} (bigbatch uses hidden_size / num_attention_heads = {n_embd / n_head:g})")
    if config.get("quantization_config"):
        problems.append("quantized weights")
    rope_base, rope_scaling = _rope_settings(config, problems)
    if problems:
        raise CheckpointError(f"this Llama variant is not supported: {'; '.join(problems)}")
    try:
        return LlamaConfig(
            n_layer=int(config.get("num_hidden_layers", 32)),
            n_head=n_head,
            n_kv_head=int(config.get("num_key_value_heads") or n_head),
            n_embd=n_embd,
            ffn_hidden=int(config.get("intermediate_size", 11008)),
            block_size=int(config.get("max_position_embeddings", 2048)),
            vocab_size=int(config.get("vocab_size", 32000)),
            rope_base=rope_base,
            rope_scaling=rope_scaling,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except ConfigError as exc:
        raise CheckpointError(f"this Llama config.json does not describe a valid model: {exc}") from exc


def read_hf_llama_config(directory: Path | str) -> LlamaConfig:
    """The :class:`LlamaConfig` of a local Hugging Face Llama directory, from its config.json alone."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; give a Hugging Face Llama directory")
    return llama_config_from_hf(read_config(directory, kind="Llama"))


def load_hf_llama(directory: Path | str) -> Llama:
    """A :class:`Llama` (fp32, on the CPU) with the weights of a local Hugging Face ``LlamaForCausalLM``
    directory; missing, unexpected or misshapen tensors are refused in one line."""
    directory = Path(directory)
    config = read_hf_llama_config(directory)
    raw = read_weights(directory)
    state = {key: value for key, value in raw.items() if not key.endswith(_IGNORED_SUFFIXES)}
    # Built on the meta device: no time spent on a random initialisation that the weights replace.
    with torch.device("meta"):
        model = Llama(config)
    load_fitting_weights(model, state, directory, _HEAD if config.tie_embeddings else "", _EMBEDDING)
    if config.tie_embeddings:
        model.tie_head()  # assign replaced the parameter: tie it again
    return model


def hf_llama_config(model: Llama) -> dict[str, Any]:
    """The ``config.json`` of ``model`` as a ``LlamaForCausalLM``, every field spelled out.

    RoPE settings are written twice: ``rope_parameters`` for transformers 5, ``rope_theta`` and ``rope_scaling``
    for 4.x; both describe the same rotation.
    """
    cfg = model.config
    scaling: dict[str, Any] | None = None
    if cfg.rope_scaling is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_position,
        }
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_base}
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "torch_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "attention_dropout": cfg.dropout,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        # The last id (GPT-2's end-of-text); bigbatch export sets the run's tokenizer's own (artifacts/export.py).
        "bos_token_id": cfg.vocab_size - 1,
        "eos_token_id": cfg.vocab_size - 1,
        "pad_token_id": None,
    }


def save_hf_llama(model: Llama, directory: Path | str) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (fp32) in the Hugging Face Llama layout (a new or empty
    directory), for ``LlamaForCausalLM.from_pretrained``."""
    directory = Path(directory)
    check_new_directory(directory)  # before copying the weights
    tensors: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key == _HEAD and model.config.tie_embeddings:
            continue  # the embedding; transformers ties it back on load
        # A copy of each (safetensors refuses tensors that share memory), on the CPU in fp32.
        tensors[key] = value.detach().to("cpu", torch.float32, copy=True).contiguous()
    return write_hf_directory(directory, tensors, hf_llama_config(model))
