"""Deciding whether a run continues, and checking that a checkpoint fits the run that resumes it."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from bigbatch.checkpoint import (
    CHECKPOINT_DIR,
    latest_valid_checkpoint,
    list_checkpoints,
)
from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.metrics import METRICS_FILE

log = logging.getLogger(__name__)


def find_resume_checkpoint(run_dir: Path, resume: str, overwrite: bool, is_main: bool) -> Path | None:
    """The checkpoint to continue from, ``None`` for a fresh start; refuses to clobber a run unless told."""
    if not list_checkpoints(run_dir):
        return None
    if resume == "never":
        if not overwrite:
            raise ConfigError(
                f"run directory {run_dir} already holds checkpoints; continue it with --resume auto, "
                "start over with --resume never --overwrite, or choose another --out"
            )
        if is_main:
            log.warning("--overwrite: deleting the checkpoints and logs in %s", run_dir)
            shutil.rmtree(run_dir / CHECKPOINT_DIR)
            (run_dir / METRICS_FILE).unlink(missing_ok=True)
        return None
    found = latest_valid_checkpoint(run_dir)
    if found is None:
        raise CheckpointError(
            f"run directory {run_dir} holds checkpoints but none is complete and valid; move them away, "
            "or start over with --resume never --overwrite"
        )
    return found


def check_compatible(document: dict[str, Any], model_config: dict[str, Any], tokenizer: str, batch: Any) -> None:
    """Refuse a checkpoint whose model, tokenizer, sequence length or step size differs from this run's."""
    saved_model = document.get("model_config", {})
    diffs = [f"{k} {saved_model.get(k)} -> {v}" for k, v in model_config.items() if saved_model.get(k) != v]
    if diffs:
        raise CheckpointError(
            f"the checkpoint's model differs from this run's ({', '.join(diffs)}); use the same --model and data, "
            "or a new --out"
        )
    if document.get("tokenizer") != tokenizer:
        raise CheckpointError(
            f"the checkpoint was trained with the {document.get('tokenizer')} tokenizer, this run's data uses "
            f"{tokenizer}; use the same data, or a new --out"
        )
    saved_batch = document.get("config", {}).get("batch", {})
    for key in ("seq_len", "total_batch_tokens", "token_budget"):
        if key in saved_batch and saved_batch[key] != getattr(batch, key):
            raise CheckpointError(
                f"the checkpoint's {key} is {saved_batch[key]}, this run's is {getattr(batch, key)}; a resumed run "
                "keeps the tokens per step and the sequence length (micro_batch and world size may change)"
            )


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop records after ``step`` (written before a crash, about to be replayed) from the metrics log."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the crash
        recorded = int(record.get("step", 0))
        # A skipped step keeps the step count, so one recorded at ``step`` came after the checkpoint.
        if recorded < step or (recorded == step and not record.get("skipped")):
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
