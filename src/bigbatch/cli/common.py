"""Arguments several commands share, declared once: each from the training config's field of the same name (its
type, range, choices and meaning), so that ``--seq-len`` means one thing in ``train``, ``plan``, ``memory`` and
``verify``, with one default. A command whose default is its own says so in :data:`OWN_DEFAULTS`, with the reason.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from bigbatch.run.configuration.train_config import BatchSection, ModelSection, RunSection, field_of, flag_of, kind_of
from bigbatch.settings.ranges import AUTO, POSITIVE_INT, POSITIVE_INT_OR_AUTO, Range

FROM_CONFIG = object()
"""The default of a shared flag: its config field's."""

K_MEANING = "accumulation steps (K): micro-batches per device per optimizer step"
CHECKPOINT_MEANING = "run directory, or one checkpoint of it (RUN/checkpoints/step_N, or an older step_N.pt)"

OWN_DEFAULTS: dict[tuple[str, str], str] = {
    ("verify", "--micro-batch"): "the check's size, 2 x 4 x 64: seconds on a CPU (train's 16 x K x 256 for nano: a "
    "minute)",
    ("verify", "--seq-len"): "the check's size, and a length every preset holds",
    ("verify", "--precision"): "the check is of exact arithmetic: fp32 unless asked",
    ("verify", "--device"): "the check runs where it is asked to; the CPU always can",
    ("verify", "--seed"): "the check's own random batch",
    ("verify", "--loss-aggregation"): "every aggregation is checked unless one is named",
    ("verify", "--policy-loss"): "both policy losses are checked unless one is named",
    ("sample", "--temperature"): "text to read: a little cooler than the 1.0 a grpo rollout explores at",
    ("sample", "--top-k"): "text to read: the long tail of unlikely tokens cut",
    ("eval", "--precision"): "the loss as the run's fp32 validation computes it",
    ("eval", "--micro-batch"): "the run's",
    ("eval", "--seq-len"): "the run's",
    ("prepare", "--seq-len"): "no run to take it from: unset keeps every conversation whole",
    ("critical-batch", "--micro-batch"): "the run's",
    ("critical-batch", "--eval-batches"): "the run's",
    ("eval", "--data"): "the run's own data",
    ("eval", "--cache-dir"): "the run's cache, when it still exists",
    ("prepare", "--tokenizer"): "byte: prepare has no --init-from whose tokenizer auto would take",
    ("plan", "--micro-batch"): "derived when --k and --devices are given, else train's 16",
    ("plan", "--total-batch-tokens"): "derived from --micro-batch, --k and --devices when all three are given",
    ("plan", "--k"): "derived from the tokens per step, as train derives it, unless given",
    ("plan", "--model"): "train's default run (the demo: nano at the byte tokenizer's vocabulary 256), except with "
    "--from-run: no model unless one is named",
}
"""(command, flag) -> why that command's default is not the config's."""


def add_config_flag(
    parser: argparse.ArgumentParser,
    section: type,
    name: str,
    default: Any = FROM_CONFIG,
    note: str = "",
    allow_auto: bool = True,
    parse: Callable[[str], Any] | None = None,
    aliases: tuple[str, ...] = (),
) -> argparse.Action:
    """``--FLAG`` of the config field ``section.name``: its type, range or choices, and its help as meaning, with
    ``note`` (what the command does with it) and the default. ``default``: the field's unless given (an auto field's
    is ``auto``); a command's own default belongs in :data:`OWN_DEFAULTS`. Without ``allow_auto``, a field that takes
    ``auto`` takes positive integers only here (where the command has nothing to resolve it from). ``parse``: a
    command's own reading of the value (``2M``); ``aliases``: other spellings of the flag, first."""
    f = field_of(section, name)
    auto = bool(f.metadata.get("auto")) and allow_auto
    value = f.default if default is FROM_CONFIG else default
    if f.metadata.get("auto") and value == 0:
        value = AUTO if allow_auto else None
    if f.metadata.get("auto") and not allow_auto:
        note += f"; {parser.prog.split()[-1]} takes a number, not auto"
    help_text = f"{f.metadata['help']}{note} (default: {'unset' if value is None else value})"
    kind = kind_of(f)
    if kind is bool:
        action = parser.add_argument(
            f"--{flag_of(f)}", action=argparse.BooleanOptionalAction, default=value, help=help_text
        )
    else:
        declared = f.metadata.get("range")
        if declared is not None and declared.auto and not allow_auto:
            declared = POSITIVE_INT
        action = parser.add_argument(
            *aliases,
            f"--{flag_of(f)}",
            dest=flag_of(f).replace("-", "_"),
            type=parse or (declared.argtype() if declared else kind),
            choices=f.metadata.get("choices"),
            default=value,
            metavar=f"{kind.__name__.upper()}|auto" if auto else kind.__name__.upper(),
            help=help_text,
        )
    return action


def add_model(parser: argparse.ArgumentParser, default: Any = FROM_CONFIG, note: str = "") -> None:
    """``--model``: a preset or ``hf:DIR``, as ``train`` takes it."""
    add_config_flag(parser, ModelSection, "preset", default=default, note=note)


def config_default(section: type, name: str) -> Any:
    """The default of the config field ``section.name``: what a command's unset shared flag stands for."""
    return field_of(section, name).default


def add_seq_len(
    parser: argparse.ArgumentParser, default: Any = FROM_CONFIG, note: str = "", allow_auto: bool = True
) -> None:
    add_config_flag(parser, BatchSection, "seq_len", default=default, note=note, allow_auto=allow_auto)


def add_micro_batch(
    parser: argparse.ArgumentParser, default: Any = FROM_CONFIG, note: str = "", allow_auto: bool = True
) -> None:
    add_config_flag(parser, BatchSection, "micro_batch", default=default, note=note, allow_auto=allow_auto)


def add_precision(parser: argparse.ArgumentParser, default: Any = FROM_CONFIG) -> None:
    """``--precision`` with the one set of precision names (:data:`bigbatch.settings.choices.PRECISION`)."""
    add_config_flag(parser, RunSection, "precision", default=default)


def add_device(parser: argparse.ArgumentParser, default: Any = FROM_CONFIG) -> None:
    add_config_flag(parser, RunSection, "device", default=default)


def add_seed(parser: argparse.ArgumentParser, default: Any = FROM_CONFIG) -> None:
    add_config_flag(parser, RunSection, "seed", default=default)


def add_k(parser: argparse.ArgumentParser, default: int | None, note: str = "", least: Range = POSITIVE_INT) -> None:
    """``--k`` of the commands that take K itself (``train`` derives it from ``--total-batch-tokens``)."""
    shown = "unset" if default is None else default
    parser.add_argument(
        "--k", type=least.argtype(), default=default, metavar="INT", help=f"{K_MEANING}{note} (default: {shown})"
    )


def add_vocab_size(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--vocab-size`` of the commands that build a model by name (plan, memory, verify): the model's own unless a
    number is given (a command reads ``auto`` as 0, "the model's"); ``note``: what the command adds to that."""
    parser.add_argument(
        "--vocab-size",
        type=POSITIVE_INT_OR_AUTO.argtype(),
        default=AUTO,
        metavar="INT|auto",
        help="vocabulary; auto: the model's own (a preset's 50257, llama3.2-1b's 128256, hf:DIR's config.json's); "
        f"256 for byte tokens{note} (default: auto)",
    )
