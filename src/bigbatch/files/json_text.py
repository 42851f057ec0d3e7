"""JSON that every reader accepts, with NaN and infinities kept: bigbatch's one way to write and read its JSON.

Python's ``json`` writes a NaN or an infinity as the bare words ``NaN`` / ``Infinity`` / ``-Infinity``, which
are not JSON: node's ``JSON.parse`` rejects the line, jq turns them into other numbers (``1.797e308``), and
other tools vary. A run has such values as a matter of course (the loss of a skipped step, an infinite gradient
norm, a noise scale not measured yet), so bigbatch writes them as ``null`` and names them in one extra field of
the object, ``"nonfinite": {"loss": "NaN", "grad_norm": "Infinity"}`` (a dotted path for a nested value, list
items by index). ``null`` rather than a string keeps every number field a number or missing for the tools that
load these files (pandas and polars read ``null`` as a missing value; a string would turn the column into text),
and the extra field keeps what the value was: :func:`from_json` puts it back, so bigbatch reads a record as it
was made. Files written before this hold the bare words, which :func:`from_json` still reads.
"""

from __future__ import annotations

import json
import math
from typing import Any

NONFINITE_FIELD = "nonfinite"
"""The field of a written object naming its values that are not finite numbers, by path: ``"NaN"``,
``"Infinity"`` or ``"-Infinity"``."""

_WORDS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _word(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _finite(value: Any, path: str, found: dict[str, str]) -> Any:
    """``value`` with every non-finite float replaced by ``None``, each one noted in ``found`` by its path."""
    if isinstance(value, float) and not math.isfinite(value):
        found[path] = _word(value)
        return None
    if isinstance(value, dict):
        return {key: _finite(item, f"{path}.{key}" if path else str(key), found) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item, f"{path}.{i}" if path else str(i), found) for i, item in enumerate(value)]
    return value


def to_json(value: Any, indent: int | None = None) -> str:
    """``value`` as standard JSON (no newline at the end): a non-finite float is ``null``, and named in the
    object's :data:`NONFINITE_FIELD`; a non-finite number outside an object is a ValueError."""
    found: dict[str, str] = {}
    cleaned = _finite(value, "", found)
    if found:
        if not isinstance(cleaned, dict):
            raise ValueError(f"non-finite numbers outside a JSON object cannot be written as JSON: {sorted(found)}")
        cleaned[NONFINITE_FIELD] = found
    return json.dumps(cleaned, indent=indent, allow_nan=False)  # a bare NaN here would be a bug: fail, not write it


def from_json(text: str) -> Any:
    """The value :func:`to_json` wrote (its non-finite numbers back in place), or a file's older JSON with bare
    ``NaN`` / ``Infinity``; raises ``json.JSONDecodeError`` (a ValueError) as :func:`json.loads` does."""
    value = json.loads(text)
    if isinstance(value, dict) and isinstance(value.get(NONFINITE_FIELD), dict):
        for path, word in value.pop(NONFINITE_FIELD).items():
            if word in _WORDS:
                _put(value, str(path).split("."), _WORDS[word])
    return value


def _put(container: Any, keys: list[str], number: float) -> None:
    """Set the ``None`` at ``keys`` under ``container`` to ``number``; a path that leads elsewhere is left be."""
    for key in keys[:-1]:
        container = _child(container, key)
    last = keys[-1]
    if isinstance(container, dict) and container.get(last, 0) is None:
        container[last] = number
    elif isinstance(container, list) and last.isdigit() and int(last) < len(container):
        if container[int(last)] is None:
            container[int(last)] = number


def _child(container: Any, key: str) -> Any:
    if isinstance(container, dict):
        return container.get(key)
    if isinstance(container, list) and key.isdigit() and int(key) < len(container):
        return container[int(key)]
    return None
