"""A Hugging Face model directory on disk, whatever the family: reading its ``config.json`` and weights, and
writing a new one all at once.

The layout is a directory with ``config.json`` and ``model.safetensors`` (or the shards that
``model.safetensors.index.json`` lists, or ``pytorch_model.bin``). The families' conversions (:mod:`.gpt.hf` for
GPT-2, :mod:`.llama.hf` for Llama, :mod:`.moe.hf` for mixtures of experts), :mod:`.hf.model` and :mod:`.pretrained`
share these. Nothing here touches the
network: give a local directory (for example one written by ``save_pretrained``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from bigbatch.errors import CheckpointError
from bigbatch.files.atomic import apply_umask

SHARD_INDEX = "model.safetensors.index.json"  # what save_pretrained writes beside the shards of a large model
WEIGHT_FILES = ("model.safetensors", SHARD_INDEX, "pytorch_model.bin")


def read_config(directory: Path, *, kind: str) -> dict[str, Any]:
    """``directory``'s ``config.json`` as a mapping; a missing one is named as not being a Hugging Face ``kind``
    directory (``GPT-2``, ``Llama``, ``model``, ...)."""
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


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
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


def check_new_directory(directory: Path) -> None:
    """Refuse to write a model directory over anything: ``directory`` must not exist or be empty."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise CheckpointError(f"{directory} already exists and is not empty; choose a new output directory")


def write_hf_directory(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """``config.json`` + ``model.safetensors`` in a new or empty ``directory``, all at once: written to a
    temporary sibling that is renamed into place, so an interrupted export leaves no half directory."""
    from safetensors.torch import save_file

    check_new_directory(directory)
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


def _names(keys: list[str]) -> str:
    """A few names of a list, in one line."""
    shown = ", ".join(keys[:3])
    return f"{shown} and {len(keys) - 3} more" if len(keys) > 3 else shown


def load_fitting_weights(
    model: nn.Module, state: dict[str, torch.Tensor], directory: Path, tied_head: str = "", embedding: str = ""
) -> None:
    """Load ``state`` (a directory's tensors under the model's names) into ``model`` (built on the meta device) in
    fp32, assigning the tensors. ``tied_head``: the name of a head tied to ``embedding``: a checkpoint that stores it
    anyway must store the embedding there, and only the embedding is loaded (the caller ties the head again, as
    assigning replaced the parameter). Missing, unexpected or misshapen tensors are refused in one line."""
    if tied_head and tied_head in state:
        head, table = state.pop(tied_head), state.get(embedding)
        if table is not None and not torch.equal(head, table):
            raise CheckpointError(
                f"{directory} has an LM head that differs from its token embedding, but its config.json says "
                "tie_word_embeddings; set it to false"
            )
    expected = {key: value.shape for key, value in model.state_dict().items() if key != tied_head}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(key for key in set(expected) & set(state) if state[key].shape != expected[key])
    if missing or unexpected or misshapen:
        parts = [f"missing {_names(missing)}"] if missing else []
        parts += [f"unexpected {_names(unexpected)}"] if unexpected else []
        parts += [
            f"{key} has shape {tuple(state[key].shape)}, expected {tuple(expected[key])}" for key in misshapen[:1]
        ]
        raise CheckpointError(f"the weights in {directory} do not fit its config.json: {'; '.join(parts)}")
    model.load_state_dict({key: value.float() for key, value in state.items()}, strict=False, assign=True)


def has_weights(directory: Path | str) -> bool:
    return any((Path(directory) / name).is_file() for name in WEIGHT_FILES)


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No transformers progress bars on bigbatch's console while weights are read or written."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
