"""Reward functions for GRPO: named by ``--reward`` values, loaded once, and called on every completion.

A ``--reward`` value is ``MODULE:FUNCTION``, ``MODULE:FUNCTION=WEIGHT``, ``builtin:NAME`` or
``builtin:NAME=WEIGHT`` (the builtins: :data:`bigbatch.rewards.builtin.BUILTINS`). ``MODULE`` is a dotted module
name importable by this Python, or the path of a ``.py`` file (relative to the current directory; anything ending
in ``.py`` or holding a ``/`` is a path). ``WEIGHT`` (default 1) is any finite number: a negative one penalizes,
and 0 keeps a reward in the logs without training on it.

A reward function is called as ``fn(row, completion)``: ``row`` is the prompt row's dict as read from the prompts
file (``{"prompt": ..., "answer": ...}``), ``completion`` the completion's text; it returns a number (bool, int,
float, a numpy scalar or a 0-d array or tensor). :meth:`RewardSet.score` adds the weighted values up. A function
that raises, or returns anything but a finite number, stops the run with a :class:`RewardError` naming the
function, the prompt row and the completion: a reward that cannot be computed is a bug to fix, and scoring it 0
would train the policy on the bug.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from bigbatch.errors import BigBatchError, ConfigError, did_you_mean
from bigbatch.rewards.builtin import BUILTINS, RewardFunction

FLAG = "--reward"
BUILTIN = "builtin"
"""The ``MODULE`` that names a built-in reward (so no module of that name can be given)."""

_BUILTIN_LIST = ", ".join(f"{BUILTIN}:{name}" for name in BUILTINS)
USAGE = (
    f"give MODULE:FUNCTION[=WEIGHT] (MODULE a dotted module name or the path of a .py file) or "
    f"{BUILTIN}:NAME[=WEIGHT] (builtins: {_BUILTIN_LIST})"
)
"""What a ``--reward`` value may be, for the messages that refuse one."""

_DETAIL_CHARS = 200  # of an exception's message in a one-line error
_VALUE_CHARS = 80  # of a bad return value's repr


class RewardError(BigBatchError):
    """A reward function failed on a completion: it raised, or returned something that is not a finite number."""


@dataclass(frozen=True)
class RewardSpec:
    """One ``--reward``: ``name`` is a builtin's NAME (``exact-answer``) or ``MODULE:FUNCTION``, which is also
    the key of its value in :meth:`RewardSet.score` (a builtin's name holds no ``:``, a function's always does,
    so the name alone says which it is); ``weight`` multiplies its value in the sum."""

    name: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        problem = _name_problem(self.name) or _weight_problem(self.weight)
        if problem:
            raise ConfigError(f"{FLAG} {self.flag_value()}: {problem}")

    @classmethod
    def parse(cls, value: str) -> RewardSpec:
        """The reward a ``--reward`` value names; a :class:`ConfigError` naming the value and what to give for one
        that is not of the forms above. The function is not loaded here: :class:`RewardSet` loads it."""
        text = value.strip()
        # the last ':' ends MODULE (a path may hold one: a Windows drive), the first '=' after it starts WEIGHT
        module, colon, rest = text.rpartition(":")
        function, has_weight, weight_text = rest.partition("=")
        if not colon:
            # a bare builtin name is the likeliest slip: suggest its full form
            bare = function.strip()
            hint = f"; did you mean {BUILTIN}:{bare}?" if bare in BUILTINS else _builtin_suggestion(bare)
            raise ConfigError(f"{FLAG} {value} names no function (no ':'): {USAGE}{hint}")
        if not module or not function:
            missing = "MODULE" if not module else "FUNCTION"
            raise ConfigError(f"{FLAG} {value} has an empty {missing}: {USAGE}")
        weight = 1.0
        if has_weight:
            try:
                weight = float(weight_text)
            except ValueError:
                weight = math.nan  # refused just below, with the same message as an "inf"
            if not math.isfinite(weight):
                raise ConfigError(
                    f"{FLAG} {value}: the weight {weight_text!r} is not a finite number; give =WEIGHT as a number "
                    "such as 0.5 (negative to penalize), or leave it out for 1"
                )
        name = function if module == BUILTIN else f"{module}:{function}"
        problem = _name_problem(name)
        if problem:
            raise ConfigError(f"{FLAG} {value}: {problem}")
        return cls(name, weight)

    @property
    def is_builtin(self) -> bool:
        return ":" not in self.name

    def flag_value(self) -> str:
        """The ``--reward`` value that gives this reward (for messages)."""
        reference = f"{BUILTIN}:{self.name}" if self.is_builtin else self.name
        if self.weight == 1:
            return reference
        number = isinstance(self.weight, int | float)  # a spec made directly may hold anything: say it as it is
        return f"{reference}={self.weight:g}" if number else f"{reference}={self.weight!r}"


def parse_rewards(values: str | Iterable[str]) -> list[RewardSpec]:
    """The rewards of ``--reward`` values, in order: a list of values, or one text of them separated by commas
    (the config file's and the flag's form, ``builtin:exact-answer,builtin:format=0.2``); blank items are
    skipped, so ``""`` is no reward (which :class:`RewardSet` refuses, saying what to give)."""
    items = values.split(",") if isinstance(values, str) else list(values)
    return [RewardSpec.parse(item) for item in items if item.strip()]


def _name_problem(name: str) -> str:
    """What is wrong with a spec's name, or ``""``."""
    if ":" not in name:
        if name in BUILTINS:
            return ""
        return (
            f"there is no builtin reward {name!r}; give one of {_BUILTIN_LIST}, or MODULE:FUNCTION for your own"
            + _builtin_suggestion(name)
        )
    module, _, function = name.rpartition(":")
    if module == BUILTIN:
        return f"a RewardSpec names a builtin by its NAME alone ({function!r}), not as {name!r}"
    if not function.isidentifier():
        return f"{function!r} is not the name of a Python function: {USAGE}"
    if not _is_path(module) and not all(part.isidentifier() for part in module.split(".")):
        return f"{module!r} is neither a dotted module name nor the path of a .py file: {USAGE}"
    return ""


