"""The allowed range of every numeric setting, declared once.

A :class:`Range` is attached to a config field (``_opt(..., range=...)``) or to a
plain command-line flag (``type=RANGE.argtype()``); the same object checks a
value from the command line, from a TOML file and from Python, so a flag and its
config key can never disagree. Floats must also be finite: ``nan`` and ``inf``
are refused everywhere.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bigbatch.errors import ConfigError

AUTO = "auto"
OFF = "off"

INT_LIMIT = 2**62
"""The largest integer (either sign) a setting takes where its range names no bound of its own: Python's integers
have none, but the int64 tensors, arrays and files that carry counts and steps stop at 2**63 - 1, and a setting is
added to and multiplied by others; 2**62 leaves that room and is far beyond any count a run can reach."""


@dataclass(frozen=True)
class Range:
    """``kind`` (int or float) between ``low`` and ``high``; ``*_open`` excludes the bound itself."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    auto: bool = False  # the word ``auto`` is accepted as well (and returned as "auto")
    off: bool = False  # the word ``off`` is accepted as well, and stored as 0 (a field's default: nothing runs)

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"{noun} in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{noun} {'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{noun} {'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            text = noun if self.kind is int else "a finite number"
        if self.off:
            text = f"{text} or off"
        return f"{text} or auto" if self.auto else text

    def contains(self, value: Any) -> bool:
        if self.auto and value == AUTO:
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return not self._beyond_limit(value)

    def _beyond_limit(self, value: Any) -> bool:
        """An integer setting past :data:`INT_LIMIT` on a side its range leaves open."""
        if self.kind is not int or not isinstance(value, int) or isinstance(value, bool):
            return False
        return (self.high is None and value > INT_LIMIT) or (self.low is None and value < -INT_LIMIT)

    def _refusal(self, value: Any, shown: str) -> str:
        """What a value outside the range is told (``shown`` as given): the range, and the limit when that is what
        it passed."""
        limit = f" and at most 2**62 ({INT_LIMIT:,}) in size" if self._beyond_limit(value) else ""
        return f"must be {self.describe()}{limit}, got {shown}"

    def check(self, name: str, value: Any) -> Any:
        """``value`` if it lies in the range, else :class:`ConfigError` naming ``name``."""
        if self.off and value in (0, OFF):
            return 0
        if not self.contains(value):
            raise ConfigError(f"{name} {self._refusal(value, repr(value))}")
        return value

    def parse(self, text: str) -> Any:
        """A command-line string as ``kind`` (or "auto"); ``ValueError`` with the reason when it does not fit."""
        if self.auto and text.strip() == AUTO:
            return AUTO
        if self.off and text.strip() == OFF:
            return 0
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"must be {self.describe()}, got {text!r}") from None
        if not self.contains(value):
            raise ValueError(self._refusal(value, text))
        return value

    def argtype(self) -> Callable[[str], Any]:
        """An argparse ``type=``: argparse prefixes the message with the flag's name."""

        def parse(text: str) -> Any:
            try:
                return self.parse(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        parse.__name__ = self.kind.__name__
        return parse


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# The ranges that recur; a setting with an unusual range declares its own Range where it is defined.
ANY_INT = Range(int)
SEED = Range(int, 0, 2**63 - 1)
POSITIVE_INT = Range(int, 1)
NON_NEGATIVE_INT = Range(int, 0)
POSITIVE_INT_OR_AUTO = Range(int, 1, auto=True)
POSITIVE = Range(float, 0, low_open=True)
POSITIVE_OR_AUTO = Range(float, 0, low_open=True, auto=True)
NON_NEGATIVE = Range(float, 0)
FRACTION = Range(float, 0, 1)  # [0, 1]
PROBABILITY = Range(float, 0, 1, high_open=True)  # [0, 1): dropout, held-out share, AdamW betas
POSITIVE_INT_OR_OFF = Range(int, 1, off=True)
NS_STEPS = Range(int, 1, 50)  # Newton-Schulz iterations: 10 already give the polar factor to 1e-6
MEMORY_K = Range(int, 2)  # bigbatch memory compares the peak of K micro-steps with one
