"""Checkpoints: which exist, which are complete, how they are read, retention.

A checkpoint holds tensors and plain values (numbers, strings, lists, dicts),
so a checkpoint from someone else cannot run code on load. Training writes the
sharded format (``checkpoints/step_0000100/``, every rank its own shards, see
:mod:`.sharded`); the single-file format of earlier bigbatch
(``checkpoints/step_0000100.pt``, written to a temporary file, fsynced and
renamed) is still read. Either is trusted only once its commit marker
``step_0000100.commit`` (JSON: step, sizes and SHA-256 checksums), written
last, exists and matches, so a crash at any moment leaves either a complete,
verified checkpoint or one that is ignored (and reported).

:func:`load_checkpoint` returns either as one document: the run record and small
state, and (``consolidate``, the default) the model's and optimizer's state as
whole tensors, assembled in this process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from bigbatch.errors import BigBatchError, CheckpointError
from bigbatch.files.atomic import write_atomically
from bigbatch.models.decoder import LanguageModel
from bigbatch.models.lora import LoraSettings, add_lora
from bigbatch.models.registry import FAMILIES, build_model, family_names, model_config_from_dict
from bigbatch.run.checkpoints.sharded import DCP_ERRORS, STATE_FILE, read_tensors, root_cause, verify_sharded

log = logging.getLogger(__name__)

FORMAT_NAME = "bigbatch-checkpoint"
FORMAT_VERSION = 1  # the single-file format
SHARDED_VERSION = 2
CHECKPOINT_DIR = "checkpoints"
_FILE_NAME = re.compile(r"^step_(\d{7,})\.pt$")
_FOLDER_NAME = re.compile(r"^step_(\d{7,})$")
_CHUNK = 1 << 20


def checkpoint_path(run_dir: Path | str, step: int) -> Path:
    """Where training saves the (sharded) checkpoint of ``step``: a directory."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:07d}"


def single_file_path(run_dir: Path | str, step: int) -> Path:
    """Where earlier bigbatch saved the checkpoint of ``step``: one file."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{step:07d}.pt"


def commit_path(path: Path) -> Path:
    return path.with_suffix(".commit") if path.suffix == ".pt" else path.with_name(path.name + ".commit")


def is_sharded(path: Path) -> bool:
    return path.is_dir()


def checkpoint_step(path: Path) -> int:
    """The step in a checkpoint's name (``step_0000100`` or ``step_0000100.pt``)."""
    return int(path.name.removesuffix(".pt").split("_")[1])


def checkpoint_at(run_dir: Path | str, step: int) -> Path | None:
    """The checkpoint of ``step`` in ``run_dir`` (sharded, else single-file), committed or not; ``None``: none."""
    for path in (checkpoint_path(run_dir, step), single_file_path(run_dir, step)):
        if path.exists():
            return path
    return None


def list_checkpoints(run_dir: Path | str) -> list[Path]:
    """Checkpoints in ``run_dir``, sharded directories and single files (committed or not), oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        match = _FOLDER_NAME.match(p.name) if p.is_dir() else _FILE_NAME.match(p.name) if p.is_file() else None
        if match:
            found.append((int(match.group(1)), p.is_dir(), p))
    return [p for _, _, p in sorted(found)]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(payload: dict[str, Any], path: Path | str) -> Path:
    """Write ``payload`` to ``path`` atomically as one file (the format of earlier bigbatch, which training no
    longer writes but every reader still loads), then its commit marker (size and SHA-256), last."""
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
        if is_sharded(path):
            return verify_sharded(path, marker)
        size, digest = int(marker["size"]), str(marker["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
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
    if path.is_dir():
        shutil.rmtree(path)
    else:
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
    """A checkpoint from its own path (a ``step_N`` directory or a ``.pt`` file), or the newest verified
    checkpoint of a run directory."""
    location = Path(location)
    if location.is_file() or (location.is_dir() and (location / STATE_FILE).is_file()):
        return location
    if location.is_dir():
        found = latest_valid_checkpoint(location)
        if found is None:
            raise CheckpointError(
                f"{location} holds no complete checkpoints (expected {CHECKPOINT_DIR}/step_* with a commit marker)"
            )
        return found
    raise CheckpointError(f"checkpoint {location} does not exist; give a run directory or a checkpoint's path")


def load_checkpoint(
    location: Path | str, map_location: str | torch.device = "cpu", consolidate: bool = True
) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; a foreign or damaged one is a :class:`CheckpointError`.

    A sharded checkpoint is verified against its commit marker first; its document names the directory under
    ``"shards"`` and, with ``consolidate``, holds ``"model"`` and ``"optimizer"`` as whole tensors (as a
    single-file one does); without, a caller loads the shards itself (:mod:`.sharded`, any world size)."""
    path = resolve_checkpoint(location)
    if is_sharded(path):
        return _load_sharded_document(path, consolidate)
    try:
        document = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # unpickling errors come in many types
        raise CheckpointError(f"cannot read checkpoint {path}: it is damaged or not a bigbatch checkpoint") from exc
    return _checked_document(document, path, FORMAT_VERSION)


def _checked_document(document: Any, path: Path, version: int) -> dict[str, Any]:
    """``document`` if it is a bigbatch checkpoint of ``version`` (the format its path says), else why not."""
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a bigbatch checkpoint")
    if document.get("version") != version:
        raise CheckpointError(
            f"{path} has checkpoint version {document.get('version')}; this bigbatch reads versions "
            f"{FORMAT_VERSION} and {SHARDED_VERSION}"
        )
    return document


def _load_sharded_document(path: Path, consolidate: bool) -> dict[str, Any]:
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"cannot read checkpoint {path}: {problem}; resume from an earlier one, or retrain")
    try:
        document = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: it is damaged or not a bigbatch checkpoint") from exc
    document = _checked_document(document, path, SHARDED_VERSION)
    document["shards"] = str(path)
    if consolidate:
        try:
            tensors = read_tensors(path)
        except DCP_ERRORS as exc:  # DCP's and unpickling errors come in many types
            raise CheckpointError(f"cannot read the shards of checkpoint {path}: {root_cause(exc)}") from exc
        document["model"] = tensors.get("model", {})
        document["optimizer"] = {
            "state": tensors.get("optimizer", {}),
            "param_groups": document.get("optimizer_param_groups", []),
        }
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
        lora = LoraSettings.from_config(document.get("config", {}).get("model", {}))
        if lora.enabled:  # the adapters the run trained, to load their weights into
            add_lora(model, lora)
        model.load_state_dict(document["model"])
    except (KeyError, TypeError, RuntimeError, BigBatchError) as exc:
        raise CheckpointError(f"the checkpoint's {family} model does not match its stored shape: {exc}") from exc
    return model