def _builtin_suggestion(word: str) -> str:
    """``; did you mean builtin:format?`` for the builtin nearest ``word``, or ``""``."""
    nearest = did_you_mean(word, BUILTINS)
    return nearest.replace("did you mean ", f"did you mean {BUILTIN}:") if nearest else ""


def _weight_problem(weight: float) -> str:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        return f"the weight {weight!r} is not a finite number; give =WEIGHT as a number such as 0.5"
    return ""


def _is_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or "\\" in module


@dataclass(frozen=True)
class _Reward:
    spec: RewardSpec
    function: RewardFunction


class RewardSet:
    """The rewards of a run, loaded: each function imported and checked once, up front, so that a typo fails
    before the first step rather than in it. Names must be unique (the values are keyed by them)."""

    def __init__(self, specs: Sequence[RewardSpec]) -> None:
        if not specs:
            raise ConfigError(f"no {FLAG} given; {USAGE}")
        seen: set[str] = set()
        for spec in specs:
            if spec.name in seen:
                raise ConfigError(
                    f"{FLAG} {spec.flag_value()}: {spec.name} is given twice; give each reward once (with its "
                    "weight as =WEIGHT)"
                )
            seen.add(spec.name)
        modules: dict[str, ModuleType] = {}  # a module named by two specs is imported (run) once
        self._rewards = tuple(_Reward(spec, _load(spec, modules)) for spec in specs)

    @classmethod
    def from_flags(cls, values: str | Iterable[str]) -> RewardSet:
        """The rewards of ``--reward`` values, in the order given (see :func:`parse_rewards`)."""
        return cls(parse_rewards(values))

    @property
    def specs(self) -> tuple[RewardSpec, ...]:
        return tuple(reward.spec for reward in self._rewards)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(reward.spec.name for reward in self._rewards)

    def describe(self) -> str:
        """The sum in words, e.g. ``exact-answer x 1 + format x 0.2``."""
        return " + ".join(f"{reward.spec.name} x {reward.spec.weight:g}" for reward in self._rewards)

    def score(self, row: Mapping[str, Any], completion: str, where: str) -> tuple[float, dict[str, float]]:
        """The weighted sum of the rewards of ``completion`` (a completion of the prompt row ``row``), and each
        reward's value by name. ``where`` names the completion in messages, e.g. ``prompt row 12 of
        prompts.jsonl, completion 3``; a function that fails raises a :class:`RewardError` naming it there."""
        values: dict[str, float] = {}
        total = 0.0
        for reward in self._rewards:
            value = _call(reward, row, completion, where)
            values[reward.spec.name] = value
            total += reward.spec.weight * value
        if not math.isfinite(total):  # finite values can still overflow once weighted and added
            shown = ", ".join(f"{name}={value:g}" for name, value in values.items())
            raise RewardError(
                f"the rewards of {where} add up to {total} ({shown}; {self.describe()}); scale the functions or "
                "their weights down"
            )
        return total, values


# ---------------------------------------------------------------------------------------------- calling


def _call(reward: _Reward, row: Mapping[str, Any], completion: str, where: str) -> float:
    name = reward.spec.name
    try:
        result = reward.function(copy.deepcopy(dict(row)), completion)  # its own row: nothing leaks between calls
    except (Exception, SystemExit) as exc:  # anything a user's function raises (exit too) is its failure here
        raise RewardError(
            f"reward {name} failed on {where}: {_exception_line(exc)}; fix the reward function, or the row if it "
            "lacks what the function reads"
        ) from exc
    try:
        value = _number(result)
    except OverflowError:  # an int too large for a float
        value = math.inf
    if value is None:
        raise RewardError(
            f"reward {name} returned {_shown(result)} (a {type(result).__name__}) on {where}: a reward must be a "
            "number (bool, int, float, or a 0-d array or tensor); make the function return one for every "
            "completion (0.0 for one it scores as worthless)"
        )
    if not math.isfinite(value):
        raise RewardError(
            f"reward {name} returned {_shown(result)} on {where}: a reward must be a finite number; make the "
            "function return one for every completion"
        )
    return value


