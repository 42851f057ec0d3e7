"""What a run keeps in its directory beside the checkpoints: bigbatch's marker, ``config.toml``, its own copy
of the tokenizer (``tokenizer/``, so that sample and export survive a moved data cache) and the metrics log."""

from __future__ import annotations

import logging
from dataclasses import replace

from bigbatch.data.tokenizer_files import save_run_tokenizer
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.errors import BigBatchError
from bigbatch.files.atomic import write_text_atomically
from bigbatch.files.outputs import RUN_MARKER, mark_own_dir
from bigbatch.observe.metrics import truncate_metrics
from bigbatch.observe.runs import CONFIG_FILE, run_name
from bigbatch.parallel.distributed import Say
from bigbatch.run.build import RunParts


def start_run_dir(parts: RunParts, fresh: bool, say: Say) -> None:
    """Rank 0: the run directory with its config and tokenizer; a fresh start (nothing to resume: a first run,
    or a crash before the first checkpoint) begins a clean metrics log. A resumed session without ``--name``
    keeps the name ``config.toml`` gave the run (``bigbatch report`` labels the run by it)."""
    mark_own_dir(parts.run_dir, RUN_MARKER, "run")
    config = parts.config
    kept_name = "" if fresh or config.run.name else run_name(parts.run_dir)
    if kept_name:
        config = replace(config, run=replace(config.run, name=kept_name))
    write_text_atomically(parts.run_dir / CONFIG_FILE, config.to_toml())
    if fresh:
        truncate_metrics(parts.run_dir, 0)
    if parts.dataset.meta.tokenizer != "gpt2":  # gpt2 may need a download: copied after the end-of-run sample
        copy_run_tokenizer(parts, say)


def copy_run_tokenizer(parts: RunParts, say: Say) -> None:
    """Rank 0: the run's own copy of its tokenizer in RUN_DIR/tokenizer/ (see bigbatch/data/tokenizer_files.py)."""
    try:
        tokenizer = get_tokenizer(parts.dataset.meta.tokenizer, parts.dataset.directory)
        save_run_tokenizer(parts.run_dir, tokenizer, parts.model.config.block_size)
    except BigBatchError as exc:  # e.g. the GPT-2 encoding cannot be downloaded: training does not need it
        say("the tokenizer could not be copied into the run directory: %s", exc, level=logging.WARNING)
