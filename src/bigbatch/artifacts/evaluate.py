"""``bigbatch eval``: loss and perplexity of a saved run's model on a token set.

The loss is the token-weighted mean over valid targets (targets of ``-100``
do not count), over the same windows as the trainer's validation pass reads
(:mod:`bigbatch.data.validation`: the whole split when it is small, else a fixed
sample spread uniformly over it), so with the run's own data, micro-batch,
sequence length and ``eval_batches`` it reproduces the run's last logged
validation loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.dataset import open_dataset
from bigbatch.data.fingerprint import dataset_fingerprints
from bigbatch.data.tokenizer_files import checkpoint_tokenizer
from bigbatch.data.tokenizers import is_bpe
from bigbatch.data.validation import validation_windows
from bigbatch.engine.accumulate import resolve_precision, summed_loss
from bigbatch.errors import ConfigError, DataError
from bigbatch.parallel.distributed import reshard
from bigbatch.run.checkpoint import load_checkpoint, model_from_checkpoint
from bigbatch.run.resume import check_tokenizer

if TYPE_CHECKING:
    from bigbatch.run.build import RunParts


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean per valid target token, nats
    tokens: int  # valid targets scored
    micro_batches: int
    split: str
    dataset: Path
    tokenizer: str
    step: int  # the checkpoint's optimizer step
    micro_batch: int
    seq_len: int
    whole_split: bool  # the split was read to its end

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def format(self) -> str:
        read = f"{self.micro_batches} micro-batches" + (" (the whole split)" if self.whole_split else "")
        return (
            f"eval step {self.step} | {self.split} split of {self.dataset} ({self.tokenizer}) | {read} of "
            f"{self.micro_batch} x {self.seq_len} | {self.tokens:,} tokens | loss {self.loss:.4f} | "
            f"perplexity {self.perplexity:,.2f}"
        )


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
    ``batches=0`` the whole split once.
    """
    if split not in ("val", "train"):
        raise ConfigError(f"--split {split!r}: choose val or train")
    device = torch.device(device)
    document = load_checkpoint(checkpoint)
    model = model_from_checkpoint(document)
    tokenizer = str(document.get("tokenizer", "byte"))
    data_cfg, batch_cfg, run_cfg = _section(document, "data"), _section(document, "batch"), _section(document, "run")

    if micro_batch is None:  # the run's (0 when it chose automatically: then 8)
        micro_batch = int(batch_cfg.get("micro_batch") or 0) or 8
    if seq_len is None:
        seq_len = int(batch_cfg.get("seq_len") or 0) or model.config.block_size
    run_batches = int(run_cfg.get("eval_batches", 8))  # 0: auto (before auto existed: 8)
    if micro_batch < 1 or seq_len < 1 or (batches is not None and batches < 0):
        raise ConfigError("--micro-batch and --seq-len must be positive and --batches at least 0")
    if seq_len > model.config.block_size:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's block_size {model.config.block_size}")

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
        bpe_json = checkpoint_tokenizer(document, Path(checkpoint)).to_str()  # type: ignore[attr-defined]
    directory = ensure_prepared(
        data, tokenizer, val_fraction, cache_dir, mode=str(data_cfg.get("data_mode", "packed")), bpe_json=bpe_json
    )
    dataset = open_dataset(directory)
    if dataset.meta.tokenizer != tokenizer:
        raise DataError(
            f"{directory} was prepared with the {dataset.meta.tokenizer} tokenizer but the checkpoint's model was "
            f"trained with {tokenizer}; give raw text or a dataset prepared with --tokenizer {tokenizer}"
        )
    check_tokenizer(document.get("fingerprints") or {}, dataset_fingerprints(dataset), tokenizer, str(directory))
    dataset.check_token_ids(model.config.vocab_size)
    if not dataset.meta.shards.get(split):
        raise DataError(f"{directory} has no {split} split; prepare it with --val-fraction > 0 or use --split train")
    try:
        # the run's long-document policy (a run from before the policy existed truncated long documents)
        long_documents = str(data_cfg.get("long_documents", "truncate"))
        # by default the run's own windows, as its evaluations read them; batches=0: the whole split
        # documents packed into rows as the run packed them (a run from before packing read one per row)
        pack = str(data_cfg.get("pack", "off")) != "off" and getattr(model, "packs_documents", True)
        loader = validation_windows(
            dataset,
            split,
            micro_batch,
            seq_len,
            run_batches if batches is None else batches,
            long_documents=long_documents,
            whole=batches == 0,
            pack=pack,
        )
    except DataError as exc:
        raise DataError(f"{exc}, or lower --micro-batch / --seq-len") from exc
    if getattr(loader.source, "valid_targets", 1) == 0:
        raise DataError(
            f"the {split} split of {directory} holds no valid targets (every document is a single token or wholly "
            "masked): there is nothing to score"
        )

    model = model.to(device).eval()
    totals, read = summed_loss(model, loader, 0, device, resolve_precision(precision, device))
    n_valid = int(totals[1].item())
    if n_valid == 0:
        raise DataError(f"the {split} micro-batches read hold no valid targets; raise --batches")
    return EvalResult(
        loss=float(totals[0] / n_valid),
        tokens=n_valid,
        micro_batches=read,
        split=split,
        dataset=directory,
        tokenizer=tokenizer,
        step=int(document.get("step", 0)),
        micro_batch=micro_batch,
        seq_len=seq_len,
        whole_split=loader.whole,
    )


@dataclass(frozen=True)
class ValidationResult:
    loss: float  # mean per valid target token over all ranks, nats
    tokens: int  # valid targets scored, all ranks


@torch.no_grad()
def validation_loss(parts: RunParts, should_stop: Callable[[], bool] | None = None) -> float | None:
    """The loss of :func:`validation_result`, or ``None``."""
    result = validation_result(parts, should_stop)
    return None if result is None else result.loss


@torch.no_grad()
def validation_result(parts: RunParts, should_stop: Callable[[], bool] | None = None) -> ValidationResult | None:
    """A training run's mean validation loss over its fixed validation windows (the whole split when small, else
    a sample spread uniformly over it: :mod:`bigbatch.data.validation`), summed over ranks, and the valid targets
    it scored; ``None`` when those windows hold no valid target (no number is made up) or ``should_stop`` (asked
    before each micro-batch) ended the pass early."""
    assert parts.val_loader is not None
    parts.val_loader.reset()
    stopped = False

    def stop_now() -> bool:
        nonlocal stopped
        stopped = stopped or bool(should_stop is not None and should_stop())
        return stopped

    parts.train_model.eval()
    totals, _ = summed_loss(
        parts.train_model,
        parts.val_loader,
        0,
        parts.device,
        parts.engine.precision,
        parts.engine.loss_fn,
        should_stop=stop_now if should_stop is not None else None,
    )  # (loss sum, valid targets) on this rank: every micro-batch of the sample
    parts.train_model.train()
    if parts.parallel == "fsdp":
        reshard(parts.model)
    parts.dist.all_reduce_sum(totals)
    if stopped or totals[1] == 0:
        return None
    return ValidationResult(float(totals[0] / totals[1]), int(totals[1].item()))