def _number(value: object) -> float | None:
    """``value`` as a float when it is one real number, else None. bool is a number (0 or 1); numpy's integer
    and floating scalars are :class:`numbers.Real`; numpy's bool, 0-d arrays and 0-d torch tensors are read by
    their ``item()`` (torch is not imported for this)."""
    if isinstance(value, numbers.Real):  # bool, int, float, Fraction, numpy integer and floating scalars
        return float(value)
    item = getattr(value, "item", None)
    if getattr(value, "ndim", None) == 0 and callable(item):
        inner = item()
        if isinstance(inner, numbers.Real):
            return float(inner)
    return None


def _one_line(text: str, limit: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _shown(value: object) -> str:
    return _one_line(repr(value), _VALUE_CHARS)


def _exception_line(exc: BaseException) -> str:
    """``ValueError: the message (at rewards.py:12)``: the type, the first line of the message, where it was
    raised (the innermost frame), for a one-line error."""
    lines = str(exc).strip().splitlines()
    text = type(exc).__name__ + (f": {_one_line(lines[0], _DETAIL_CHARS)}" if lines else "")
    # the innermost frame of the user's code: not importlib's (<frozen ...>) nor this module's, which only called
    # it (a SyntaxError has none, and names its file and line in its message)
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith("<") and Path(frame.filename) != Path(__file__)
    ]
    if frames:
        text += f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})"
    return text


# ---------------------------------------------------------------------------------------------- loading


def _load(spec: RewardSpec, modules: dict[str, ModuleType]) -> RewardFunction:
    """The function ``spec`` names, checked callable as ``fn(row, completion)``; ``modules``: those already
    imported for the same set."""
    if spec.is_builtin:
        return BUILTINS[spec.name]
    module_name, _, function_name = spec.name.rpartition(":")
    flag = f"{FLAG} {spec.flag_value()}"
    module = modules.get(module_name)
    if module is None:
        module = _import_file(module_name, flag) if _is_path(module_name) else _import_dotted(module_name, flag)
        modules[module_name] = module
    if not hasattr(module, function_name):
        defined = sorted(
            name
            for name, value in vars(module).items()
            if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        )
        listed = f" (it defines: {', '.join(defined)})" if defined else " (it defines no function)"
        raise ConfigError(
            f"{flag}: {module_name} has no {function_name!r}{did_you_mean(function_name, defined)}; give a function "
            f"it defines{listed}"
        )
    function = getattr(module, function_name)
    if not callable(function):
        raise ConfigError(
            f"{flag}: {spec.name} is a {type(function).__name__}, not a function; give a function "
            "fn(row, completion) that returns a number"
        )
    _check_signature(function, spec.name, flag)
    return function  # checked callable as fn(row, completion) just above


def _check_signature(function: Any, name: str, flag: str) -> None:
    """Refuse a function that cannot be called with two positional arguments (a slip caught before training)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins and C functions have none to read: called as they are
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ConfigError(
            f"{flag}: {name}{signature} cannot be called as fn(row, completion); give it two parameters, the "
            "prompt row (a dict) and the completion (text)"
        ) from None


def _import_dotted(module_name: str, flag: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):  # it, or a package above it
            local = Path(*module_name.split(".")).with_suffix(".py")
            hint = (
                f"; {local} is here: give its path, {FLAG} {local}:FUNCTION"
                if local.is_file()
                else "; give a module this Python can import (an installed package, or a folder on PYTHONPATH), "
                "or the path of a .py file"
            )
            raise ConfigError(f"{flag}: no module named {module_name!r} can be imported{hint}") from None
        raise _import_failed(flag, module_name, exc) from exc
    except Exception as exc:  # the module's own code failed (a SyntaxError, a missing dependency, its own raise)
        raise _import_failed(flag, module_name, exc) from exc


def _import_failed(flag: str, module_name: str, exc: Exception) -> ConfigError:
    return ConfigError(f"{flag}: importing {module_name} failed: {_exception_line(exc)}; fix the module")


def _import_file(module_path: str, flag: str) -> ModuleType:
    """The module of a ``.py`` file, run afresh. It is registered in ``sys.modules`` under a name of its own (a
    dataclass or pickle in it looks itself up there), and its folder is on ``sys.path`` while it runs, as
    ``python FILE`` would have it, so that it can import the modules beside it; then ``sys.path`` is as it was."""
    path = Path(module_path)
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        what = "no file" if not path.exists() else "not a file:"
        raise ConfigError(
            f"{flag}: there is {what} {path}{where}; give the path of a .py file that defines the function, or a "
            "dotted module name"
        )
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    name = f"bigbatch_reward_{re.sub(r'[^0-9A-Za-z_]', '_', resolved.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{flag}: {path} cannot be loaded as Python; give the path of a .py file")
    module = importlib.util.module_from_spec(spec)
    folder = str(resolved.parent)
    sys.modules[name] = module
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise _import_failed(flag, str(path), exc) from exc
    finally:
        if folder in sys.path:
            sys.path.remove(folder)  # the first occurrence: the one put there above, unless the module put more
    return module
