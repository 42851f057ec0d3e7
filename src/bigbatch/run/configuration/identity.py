"""What makes a run the same run: the settings that define it, their fingerprint, the default run directory.

A run is defined by its model, data, batch arithmetic, optimizer and seed. Re-running the identical command
finds the same default run directory (``runs/<model>-<fingerprint>``) and continues it; a run with other
settings gets another directory, and one pointed at an existing run with ``--out`` is refused with the names of
the settings that differ.

Settings that describe *how* the run executes rather than *what* it computes may change on resume
(:data:`MAY_CHANGE`): the micro-batch (K is re-derived, tokens per step stay), the number of processes and the
parallelism, the device, precision and compilation, logging, evaluation and checkpoint frequencies, the number
of steps (the learning-rate schedule stays unless ``--extend-schedule``), where the data cache lives and the
run directory itself and its name. ``data.data`` (the path) is compared through the data's fingerprint instead, so
a moved corpus continues and a changed one is refused unless ``--allow-data-change``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from bigbatch.errors import BigBatchError
from bigbatch.run.configuration.config_sources import config_from_dict
from bigbatch.run.configuration.data_mode import resolve_data_mode
from bigbatch.run.configuration.seq_len import resolve_seq_len
from bigbatch.run.configuration.train_config import TrainConfig

MAY_CHANGE: frozenset[str] = frozenset(
    {
        "model.activation_checkpointing",
        "model.chunked_loss",
        "data.cache_dir",
        "data.data",  # checked through the data fingerprint (see bigbatch.run.checkpoints.resume.data_changed)
        "batch.micro_batch",
        "batch.memory_budget",
        "optim.decay_steps",  # the schedule is kept on resume; changing it needs --extend-schedule
        "optim.warmup_steps",
        "run.max_steps",
        "run.out",
        "run.name",  # a label for bigbatch report, kept in config.toml
        "run.device",
        "run.precision",
        "run.compile",
        "run.nproc",
        "run.parallel",
        "run.sync_every_micro_step",
        "run.collective_timeout",
        "run.peak_flops",
        "run.tensorboard",
        "run.wandb",
        "run.eval_every",
        "run.eval_batches",
        "run.save_every",
        "run.keep_checkpoints",
        "run.async_checkpoint",
        "run.max_restarts",
        "run.resume",
        "run.overwrite",
        "run.wait_for_lock",
        "run.max_consecutive_skips",
        "run.log_every",
        "run.noise_scale_every",
        "run.noise_scale_window",
        "run.sample_tokens",
        "run.sample_prompt",
        "run.extend_schedule",
        "run.allow_data_change",
        "run.allow_ramp_change",
        "run.allow_batch_change",
        "guard.bad_step",
        "guard.max_rewinds",
        "guard.replay_every",
        "guard.spike_window",
        "guard.loss_spike",
        "guard.grad_spike",
    }
)
"""``section.key`` of the settings that may differ between a run and its resumption."""

RESUME_CHECKED: frozenset[str] = frozenset({"batch.batch_ramp", "batch.total_batch_tokens", "data.shuffle"})
"""Defining settings (in the fingerprint: another value is another default run directory) that a resume checks
itself rather than through :func:`settings_diff`: the batch ramp, so that a flag can allow the change
(``--allow-ramp-change``, see :func:`bigbatch.sizing.ramp.check_ramp_change`), the tokens per step, which the
checkpoint's compatibility check refuses unless ``--allow-batch-change``, and the window order, which the loader's
saved state checks (a run resumes only in the order it was saved in; a run from before ``--shuffle`` read in
order)."""

DEFAULT_RUNS_DIR = "runs"


def _flat(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        f"{section}.{key}": value
        for section, values in config.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }


def identity_settings(config: TrainConfig) -> dict[str, Any]:
    """``{section.key: value}`` of the settings that define the run (everything not in :data:`MAY_CHANGE`); a
    seq_len of auto counts as the number it resolves to (the same run as that number given), a data_mode of auto
    as the mode it resolves to."""
    resolved = resolve_data_mode(resolve_seq_len(config))
    return {k: v for k, v in _flat(resolved.to_dict()).items() if k not in MAY_CHANGE}


LEGACY_VALUES: dict[str, Any] = {"data.shuffle": "off", "batch.seq_len": 256, "data.data_mode": "packed"}
"""Defining settings whose default computes something else than the bigbatch before it did, and the value that
reproduces the old default: a run made before ``--shuffle`` read its windows in order; before seq_len auto (the
model's block size) the default seq_len was 256, so a run at 256 (the nano preset's block size) keeps its
directory; data_mode is compared resolved (never auto) and its default was packed, so a run on text keeps its
directory and a run on conversations under auto finds the one of --data-mode documents."""


def settings_fingerprint(config: TrainConfig) -> str:
    """A short hash of the run's defining settings that differ from their defaults, and of its data source (path
    as given). Defaults are left out so that a setting added by a later bigbatch (at its default) does not move
    an existing run to another directory; a setting whose default changed what a run computes is left out at its
    :data:`LEGACY_VALUES` value instead (so the new default is another directory, the old behaviour the old one)."""
    baseline = {**_flat(TrainConfig().to_dict()), **LEGACY_VALUES}
    settings = {k: v for k, v in identity_settings(config).items() if k not in baseline or v != baseline[k]}
    settings["data.data"] = config.data.data
    payload = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def default_run_dir(config: TrainConfig) -> Path:
    """``runs/<model>-<fingerprint>``: the identical command finds the same directory again."""
    label = Path(config.model.init_from).name if config.model.init_from else config.model.preset
    if label.startswith("hf:"):  # hf:DIR: the directory's own name, not its whole path
        label = "hf-" + Path(label[3:]).name
    label = re.sub(r"[^\w.-]+", "_", label).strip("._") or "run"
    return Path(DEFAULT_RUNS_DIR) / f"{label}-{settings_fingerprint(config)}"


def settings_diff(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """``key saved -> now`` for each defining setting where the saved run's config differs from ``config``.

    A key missing from the saved config (written by an older bigbatch) counts as its default value then: its
    :data:`LEGACY_VALUES` value where the default has changed since, else today's default.
    """
    defaults = {**_flat(TrainConfig().to_dict()), **LEGACY_VALUES}
    saved_flat = _flat(saved) if isinstance(saved, dict) else {}
    if saved_flat.get("batch.seq_len") == 0:  # saved as auto: the saved model's block size, resolved as now
        try:
            saved_flat["batch.seq_len"] = resolve_seq_len(config_from_dict(saved)).batch.seq_len
        except BigBatchError:  # a saved model that cannot be read here: compared as saved
            pass
    if saved_flat.get("data.data_mode") == "auto":  # a config saved unresolved: auto as it resolves for this data
        saved_flat["data.data_mode"] = resolve_data_mode(config).data.data_mode
    diffs = []
    auto = _auto_settings()
    for key, value in identity_settings(config).items():
        if key in RESUME_CHECKED:
            continue
        before = saved_flat.get(key, defaults.get(key))
        if before != value and not (
            isinstance(before, (int, float)) and isinstance(value, (int, float)) and float(before) == float(value)
        ):
            diffs.append(f"{key} {_shown(key, before, auto)!r} -> {_shown(key, value, auto)!r}")
    return diffs


def _auto_settings() -> set[str]:
    """``section.key`` of the settings that take ``auto``, stored as 0."""
    config = TrainConfig()
    return {
        f"{section.name}.{f.name}"
        for section in fields(config)
        for f in fields(getattr(config, section.name))
        if f.metadata.get("auto")
    }


def _shown(key: str, value: Any, auto: set[str]) -> Any:
    """A setting's value as the user gives it: ``auto`` rather than the 0 it is stored as."""
    return "auto" if key in auto and value in (0, 0.0) and not isinstance(value, bool) else value
