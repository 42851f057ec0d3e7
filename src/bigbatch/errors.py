"""User-facing errors.

A :class:`BigBatchError` carries a one-line message that says what is wrong and
how to fix it. The CLI prints it without a traceback and exits non-zero.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

EXIT_USER_ERROR = 2
"""The exit code of a user error, from the command line and from a worker of ``--nproc N`` alike."""


class BigBatchError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class ConfigError(BigBatchError):
    """An invalid configuration value or file."""


class PlanError(BigBatchError):
    """A batch configuration that does not divide into whole micro-batches."""


class DataError(BigBatchError):
    """Missing, empty, too short or malformed training data."""


class CheckpointError(BigBatchError):
    """A checkpoint that is missing, unreadable or incompatible."""


class TrainingError(BigBatchError):
    """Training cannot go on (for example, every recent step had a non-finite gradient)."""


def require_creatable_dir(path: Path, what: str) -> None:
    """Raise :class:`ConfigError` early if ``path`` cannot become a directory (a file is in the way)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise ConfigError(f"{what} {path} cannot be created: {candidate} is a file; choose another path")
            return


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``; did you mean --micro-batch?`` for the known name nearest a mistyped ``word`` (as git suggests one), or
    ``""`` when none is near."""
    nearest = difflib.get_close_matches(word, list(known), n=1)
    return f"; did you mean {nearest[0]}?" if nearest else ""


EXTRAS: dict[str, str] = {
    "hf": "datasets, transformers and peft",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
}
"""bigbatch's optional extras (pyproject.toml) and the packages each installs."""


def install_hint(extra: str) -> str:
    """The one way every message and page tells how to get an optional package: the extra that holds it."""
    if extra not in EXTRAS:
        raise ValueError(f"no extra {extra!r}; known: {', '.join(EXTRAS)}")
    return f"pip install -e '.[{extra}]' (bigbatch's [{extra}] extra: {EXTRAS[extra]})"


def require_package(module: str, feature: str, extra: str, package: str | None = None) -> Any:
    """``import module``, or a :class:`BigBatchError` that names the extra whose install fixes it; ``package``
    (default: the extra's name) is the missing distribution's name."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BigBatchError(
            f"{feature} needs the {package or extra} package, which is not installed: {install_hint(extra)}"
        ) from exc
