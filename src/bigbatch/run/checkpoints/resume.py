"""Deciding whether a run continues, and checking that a checkpoint fits the run that resumes it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from bigbatch.data.tokenizers import is_file_tokenizer
from bigbatch.engine.optim import CosineSchedule
from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.observe.metrics import METRICS_FILE
from bigbatch.progress import plural
from bigbatch.run.checkpoints.checkpoint import (
    CHECKPOINT_DIR,
    latest_valid_checkpoint,
    list_checkpoints,
    model_family,
)
from bigbatch.run.configuration.identity import settings_diff

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


def check_family(document: dict[str, Any], family: str, what: str) -> None:
    """Refuse a checkpoint whose model family (gpt, llama) is not ``family``; ``what`` names the checkpoint."""
    saved = model_family(document)
    if saved != family:
        raise CheckpointError(
            f"{what} holds a {saved} model but this run builds a {family} model; use the run's own --model (or "
            "--init-from), or a new --out"
        )


def check_compatible(
    document: dict[str, Any],
    family: str,
    model_config: dict[str, Any],
    tokenizer: str,
    batch: Any,
    allow_batch_change: bool = False,
) -> None:
    """Refuse a checkpoint whose model family or shape, tokenizer, sequence length or step size differs from
    this run's (the tokens per step may change with ``allow_batch_change``)."""
    check_family(document, family, "the checkpoint")
    saved_model = document.get("model_config", {})
    diffs = [f"{k} {saved_model.get(k)} -> {v}" for k, v in model_config.items() if saved_model.get(k) != v]
    if diffs:
        raise CheckpointError(
            f"the checkpoint's model differs from this run's ({', '.join(diffs)}); use the same --model and data, "
            "or a new --out"
        )
    saved = str(document.get("tokenizer") or "")
    if saved != tokenizer and not (is_file_tokenizer(saved) and is_file_tokenizer(tokenizer)):  # by content below
        raise CheckpointError(
            f"the checkpoint was trained with the {document.get('tokenizer')} tokenizer, this run's data uses "
            f"{tokenizer}; use the same data, or a new --out"
        )
    saved_batch = document.get("config", {}).get("batch", {})
    for key in ("seq_len", "total_batch_tokens", "token_budget"):
        if key in saved_batch and saved_batch[key] != getattr(batch, key):
            if key == "total_batch_tokens" and allow_batch_change:
                continue
            allow = " (or add --allow-batch-change to train at the new one from the next step)"
            raise CheckpointError(
                f"the checkpoint's {key} is {saved_batch[key]}, this run's is {getattr(batch, key)}; a resumed run "
                "keeps the tokens per step and the sequence length (micro_batch and world size may change)"
                f"{allow if key == 'total_batch_tokens' else ''}"
            )


def check_settings(document: dict[str, Any], config: Any, run_dir: Path) -> None:
    """Refuse to continue a run whose defining settings (see :mod:`bigbatch.run.configuration.identity`) differ
    from this one's."""
    diffs = settings_diff(document.get("config", {}), config)
    if diffs:
        raise CheckpointError(
            f"{run_dir} holds a run with other settings ({'; '.join(diffs)}); run its own command to continue it, "
            "or choose another --out (or leave --out unset: each set of settings gets its own run directory)"
        )


def check_tokenizer(saved: dict[str, Any], current: dict[str, str], name: str, what: str) -> None:
    """Refuse tokens of a tokenizer whose fingerprint differs from the one the model was trained with."""
    before, now = str(saved.get("tokenizer") or ""), str(current.get("tokenizer") or "")
    if before and now and before != now:
        raise CheckpointError(
            f"{what} was prepared with a {name} tokenizer other than the model's (fingerprint {now}, the model's "
            f"is {before}: same name, trained on other text); use the run's own data, or data prepared with the "
            "run's tokenizer"
        )


