"""Checkpoints: atomic save, safe load, finding the newest in a run directory.

A checkpoint is a dict of tensors and plain values (numbers, strings, lists,
dicts), so ``torch.load(path, weights_only=True)`` reads it and a checkpoint from
someone else cannot run code on load. The checkpoint module only gathers the
``state_dict()`` of each stateful part; it knows nothing of their insides.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from bigbatch.errors import CheckpointError

FORMAT_NAME = "bigbatch-checkpoint"
FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{7,})\.pt$")


def checkpoint_path(run_dir: Path | str, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:07d}.pt"


def list_checkpoints(run_dir: Path | str) -> list[Path]:
    """Checkpoints in ``run_dir``, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def save_checkpoint(payload: dict[str, Any], path: Path | str) -> Path:
    """Write ``payload`` to ``path`` atomically: a temporary file, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **payload}
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(document, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def resolve_checkpoint(location: Path | str) -> Path:
    """A checkpoint file from a file path or a run directory (its newest checkpoint)."""
    location = Path(location)
    if location.is_file():
        return location
    if location.is_dir():
        found = list_checkpoints(location)
        if not found:
            raise CheckpointError(f"{location} holds no checkpoints (expected {CHECKPOINT_DIR}/step_*.pt)")
        return found[-1]
    raise CheckpointError(f"checkpoint {location} does not exist; give a run directory or a .pt file")


def load_checkpoint(location: Path | str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; a foreign or damaged file is a :class:`CheckpointError`."""
    path = resolve_checkpoint(location)
    try:
        document = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # unpickling errors come in many types
        raise CheckpointError(f"cannot read checkpoint {path}: it is damaged or not a bigbatch checkpoint") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a bigbatch checkpoint")
    if document.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {document.get('version')}; this bigbatch reads version {FORMAT_VERSION}"
        )
    return document


def model_from_checkpoint(document: dict[str, Any]) -> Any:
    """Rebuild the :class:`~bigbatch.model.GPT` stored in a loaded checkpoint."""
    from bigbatch.model import GPT, GPTConfig

    try:
        model = GPT(GPTConfig(**document["model_config"]))
        model.load_state_dict(document["model"])
    except (KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"the checkpoint's model does not match its stored shape: {exc}") from exc
    return model
