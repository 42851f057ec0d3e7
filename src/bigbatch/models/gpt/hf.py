"""GPT-2 weights in the Hugging Face layout: load into :class:`~bigbatch.models.GPT`, write back out.

Hugging Face's GPT-2 stores its projections as ``Conv1D`` with weights of shape
(in, out), the transpose of ``nn.Linear``; its LM head is tied to the token
embedding. The directory itself (config.json, the weights files, the atomic
writer) is :mod:`bigbatch.models.hf_files`'s, shared with the other families.
Nothing here touches the network: give a local directory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from bigbatch.errors import CheckpointError
from bigbatch.models.gpt.model import GPT, GPTConfig
from bigbatch.models.hf_files import check_new_directory, read_config, read_weights, write_hf_directory

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older checkpoints


def gpt_config_from_hf(config: dict[str, Any]) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face GPT-2 ``config.json``; refuses variants this GPT does not implement."""
    if config.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"model_type {config.get('model_type')!r} is not gpt2")
    n_embd = int(config.get("n_embd", 768))
    problems = []
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation {config.get('activation_function')!r} (bigbatch uses tanh-GELU)")
    if config.get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner {config.get('n_inner')} (bigbatch uses 4 x n_embd)")
    if not math.isclose(float(config.get("layer_norm_epsilon", 1e-5)), 1e-5):
        problems.append(f"layer_norm_epsilon {config.get('layer_norm_epsilon')} (bigbatch uses 1e-5)")
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("scale_attn_weights") is False:
        problems.append("non-standard attention scaling")
    if config.get("tie_word_embeddings") is False:
        problems.append("an untied LM head")
    if problems:
        raise CheckpointError(f"this GPT-2 variant is not supported: {'; '.join(problems)}")
    return GPTConfig(
        n_layer=int(config.get("n_layer", 12)),
        n_head=int(config.get("n_head", 12)),
        n_embd=n_embd,
        block_size=int(config.get("n_positions", 1024)),
        vocab_size=int(config.get("vocab_size", 50257)),
    )


def read_hf_gpt_config(directory: Path | str) -> GPTConfig:
    """The :class:`GPTConfig` of a local Hugging Face GPT-2 directory, from its config.json alone."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; give a Hugging Face GPT-2 directory")
    return gpt_config_from_hf(read_config(directory, kind="GPT-2"))


def load_hf_gpt2(directory: Path | str) -> GPT:
    """A :class:`GPT` with the weights of a local Hugging Face GPT-2 directory."""
    directory = Path(directory)
    config = read_hf_gpt_config(directory)
    raw = read_weights(directory)
    state: dict[str, torch.Tensor] = {}
    head = None
    for key, value in raw.items():
        key = key.removeprefix("transformer.")
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        if key == "lm_head.weight":
            head = value
            continue
        if key.endswith(CONV1D_SUFFIXES):
            value = value.t()
        state[f"transformer.{key}"] = value.contiguous()
    wte = state.get("transformer.wte.weight")
    if wte is None:
        raise CheckpointError(f"{directory} has no token embedding (wte.weight)")
    if head is not None and not torch.equal(head, wte):
        raise CheckpointError(f"{directory} has an LM head that differs from its token embedding (untied)")
    model = GPT(config)
    padded = torch.zeros(config.padded_vocab_size, config.n_embd, dtype=wte.dtype)
    padded[: config.vocab_size] = wte
    state["transformer.wte.weight"] = padded
    state["lm_head.weight"] = padded
    try:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"the weights in {directory} do not fit its config.json: {exc}") from exc
    return model


def hf_config(model: GPT) -> dict[str, Any]:
    cfg = model.config
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": cfg.vocab_size - 1,
        "eos_token_id": cfg.vocab_size - 1,
    }


def save_hf_gpt2(model: GPT, directory: Path | str) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the Hugging Face GPT-2 layout (a new or empty directory)."""
    directory = Path(directory)
    check_new_directory(directory)
    tensors: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied to wte
        value = value.detach().cpu()
        if key == "transformer.wte.weight":
            value = value[: model.config.vocab_size]
        if key.endswith(CONV1D_SUFFIXES):
            value = value.t()
        tensors[key] = value.contiguous().clone()
    return write_hf_directory(directory, tensors, hf_config(model))
