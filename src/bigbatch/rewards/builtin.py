"""The built-in rewards, ``--reward builtin:NAME``: two verifiable checks of the demo task's completions
(:mod:`bigbatch.rewards.demo_task`, two-number addition ``"23+58="`` -> ``"81\\n"``).

A completion of the task is the answer in decimal digits followed by :data:`END`, a newline: the byte vocabulary
has no end-of-text token, so the task spells the end of an answer out, and a sampler stops after generating it.
The completion text a reward receives is what the model generated after the prompt, :data:`END` included where
the model produced it (a sampler that stops at it keeps it; one that does not leaves more text after it).

* ``exact-answer``: 1.0 when the completion's answer equals the row's ``answer`` field, both stripped of
  whitespace, else 0.0. The completion's answer is its text *before the first* :data:`END` (all of it when it
  has none: a completion cut off by the token limit can still hold the answer). Not the text after the last
  ``"="``: the ``"="`` belongs to the prompt and the completion starts right after it, so a completion that
  writes an ``"="`` of its own restates the problem instead of answering it, and earns nothing. Text after the
  first :data:`END` is not read: the answer ended there.
* ``format``: 1.0 when the completion is exactly an answer in the task's format, a non-negative integer written
  as ``str(int)`` writes it (``0`` or digits not starting with ``0``) and then :data:`END` with nothing after it,
  else 0.0. Spaces, signs, leading zeros, a missing :data:`END` or text after it all fail.

Both are strict on purpose: GRPO moves the policy towards whatever scores more, so a lenient check is a reward
for the leniency.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

END = "\n"
"""What ends a completion of the demo task (the byte vocabulary has no end-of-text token)."""

_ANSWER_FORMAT = re.compile(r"(?:0|[1-9][0-9]*)\n")  # ASCII digits only: \d would accept other scripts' digits

RewardFunction = Callable[[Mapping[str, Any], str], object]
"""``fn(row, completion) -> number``: the prompt row as read from the prompts file, and the completion's text."""


def completion_answer(completion: str) -> str:
    """The answer a completion gives: its text before the first :data:`END` (all of it without one), stripped."""
    return completion.split(END, 1)[0].strip()


def row_answer(row: Mapping[str, Any]) -> str:
    """The row's expected answer (its ``answer`` field, text or an integer), stripped; a ValueError naming what is
    wrong for a row without a usable one (the caller names the row)."""
    if "answer" not in row:
        fields = ", ".join(str(name) for name in row) or "none"
        raise ValueError(f"the row has no 'answer' field (fields: {fields}); give each prompt row its answer")
    answer = row["answer"]
    if isinstance(answer, int) and not isinstance(answer, bool):  # {"answer": 81} as JSON writes a number
        answer = str(answer)
    if not isinstance(answer, str):
        raise ValueError(f"the row's 'answer' is a {type(answer).__name__}, not text; give it as a string")
    if not answer.strip():
        raise ValueError("the row's 'answer' is empty; give each prompt row its answer")
    return answer.strip()


def exact_answer(row: Mapping[str, Any], completion: str) -> float:
    """1.0 when the completion's answer (:func:`completion_answer`) is the row's ``answer``, else 0.0."""
    return 1.0 if completion_answer(completion) == row_answer(row) else 0.0


def answer_format(row: Mapping[str, Any], completion: str) -> float:
    """1.0 when the completion is exactly digits (as ``str(int)`` writes them) then :data:`END`, else 0.0."""
    del row  # the format is the same for every row
    return 1.0 if _ANSWER_FORMAT.fullmatch(completion) else 0.0


BUILTINS: Mapping[str, RewardFunction] = MappingProxyType({"exact-answer": exact_answer, "format": answer_format})
"""The rewards ``--reward builtin:NAME`` names, read-only."""
