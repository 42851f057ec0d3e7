"""``bigbatch eval``: loss and perplexity of a saved run's model on a token set.

This module finds the checkpoint, its data and its windows; the scoring is the trainer's own
(:func:`bigbatch.run.loop.validation_loss.score_windows`, on the windows of :mod:`bigbatch.data.validation_windows`), so
with the run's own data, micro-batch, sequence length and ``eval_batches`` it reproduces the run's last logged
validation loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.chat import ChatSettings
from bigbatch.data.dataset import Dataset, open_dataset
from bigbatch.data.fingerprint import dataset_fingerprints
from bigbatch.data.tokenizer_files import checkpoint_tokenizer
from bigbatch.data.tokenizers import is_bpe
from bigbatch.data.validation_windows import ValidationWindows, validation_windows
from bigbatch.engine.accumulate import resolve_precision
from bigbatch.errors import ConfigError, DataError
from bigbatch.models.decoder import LanguageModel
from bigbatch.progress import plural
from bigbatch.run.checkpoints.checkpoint import load_checkpoint, model_from_checkpoint
from bigbatch.run.checkpoints.resume import check_tokenizer
from bigbatch.run.loop.validation_loss import ValidationResult, score_windows


@dataclass(frozen=True)
class EvalFlags:
    """How the command that evaluates spells the flags its errors advise (``None``: it has no such flag), so that
    advice followed is taken: ``bigbatch eval``'s by default; critical-batch has ``--eval-batches`` and no
    ``--split``."""

    batches: str = "--batches"
    split: str | None = "--split"


EVAL_FLAGS = EvalFlags()


@dataclass(frozen=True)
class EvalResult:
    """The score of :func:`~bigbatch.run.loop.validation_loss.score_windows` and what was scored, for the report
    line."""

    scored: ValidationResult
    split: str
    dataset: Path
    tokenizer: str
    step: int  # the checkpoint's optimizer step
    micro_batch: int
    seq_len: int
    whole_split: bool  # the split was read to its end
    objective: str = "lm"  # what the run optimised (a preference objective is not what eval scores)
    answers: str = ""  # the data's answers (pairs, kto rows), or "" for text and conversations

    @property
    def loss(self) -> float:
        """Mean per valid target token, nats."""
        return self.scored.loss

    @property
    def tokens(self) -> int:
        """Valid targets scored."""
        return self.scored.tokens

    @property
    def micro_batches(self) -> int:
        """Micro-batches read (one process)."""
        return self.scored.micro_batches

    @property
    def perplexity(self) -> float:
        return self.scored.perplexity

    def format(self) -> str:
        read = plural(self.micro_batches, "micro-batch", "micro-batches") + (
            " (the whole split)" if self.whole_split else ""
        )
        line = (
            f"eval step {self.step} | {self.split} split of {self.dataset} ({self.tokenizer}) | {read} of "
            f"{self.micro_batch} x {self.seq_len} | {self.tokens:,} tokens | loss {self.loss:.4f} | "
            f"perplexity {self.perplexity:,.2f}"
        )
        if self.answers or self.objective != "lm":  # say what the number is, and where the objective's is
            watched = "val_rewards/desirable, val_kl" if self.objective == "kto" else "val_rewards/accuracy"
            line += (
                f" | the next-token loss of every answer's tokens, not the {self.objective} objective (its "
                f"validation is the run's eval records: val_loss, {watched})"
                if self.objective != "lm"
                else " | the next-token loss of every answer's tokens"
            )
        return line


def _section(document: dict[str, Any], name: str) -> dict[str, Any]:
    config = document.get("config")
    section = config.get(name) if isinstance(config, dict) else None
    return section if isinstance(section, dict) else {}


def evaluate_checkpoint(
    checkpoint: Path | str,
    data: str | None = None,
    split: str = "val",
    batches: int | None = None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    cache_dir: Path | str | None = None,
    flags: EvalFlags = EVAL_FLAGS,
) -> EvalResult:
    """Mean loss of the newest valid checkpoint in ``checkpoint`` (a run directory or a ``.pt`` file) on ``data``.

    ``data`` is a prepared dataset directory or raw text; raw text is prepared
    (once, cached) with the checkpoint's tokenizer (a ``bpe:VOCAB`` one as it is,
    not trained again), validation fraction and data mode, so the run's own corpus
    gives the run's own validation split. ``None`` evaluates on the run's own
    data: the dataset it was trained on, or its source prepared again when that
    dataset is gone. Tokens of another tokenizer (by fingerprint) are refused. Unset
    ``batches``, ``micro_batch`` and ``seq_len`` default to the run's
    ``eval_batches`` (its windows), micro-batch and sequence length; ``batches=N``
    reads ``N`` micro-batches' worth of windows spread uniformly over the split,
    ``batches=0`` the whole split once. Errors advise the calling command's ``flags``.
    """
    if split not in ("val", "train"):
        raise ConfigError(f"--split {split!r}: choose val or train")
    device = torch.device(device)
    document = load_checkpoint(checkpoint)
    model = model_from_checkpoint(document)
    tokenizer = str(document.get("tokenizer", "byte"))
    micro_batch, seq_len, run_batches = _window_shape(document, model.config.block_size, batches, micro_batch, seq_len)
    directory, dataset = _prepared_data(document, Path(checkpoint), data, tokenizer, cache_dir)
    check_tokenizer(document.get("fingerprints") or {}, dataset_fingerprints(dataset), tokenizer, str(directory))
    dataset.check_token_ids(model.config.vocab_size)
    if not dataset.meta.shards.get(split):
        raise DataError(f"{directory} has no {split} split; {_no_split_advice(split, tokenizer, flags)}")
    loader = _run_windows(document, model, dataset, split, micro_batch, seq_len, batches, run_batches)
    if getattr(loader.source, "valid_targets", 1) == 0:
        raise DataError(
            f"the {split} split of {directory} holds no valid targets (every document is a single token or wholly "
            "masked): there is nothing to score"
        )

    scored = score_windows(model.to(device), loader, device, resolve_precision(precision, device))
    if scored is None:
        raise DataError(f"the {split} micro-batches read hold no valid targets; raise {flags.batches}")
    return EvalResult(
        scored=scored,
        split=split,
        dataset=directory,
        tokenizer=tokenizer,
        step=int(document.get("step", 0)),
        micro_batch=micro_batch,
        seq_len=seq_len,
        whole_split=loader.whole,
        objective=str(_section(document, "objective").get("name", "lm") or "lm"),
        answers=dataset.meta.answers if dataset.meta.mode == "documents" else "",
    )


def _window_shape(
    document: dict[str, Any], block_size: int, batches: int | None, micro_batch: int | None, seq_len: int | None
) -> tuple[int, int, int]:
    """The micro-batch, sequence length and the run's ``eval_batches``: those given, else the run's (checked)."""
    batch_cfg, run_cfg = _section(document, "batch"), _section(document, "run")
    if micro_batch is None:  # the run's (0 when it chose automatically: then 8)
        micro_batch = int(batch_cfg.get("micro_batch") or 0) or 8
    if seq_len is None:
        seq_len = int(batch_cfg.get("seq_len") or 0) or block_size
    run_batches = int(run_cfg.get("eval_batches", 8))  # 0: auto; a checkpoint without the setting read 8
    if micro_batch < 1 or seq_len < 1 or (batches is not None and batches < 0):
        raise ConfigError("--micro-batch and --seq-len must be positive and --batches at least 0")
    if seq_len > block_size:
        raise ConfigError(
            f"--seq-len {seq_len} exceeds the model's block size {block_size:,}; lower --seq-len to at "
            f"most {block_size:,}, or leave it out (the run's)"
        )
    return micro_batch, seq_len, run_batches


def _prepared_data(
    document: dict[str, Any], checkpoint: Path, data: str | None, tokenizer: str, cache_dir: Path | str | None
) -> tuple[Path, Dataset]:
    """The dataset to score: ``data`` (or the run's own) prepared with the checkpoint's tokenizer, validation
    fraction and data mode, in the run's cache when it is still there; a dataset of another tokenizer is refused."""
    data_cfg = _section(document, "data")
    if cache_dir is None:  # the run's own cache when it is still there, so its prepared data is reused
        run_cache = str(data_cfg.get("cache_dir") or "")
        cache_dir = run_cache if run_cache and Path(run_cache).is_dir() else None
    val_fraction = float(data_cfg.get("val_fraction", 0.1))
    if data is None:  # the run's own data: the dataset it trained on while it exists, else its source
        trained_on = str(document.get("dataset") or "")
        data = trained_on if trained_on and Path(trained_on).exists() else str(data_cfg.get("data") or "")
        if not data:
            raise ConfigError("the checkpoint does not say which data it was trained on; give --data")
    bpe_json = None
    if is_bpe(tokenizer):  # raw text is tokenized with the model's own tokenizer, not a new one trained on it
        bpe_json = checkpoint_tokenizer(document, checkpoint).to_str()  # type: ignore[attr-defined]
    # the run's chat settings, so that its prepared conversations are found again (a row: the run's seq_len + 1)
    run_seq_len = int(_section(document, "batch").get("seq_len") or 0)
    chat = ChatSettings(
        loss_on=str(data_cfg.get("loss_on", "assistant")),
        no_assistant=str(data_cfg.get("no_assistant", "refuse")),
        long_conversations=str(data_cfg.get("long_conversations", "drop-oldest-turns")),
        max_tokens=run_seq_len + 1 if run_seq_len else 0,
    )
    directory = ensure_prepared(
        data,
        tokenizer,
        val_fraction,
        cache_dir,
        mode=str(data_cfg.get("data_mode", "packed")),
        bpe_json=bpe_json,
        chat=chat,
    )
    dataset = open_dataset(directory)
    if dataset.meta.tokenizer != tokenizer:
        # A bpe: tokenizer is trained on the data, so bigbatch prepare --tokenizer bpe:N makes another one.
        prepared = "" if is_bpe(tokenizer) else f" or a dataset made by bigbatch prepare --tokenizer {tokenizer}"
        raise DataError(
            f"{directory} was prepared with the {dataset.meta.tokenizer} tokenizer but the checkpoint's model was "
            f"trained with {tokenizer}; give --data raw text (tokenized with the checkpoint's tokenizer){prepared}"
        )
    return directory, dataset


def _run_windows(
    document: dict[str, Any],
    model: LanguageModel,
    dataset: Dataset,
    split: str,
    micro_batch: int,
    seq_len: int,
    batches: int | None,
    run_batches: int,
) -> ValidationWindows:
    """The split read as the run's evaluations read it, or the loss is not the one it logged: its long-document
    policy (a checkpoint without one truncated), its packing (without one: a document per row) and, unless
    ``batches`` says otherwise, its own windows (``batches=0``: the whole split). A split too short for one window
    says so itself, naming --seq-len (a window's length does not depend on the micro-batch)."""
    data_cfg = _section(document, "data")
    long_documents = str(data_cfg.get("long_documents", "truncate"))
    pack = str(data_cfg.get("pack", "off")) != "off" and getattr(model, "packs_documents", True)
    return validation_windows(
        dataset,
        split,
        micro_batch,
        seq_len,
        run_batches if batches is None else batches,
        long_documents=long_documents,
        name="validation" if split == "val" else "training",
        whole=batches == 0,
        pack=pack,
    )


def _no_split_advice(split: str, tokenizer: str, flags: EvalFlags) -> str:
    """What gets past a missing split: the other split where the command has ``--split``; else (critical-batch
    compares on the run's own validation split) another run. Raw text is prepared with the run's validation
    fraction, so only a dataset prepared with one helps, and a bpe: tokenizer cannot be prepared again."""
    other = "train" if split == "val" else "val"
    if flags.split is None:
        return f"the branches are compared on the run's own {split} split: branch a run trained with --val-fraction > 0"
    if split == "train" or is_bpe(tokenizer):
        return f"use {flags.split} {other}"
    return (
        f"use {flags.split} {other}, or give --data a dataset with a val split "
        f"(bigbatch prepare SOURCE --out DIR --tokenizer {tokenizer} --val-fraction 0.1)"
    )
