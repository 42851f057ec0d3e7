"""How a config field is declared: its default, its CLI help and flag, and the range or choices it takes."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from bigbatch.settings.choices import Choices
from bigbatch.settings.ranges import Range


def config_field(
    default: Any,
    help: str,
    flag: str | None = None,
    range: Range | None = None,
    choices: Choices | None = None,
    legacy_zero: bool = False,
    switch: bool = False,
) -> Any:
    """A config field with its CLI help (and a flag name when it differs from the field name); a numeric
    field declares its allowed :class:`~bigbatch.settings.ranges.Range`, a closed choice its
    :class:`~bigbatch.settings.choices.Choices`: both are checked for flags, TOML files and Python alike.
    Every field is declared here, so its metadata has one shape.

    A range that takes ``auto`` makes an auto field: ``auto`` is stored as 0 and resolved where it is used.
    ``legacy_zero``: config files from before the word ``auto`` wrote 0 for it; a file's 0 still reads as auto
    (the flag refuses 0). ``switch``: a choice of ``auto``/``on``/``off`` words whose flag also works bare
    (``--compile`` is ``on``) and negated (``--no-compile``), and which a TOML file may give as a boolean."""
    metadata: dict[str, Any] = {"help": help}
    if flag:
        metadata["flag"] = flag
    if range is not None:
        metadata["range"] = range
        if range.auto:
            metadata["auto"] = True
    if legacy_zero:
        metadata["legacy_zero"] = True
    if switch:
        metadata["switch"] = True
    if choices is not None:
        metadata["choices"] = choices
    return field(default=default, metadata=metadata)
