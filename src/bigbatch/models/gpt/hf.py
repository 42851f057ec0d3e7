"""GPT-2 weights in the Hugging Face layout: load into :class:`~bigbatch.models.GPT`, write back out.

The layout is a directory with ``config.json`` and ``model.safetensors`` (or the
shards that ``model.safetensors.index.json`` lists, or ``pytorch_model.bin``).
Hugging Face's GPT-2 stores its projections as ``Conv1D`` with weights of shape
(in, out), the transpose of ``nn.Linear``; its LM head is tied to the token
embedding. Nothing here touches the network: give a local directory (for example
one written by ``save_pretrained``). The readers and the atomic writer are shared
with the Llama conversion (:mod:`.llama_hf`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from bigbatch.errors import CheckpointError
from bigbatch.files.permissions import apply_umask
from bigbatch.models.gpt.model import GPT, GPTConfig

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older checkpoints
SHARD_INDEX = "model.safetensors.index.json"  # what save_pretrained writes beside the shards of a large model
WEIGHT_FILES = ("model.safetensors", SHARD_INDEX, "pytorch_model.bin")


def _read_config(directory: Path, kind: str = "GPT-2") -> dict[str, Any]:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory} has no config.json; expected a Hugging Face {kind} directory") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


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


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the first weights file found (in :data:`WEIGHT_FILES` order), on the CPU."""
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name == SHARD_INDEX:
            return _read_shards(directory, path)
        return _read_weight_file(path)
    raise CheckpointError(f"{directory} holds none of {', '.join(WEIGHT_FILES)}")


def _read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt files raise many types
        raise CheckpointError(f"cannot read {path}: it is damaged or not a weights file ({exc})") from exc


def _read_shards(directory: Path, index_path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a sharded safetensors checkpoint; each must be in the shard its index names."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read {index_path}: it is damaged or not a shard index ({exc})") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path} has no weight_map of tensor names to shard files")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or not shard.endswith(".safetensors"):  # no paths outside the directory
            raise CheckpointError(f"{index_path} names {shard!r}, not a .safetensors file beside it")
        path = directory / shard
        if not path.is_file():
            raise CheckpointError(f"{directory} lacks {shard}, a shard its {SHARD_INDEX} names")
        tensors.update(_read_weight_file(path))
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
        raise CheckpointError(f"{index_path} lists {absent[0]}{more}, which no shard holds; the download is incomplete")
    return tensors


def read_hf_gpt_config(directory: Path | str) -> GPTConfig:
    """The :class:`GPTConfig` of a local Hugging Face GPT-2 directory, from its config.json alone."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; give a Hugging Face GPT-2 directory")
    return gpt_config_from_hf(_read_config(directory))


def load_hf_gpt2(directory: Path | str) -> GPT:
    """A :class:`GPT` with the weights of a local Hugging Face GPT-2 directory."""
    directory = Path(directory)
    config = read_hf_gpt_config(directory)
    raw = _read_weights(directory)
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
    _check_new_directory(directory)
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
    return _write_hf_directory(directory, tensors, hf_config(model))


def _check_new_directory(directory: Path) -> None:
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise CheckpointError(f"{directory} already exists and is not empty; choose a new output directory")


def _write_hf_directory(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """``config.json`` + ``model.safetensors`` in a new or empty ``directory``, all at once: written to a
    temporary sibling that is renamed into place, so an interrupted export leaves no half directory."""
    from safetensors.torch import save_file

    _check_new_directory(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        apply_umask(staging, directory=True)  # mkdtemp makes 0700
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        apply_umask(staging / "model.safetensors")  # safetensors writes 0600
        if directory.exists():
            directory.rmdir()
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory
