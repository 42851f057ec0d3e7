"""Arguments several commands share, declared once."""

from __future__ import annotations

import argparse

from bigbatch.settings.choices import PRECISION


def add_precision(parser: argparse.ArgumentParser, default: str) -> None:
    """``--precision`` with the one set of precision names (:data:`bigbatch.settings.choices.PRECISION`)."""
    parser.add_argument("--precision", default=default, choices=PRECISION)
