"""Checkpoints: atomic save with a commit marker, verified load, retention.

A checkpoint is a dict of tensors and plain values (numbers, strings, lists,
dicts), so ``torch.load(path, weights_only=True)`` reads it and a checkpoint from
someone else cannot run code on load. The checkpoint module only gathers the
``state_dict()`` of each stateful part; it knows nothing of their insides.

On disk, ``checkpoints/step_0000100.pt`` is written to a temporary file,
flushed, fsynced and renamed; then ``step_0000100.commit`` (JSON: step, size,
SHA-256) is written the same way, last. A reader trusts a checkpoint only when
its commit marker exists and the file's size and checksum match it, so a crash
at any moment leaves either a complete, verified checkpoint or one that is
ignored (and reported).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from bigbatch.errors import BigBatchError, CheckpointError
from bigbatch.files.atomic import write_atomically
from bigbatch.models.decoder import LanguageModel
from bigbatch.models.registry import FAMILIES, build_model, family_names, model_config_from_dict

log = logging.getLogger(__name__)

FORMAT_NAME = "bigbatch-checkpoint"
FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{7,})\.pt$")
_CHUNK = 1 << 20


def checkpoint_path(run_dir: Path | str, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:07d}.pt"


def commit_path(path: Path) -> Path:
    return path.with_suffix(".commit")


def list_checkpoints(run_dir: Path | str) -> list[Path]:
    """Checkpoint files in ``run_dir`` (committed or not), oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(payload: dict[str, Any], path: Path | str) -> Path:
    """Write ``payload`` to ``path`` atomically, then its commit marker (size and SHA-256), last."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **payload}
    commit_path(path).unlink(missing_ok=True)  # a re-save of the same step is uncommitted until done
    write_atomically(path, lambda handle: torch.save(document, handle))
    marker = {"step": int(payload.get("step", -1)), "size": path.stat().st_size, "sha256": sha256_of(path)}
    try:
        write_atomically(commit_path(path), lambda handle: handle.write(json.dumps(marker).encode() + b"\n"))
    except OSError:
        path.unlink(missing_ok=True)  # never committed: give the space back
        raise
    return path


def verify_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` when its commit marker vouches for it."""
    marker_path = commit_path(path)
    if not marker_path.is_file():
        return "no commit marker (the save did not finish)"
    try:
        marker = json.loads(marker_path.read_text())
        size, digest = int(marker["size"]), str(marker["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "its commit marker is unreadable"
    if path.stat().st_size != size:
        return f"its size is {path.stat().st_size} bytes, the commit marker says {size} (truncated?)"
    if sha256_of(path) != digest:
        return "its checksum does not match the commit marker (damaged on disk?)"
    return None


def latest_valid_checkpoint(run_dir: Path | str) -> Path | None:
    """The newest verified checkpoint; each newer one that fails verification is skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def remove_checkpoint(path: Path) -> None:
    """Delete the commit marker first, so a half-deleted checkpoint is never trusted."""
    commit_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def prune_checkpoints(run_dir: Path | str, keep: int) -> list[Path]:
    """Keep the newest ``keep`` verified checkpoints; delete older files. Failures are logged, never raised."""
    if keep < 1:
        return []
    paths = list_checkpoints(run_dir)
    valid = [p for p in paths if commit_path(p).is_file()]
    if len(valid) <= keep:
        return []
    cutoff = valid[-keep]
    removed = []
    for path in paths:
        if path >= cutoff:
            break
        try:
            remove_checkpoint(path)
            removed.append(path)
        except OSError as exc:
            log.warning("could not delete old checkpoint %s (%s); the newer ones are unaffected", path, exc.strerror)
    return removed


def resolve_checkpoint(location: Path | str) -> Path:
    """A checkpoint file from a file path, or the newest verified checkpoint of a run directory."""
    location = Path(location)
    if location.is_file():
        return location
    if location.is_dir():
        found = latest_valid_checkpoint(location)
        if found is None:
            raise CheckpointError(f"{location} holds no complete checkpoints (expected {CHECKPOINT_DIR}/step_*.pt)")
        return found
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


def model_family(document: dict[str, Any]) -> str:
    """The family of a loaded checkpoint's model: its ``model_family``, or the first registered (GPT: checkpoints
    from before Llama record none)."""
    family = document.get("model_family", FAMILIES[0].name)
    if family not in family_names():
        raise CheckpointError(
            f"the checkpoint holds a model of family {family!r}, which this bigbatch does not know (it knows "
            f"{', '.join(family_names())}); use the bigbatch that wrote it"
        )
    return str(family)


def model_from_checkpoint(document: dict[str, Any]) -> LanguageModel:
    """Rebuild the model (of the family ``model_family`` names) stored in a loaded checkpoint."""
    family = model_family(document)
    try:
        model = build_model(model_config_from_dict(family, document["model_config"]))
        model.load_state_dict(document["model"])
    except (KeyError, TypeError, RuntimeError, BigBatchError) as exc:
        raise CheckpointError(f"the checkpoint's {family} model does not match its stored shape: {exc}") from exc
    return model
