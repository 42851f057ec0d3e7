"""Evaluation and sampling during training: the validation loss at ``--eval-every`` steps and at the end (its line
and record), and the end-of-run sample."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.engine.language_model import LanguageModelObjective
from bigbatch.errors import BigBatchError
from bigbatch.models.sampling import sample_text
from bigbatch.observe.metrics import MetricsSink
from bigbatch.parallel.distributed import Say, reshard, unwrap
from bigbatch.parallel.signals import StopRequest
from bigbatch.progress import plural
from bigbatch.run.build import RunParts
from bigbatch.run.loop.run_dir_files import copy_run_tokenizer
from bigbatch.run.loop.validation_loss import ValidationResult, score_windows


def evaluate_windows(parts: RunParts, stop: StopRequest | None = None) -> ValidationResult | None:
    """The validation loss and the tokens it scored (see :func:`~bigbatch.run.loop.validation_loss.score_windows`);
    a stop signal on any rank cuts the pass short, and then there is no result."""
    agreed = (lambda: bool(parts.dist.max_int(stop.signum, parts.device))) if stop is not None else None
    assert parts.val_loader is not None
    engine = parts.engine
    if not isinstance(engine.objective, LanguageModelObjective):
        return measure_objective(parts, agreed)
    return score_windows(
        parts.train_model, parts.val_loader, parts.device, engine.precision, parts.dist, engine.loss_fn, agreed
    )


def measure_objective(parts: RunParts, should_stop: Callable[[], bool] | None) -> ValidationResult | None:
    """A preference objective on the validation windows (every micro-batch of groups, as one step would compute
    it, without gradients): its loss, terms and reward accuracy; ``None`` when a stop cut it short or the windows
    hold no unit of the objective."""
    windows = parts.val_loader
    assert windows is not None
    windows.reset()
    batches = []
    while True:
        if should_stop is not None and should_stop():
            return None
        batches.append(windows.next_micro_batch())
        if windows.epoch:  # the whole sample was read
            break
    loss, totals, values = parts.engine.measure(batches)
    reshard(parts.train_model)
    if totals.empty:
        return None
    return ValidationResult(0.0, totals.targets, len(batches), objective_loss=loss, values=values)


def evaluate_during_training(
    parts: RunParts, step: int, stop: StopRequest, metrics: MetricsSink | None, say: Say
) -> ValidationResult | None:
    """An evaluation at ``step``: its record and line; a warning when the windows hold no valid targets (nothing
    when a stop cut it short)."""
    started = time.perf_counter()
    result = evaluate_windows(parts, stop)
    if result is not None:
        if metrics:
            metrics.write_eval(step, result.loss, val_tokens=result.tokens, values=result.values)
        accuracy = (result.values or {}).get("rewards/accuracy")
        said = f" | val reward accuracy {accuracy:.3f}" if accuracy is not None else ""
        say(
            "eval step %d | val loss %.4f%s | %s | %.1fs",
            step,
            result.loss,
            said,
            plural(result.tokens, "token"),
            time.perf_counter() - started,
        )
    elif not stop.signum:
        say(
            "eval step %d | no val loss: the validation windows hold no valid targets; raise --eval-batches",
            step,
            level=logging.WARNING,
        )
    return result


def sample_run(parts: RunParts, max_new_tokens: int, prompt: str) -> str:
    """Every rank generates the same text (FSDP needs all ranks in each forward); rank 0 reports it."""
    model = parts.model if parts.parallel == "fsdp" else unwrap(parts.model)
    tokenizer = get_tokenizer(parts.dataset.meta.tokenizer, parts.dataset.directory)
    return sample_text(model, tokenizer, prompt, max_new_tokens, parts.config.run.seed, parts.device)  # type: ignore[arg-type]


def end_of_run_sample(parts: RunParts, sample: Callable[[int, str], str], say: Say) -> str | None:
    """``--sample-tokens`` of text from ``--sample-prompt`` once training is done, said; a sample that fails (e.g.
    the GPT-2 encoding cannot be downloaded) is a warning, since the run itself is done."""
    run = parts.config.run
    if not run.sample_tokens:
        return None
    text = None
    try:
        text = sample(run.sample_tokens, run.sample_prompt)
        say("sample:\n%s", text)
        if parts.dist.is_main and parts.dataset.meta.tokenizer == "gpt2":
            copy_run_tokenizer(parts, say)  # the sample has loaded the GPT-2 encoding
    except BigBatchError as exc:
        say("no sample: %s", exc, level=logging.WARNING)
    return text