def data_changed(document: dict[str, Any], current: dict[str, str], data: str) -> str | None:
    """How this run's data differs from the checkpoint's, or ``None`` when it is the same (or cannot be told)."""
    saved = document.get("fingerprints") or {}
    before, now = str(saved.get("data") or ""), str(current.get("data") or "")
    if before and now:
        if before == now:
            return None
        return f"its tokens differ from the checkpoint's (data fingerprint {before} -> {now})"
    saved_data = str(document.get("config", {}).get("data", {}).get("data", data))
    if saved_data != data:  # no fingerprints (an older checkpoint or dataset): compare the paths
        return f"data {saved_data!r} -> {data!r}"
    return None


def saved_schedule(document: dict[str, Any]) -> CosineSchedule:
    """The learning-rate schedule the checkpoint's run used (derived from its config when not stored)."""
    stored = document.get("schedule")
    if isinstance(stored, dict):
        return CosineSchedule.from_state_dict(stored)
    config = document.get("config", {})
    optim, run = config.get("optim", {}), config.get("run", {})
    return initial_schedule(
        float(optim.get("lr", 2e-3)),
        float(optim.get("min_lr_ratio", 0.1)),
        int(optim.get("warmup_steps", 0)),
        int(optim.get("decay_steps", 0)),
        int(run.get("max_steps", 1)),
    )


def initial_schedule(lr: float, min_lr_ratio: float, warmup: int, decay: int, max_steps: int) -> CosineSchedule:
    """Warmup then cosine decay to ``lr x min_lr_ratio`` at ``decay`` (0: at ``max_steps``); warmup no longer
    than the decay."""
    decay_steps = decay or max_steps
    return CosineSchedule(lr, lr * min_lr_ratio, min(warmup, decay_steps), decay_steps)


def resumed_schedule(document: dict[str, Any], config: Any, step: int) -> tuple[CosineSchedule, str | None]:
    """The schedule a resumed run follows, and what to say about it.

    The saved schedule is kept: resuming with a larger ``max_steps`` does not move the end of the decay (the
    learning rate stays at its minimum after it). ``--extend-schedule`` moves the end of the decay to this
    run's ``decay_steps`` (or ``max_steps``); warmup that is already over stays as it was. Changing
    ``warmup_steps`` or ``decay_steps`` without ``--extend-schedule`` is refused.
    """
    saved = saved_schedule(document)
    saved_optim = document.get("config", {}).get("optim", {})
    opt, run = config.optim, config.run
    changed = [
        f"optim.{key} {saved_optim.get(key)!r} -> {getattr(opt, key)!r}"
        for key in ("warmup_steps", "decay_steps")
        if key in saved_optim and saved_optim[key] != getattr(opt, key)
    ]
    if not run.extend_schedule:
        if changed:
            raise ConfigError(
                f"{'; '.join(changed)} would change the learning-rate schedule of the run being resumed; add "
                "--extend-schedule to apply it, or keep the run's values"
            )
        note = None
        if run.max_steps > saved.decay_steps and not opt.decay_steps:
            note = (
                f"max_steps {run.max_steps} is beyond the end of this run's learning-rate decay (step "
                f"{saved.decay_steps}): the schedule is kept, lr stays at {saved.min_lr:.1e} after step "
                f"{saved.decay_steps}; add --extend-schedule to stretch the decay to step {run.max_steps}"
            )
        return saved, note
    decay = opt.decay_steps or run.max_steps
    warmup = saved.warmup_steps if step >= saved.warmup_steps else min(opt.warmup_steps, decay)
    if decay < warmup:
        raise ConfigError(
            f"--extend-schedule: the decay would end at step {decay}, before the warmup ({plural(warmup, 'step')})"
        )
    schedule = CosineSchedule(saved.max_lr, saved.min_lr, warmup, decay)
    if schedule == saved:
        return saved, f"--extend-schedule: the schedule is unchanged (decay ends at step {decay})"
    return schedule, (
        f"--extend-schedule: the cosine decay now ends at step {decay} (was {saved.decay_steps}), warmup "
        f"{plural(warmup, 'step')}; lr at step {step + 1} is {schedule(step):.2e} (the kept schedule would give "
        f"{saved(step):.2e})"
    )
