"""``--data-mode auto`` of a run: resolved from the data before the run's settings are hashed, compared or saved,
so that a run on text is the same run (directory, fingerprint, ``config.toml``) as under the old default
``packed``, and a run on conversations the same as with ``--data-mode documents``."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from bigbatch.run.configuration.seq_len import model_directory

if TYPE_CHECKING:
    from bigbatch.run.configuration.train_config import TrainConfig

AUTO = "auto"


def run_tokenizer(config: TrainConfig) -> str:
    """``--tokenizer``; ``auto`` with a model directory that holds a tokenizer.json is that file (what the run's
    raw text is prepared with, see :func:`bigbatch.run.build.data_phase.data_tokenizer`)."""
    directory = model_directory(config)
    if config.data.tokenizer in ("", "auto") and directory:
        from bigbatch.data.tokenizers import model_dir_tokenizer

        return model_dir_tokenizer(directory) or config.data.tokenizer
    return config.data.tokenizer


def resolve_data_mode(config: TrainConfig) -> TrainConfig:
    """``config`` with ``data_mode`` auto replaced by the mode its data is prepared in (a copy), or ``config``
    itself when the mode is given; everything that names, compares or prepares a run uses the resolved one."""
    if config.data.data_mode != AUTO:
        return config
    from bigbatch.data.data_mode import resolve_data_mode as resolve

    tokenizer = run_tokenizer(config)
    mode = resolve(AUTO, config.data.data, "byte" if tokenizer in ("", "auto") else tokenizer)
    return replace(config, data=replace(config.data, data_mode=mode))
