"""Where a run's config comes from: the field defaults < a TOML file (``--config``) < command-line flags (one
per field, its help the field's); and a checkpoint's stored mapping, read back as it was saved."""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from bigbatch.errors import BigBatchError, ConfigError
from bigbatch.run.configuration.train_config import SECTIONS, TrainConfig, field_of, flag_of, kind_of
from bigbatch.settings.ranges import AUTO, Range

COMMAND_LINE = "command line"  # the origin of the values given as flags


def check_type(where: str, value: Any, expected: type, words: tuple[str, ...] = ()) -> Any:
    """``value`` as ``expected`` (an int is a float too), or :class:`ConfigError` naming the type and the
    ``words`` (such as ``"auto"``) that the field accepts as well."""
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        accepted = " or ".join([expected.__name__, *(f'"{word}"' for word in words)])
        raise ConfigError(f"{where} must be {accepted}, got {type(value).__name__} {value!r}")
    return value


def apply_mapping(config: TrainConfig, mapping: dict[str, Any], origin: str, check_ranges: bool = True) -> None:
    """Apply ``{section: {key: value}}`` onto ``config``, refusing unknown keys, wrong types and, unless
    ``check_ranges`` is off (a checkpoint's own stored config, where 0 means auto), values out of range."""
    for section, values in mapping.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section [{section}]; known sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: [{section}] must be a table of key = value")
        section_cls = SECTIONS[section]
        known = [f.name for f in fields(section_cls)]
        target = getattr(config, section)
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{origin}: unknown key {key!r} in [{section}]; known keys: {', '.join(known)}")
            f = field_of(section_cls, key)
            meta = f.metadata
            legacy_auto = meta.get("legacy_zero") and is_zero(value)  # an older file's 0 for auto
            if meta.get("auto") and (value == "auto" or legacy_auto):
                value = kind_of(f)(0)  # stored as 0, resolved where it is used
            elif isinstance(value, bool) and meta.get("switch"):
                value = "on" if value else "off"
            else:
                name = f"{origin}: {section}.{key}"
                allowed = meta.get("choices")
                if allowed is not None and not isinstance(value, str):  # a word field given a number or a list
                    words = " or ".join(f'"{word}"' for word in allowed) + (
                        " (or true/false)" if meta.get("switch") else ""
                    )
                    raise ConfigError(f"{name} must be {words}, got {type(value).__name__} {value!r}")
                value = check_type(name, value, kind_of(f), accepted_words(f))
                if check_ranges and allowed is not None:  # here, so that the error names the file and its key
                    allowed.check(value, name)
                declared: Range | None = meta.get("range")
                if check_ranges and declared is not None:
                    # a file's value is named by its key alone: the flag would send the user to the wrong place
                    declared.check(f"{name} (--{flag_of(f)})" if origin == COMMAND_LINE else name, value)
            setattr(target, key, value)


def accepted_words(f: Field[Any]) -> tuple[str, ...]:
    """The words a numeric field takes besides its numbers (``auto``), for its type error."""
    return (AUTO,) if f.metadata.get("auto") else ()


def is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def load_toml(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per config field, help taken from the field; defaults stay unset so a TOML file can fill them."""
    for section, section_cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]")
        for f in fields(section_cls):
            kind = kind_of(f)
            auto = f.metadata.get("auto", False)
            default = f.default if f.default is not MISSING else None
            if auto and is_zero(default):
                default = "auto"
            help_text = f"{f.metadata['help']} (default: {default!r})"
            dest = f"{section}.{f.name}"
            if f.metadata.get("switch"):  # --compile [auto|on|off], --no-compile
                group.add_argument(
                    f"--{flag_of(f)}",
                    dest=dest,
                    nargs="?",
                    const="on",
                    choices=f.metadata["choices"],
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
                group.add_argument(
                    f"--no-{flag_of(f)}",
                    dest=dest,
                    action="store_const",
                    const="off",
                    default=argparse.SUPPRESS,
                    help=f"same as --{flag_of(f)} off",
                )
            elif kind is bool:
                group.add_argument(
                    f"--{flag_of(f)}",
                    dest=dest,
                    action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            else:
                declared: Range | None = f.metadata.get("range")
                group.add_argument(
                    f"--{flag_of(f)}",
                    dest=dest,
                    type=declared.argtype() if declared else kind,
                    default=argparse.SUPPRESS,
                    metavar=f"{kind.__name__.upper()}|auto" if auto else kind.__name__.upper(),
                    help=help_text,
                )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then ``args.config`` (a TOML file) if given, then the flags that were set."""
    config = TrainConfig()
    if getattr(args, "config", None):
        apply_mapping(config, load_toml(args.config), origin=str(args.config))
    overrides: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            overrides.setdefault(section, {})[key] = value
    apply_mapping(config, overrides, origin=COMMAND_LINE)
    config.validate()
    return config


@dataclass(frozen=True)
class FileSettings:
    """The settings a ``--config`` file gave and no flag overrode. An error raised while they are in force names
    each of them as the file's key rather than as its flag, which the user never typed (``drop --tokenizer`` for a
    file's ``[data] tokenizer``), and says which file holds them."""

    path: str = ""
    keys: dict[str, str] = field(default_factory=dict)  # flag -> key: "--tokenizer" -> "data.tokenizer"

    def name_in(self, message: str) -> str:
        """``message`` with the flags of the file's settings replaced by their keys, and the file named once."""
        named = []
        for flag, key in self.keys.items():
            # the whole flag only: --seq-len is not the start of --seq-len-x, nor the end of --no-seq-len
            message, count = re.subn(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", key, message)
            if count:
                named.append(key)
        if not named:
            return message
        keys = named[0] if len(named) == 1 else ", ".join(named[:-1]) + f" and {named[-1]}"
        return f"{message} ({keys} {'is' if len(named) == 1 else 'are'} set in {self.path})"

    @contextmanager
    def naming_errors(self) -> Iterator[None]:
        """Re-raise a :class:`BigBatchError` from the block with the file's settings named (:meth:`name_in`): the
        same exception, so its type and exit code stay."""
        try:
            yield
        except BigBatchError as exc:
            message = self.name_in(str(exc))
            if message != str(exc):
                exc.args = (message,)
            raise


def file_settings(args: argparse.Namespace) -> FileSettings:
    """What ``args.config`` sets that no flag in ``args`` overrides (nothing without ``--config``); a file that
    does not load is left to :func:`config_from_args` to report."""
    path = getattr(args, "config", None)
    if not path:
        return FileSettings()
    try:
        mapping = load_toml(path)
    except ConfigError:
        return FileSettings()
    keys = {}
    for section, values in mapping.items():
        if section not in SECTIONS or not isinstance(values, dict):
            continue
        known = {f.name: f for f in fields(SECTIONS[section])}
        for key in values:
            if key in known and not hasattr(args, f"{section}.{key}"):  # a flag given overrides the file
                keys[f"--{flag_of(known[key])}"] = f"{section}.{key}"
    return FileSettings(str(path), keys)


def config_from_dict(mapping: dict[str, Any]) -> TrainConfig:
    config = TrainConfig()
    apply_mapping(config, mapping, origin="checkpoint config", check_ranges=False)
    return config
