"""Arguments several commands share, declared once."""

from __future__ import annotations

import argparse

from bigbatch.settings.choices import PRECISION
from bigbatch.settings.ranges import AUTO, POSITIVE_INT_OR_AUTO


def add_precision(parser: argparse.ArgumentParser, default: str) -> None:
    """``--precision`` with the one set of precision names (:data:`bigbatch.settings.choices.PRECISION`)."""
    parser.add_argument("--precision", default=default, choices=PRECISION)


def add_vocab_size(parser: argparse.ArgumentParser) -> None:
    """``--vocab-size`` of the commands that build a model by name (plan, memory, verify): the model's own unless a
    number is given (a command reads ``auto`` as 0, "the model's")."""
    parser.add_argument(
        "--vocab-size",
        type=POSITIVE_INT_OR_AUTO.argtype(),
        default=AUTO,
        metavar="N|auto",
        help="vocabulary; auto: the model's own (a preset's 50257, llama3.2-1b's 128256, hf:DIR's config.json's); "
        "256 for byte tokens (default: auto)",
    )
