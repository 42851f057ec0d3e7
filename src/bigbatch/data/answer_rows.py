"""The row shapes of preference and KTO data, read into one checked :class:`AnswerRow` (or a bad row saying why).

Accepted shapes (the ones TRL's trainers read):

* **pairs as text**: ``{"prompt": str, "chosen": str, "rejected": str}``; without ``prompt`` (Anthropic HH's
  layout) the prompt is the longest common beginning of ``chosen`` and ``rejected``, moved back by one character
  when that character is a space (TRL's ``extract_prompt``: the space belongs to the answer's first word);
* **pairs as conversations**: ``{"prompt": [messages], "chosen": [one assistant message], "rejected": [...]}``;
  without ``prompt`` the prompt is the leading messages ``chosen`` and ``rejected`` share, and what follows in each
  must be one assistant message. An answer may also be one message object, or a string (an assistant message);
* **KTO rows**: ``{"prompt", "completion", "label": true|false}``, as text or as conversations like pairs (a
  ``prompt`` is needed: there is nothing to share it with).

A row is conversational when any of its fields is a list or an object; then its messages are checked as chat rows
are (:func:`~bigbatch.data.chat.conversation_from_record`: roles, string or text-part content), and ``tools`` are
read beside them. A field that is ``null`` is missing (a column of an ``hf:`` dataset the row does not fill).

Nothing here tokenizes or renders: :mod:`bigbatch.data.answer_encode` does, with what this module returns. A bad
row is not an error here: :attr:`AnswerRow.bad` says what is wrong, and the settings decide (refuse or drop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bigbatch.data.answers import KTO, PAIRS, ROLE_CHOSEN, ROLE_DESIRABLE, ROLE_REJECTED, ROLE_UNDESIRABLE, answer_kind
from bigbatch.data.chat import conversation_from_record
from bigbatch.data.chat_rows import row_tools
from bigbatch.errors import DataError

Messages = tuple[dict[str, Any], ...]
Answer = str | dict[str, Any]
"""A text answer, or one assistant message."""

MISSING, IDENTICAL, EMPTY, MALFORMED = "missing field", "identical answers", "empty", "malformed"
"""The kinds of bad row, as the audit counts them."""


@dataclass(frozen=True)
class BadRow:
    """Why a row cannot be trained: its kind (:data:`MISSING` ...) and one line naming the row."""

    kind: str
    message: str


@dataclass(frozen=True)
class AnswerRow:
    """One row of answers, checked. ``prompt`` is text or messages; ``answers`` are ``(chosen, rejected)`` for a
    pair, ``(completion,)`` for a KTO row, each text or one assistant message. ``bad``: why the row is not usable
    (then the other fields are whatever could be read)."""

    name: str  # FILE:LINE or SOURCE#NUMBER
    kind: str  # pairs or kto
    conversational: bool
    prompt: str | Messages = ""
    answers: tuple[Answer, ...] = ()
    label: bool | None = None  # KTO: a desirable completion
    tools: Messages | None = None
    bad: BadRow | None = None

    @property
    def roles(self) -> tuple[int, ...]:
        """The role of each of the row's documents (a KTO row's KL document is made when the split is written)."""
        if self.kind == PAIRS:
            return (ROLE_CHOSEN, ROLE_REJECTED)
        return (ROLE_DESIRABLE if self.label else ROLE_UNDESIRABLE,)

    def texts(self) -> list[str]:
        """The row's text (prompt and answers), for training a ``bpe:VOCAB`` tokenizer; none for a conversation
        (conversations need the model's own tokenizer)."""
        if self.conversational or self.bad is not None:
            return []
        return [str(self.prompt), *(str(answer) for answer in self.answers)]

    def size(self) -> int:
        """Characters of text (for progress and throughput)."""
        parts: list[Any] = [self.prompt, *self.answers]
        total = 0
        for part in parts:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict):
                total += len(str(part.get("content") or ""))
            else:
                total += sum(len(str(m.get("content") or "")) for m in part)
        return total


def answer_row(record: dict[str, Any], where: str) -> AnswerRow:
    """The row ``record`` (of :func:`~bigbatch.data.answers.answer_kind` pairs or kto) read, or with ``bad`` set."""
    kind = answer_kind(record)
    fields = ("chosen", "rejected") if kind == PAIRS else ("completion",)
    conversational = any(isinstance(record.get(f), (list, dict)) for f in ("prompt", *fields))
    try:
        if kind == PAIRS:
            return _pair(record, where, conversational)
        if kind == KTO:
            return _kto(record, where, conversational)
    except _Bad as bad:
        return AnswerRow(where, kind, conversational, bad=BadRow(bad.kind, f"{where}: {bad}"))
    raise ValueError(f"{where} is not a row of answers")  # the caller checked answer_kind


class _Bad(Exception):
    """A bad row found while reading it (caught in :func:`answer_row`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _present(record: dict[str, Any], field: str) -> Any:
    value = record.get(field)
    if value is None:
        held = ", ".join(str(name) for name in record if record[name] is not None) or "none"
        raise _Bad(MISSING, f"missing field {field!r} (fields: {held})")
    return value


def _pair(record: dict[str, Any], where: str, conversational: bool) -> AnswerRow:
    chosen, rejected = _present(record, "chosen"), _present(record, "rejected")
    if chosen == rejected:
        raise _Bad(IDENTICAL, "'chosen' and 'rejected' are identical: the pair prefers nothing")
    prompt = record.get("prompt")
    if not conversational:
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            raise _Bad(MALFORMED, "'chosen' and 'rejected' must both be text, or both conversations")
        if prompt is None:
            prompt, chosen, rejected = implicit_text_prompt(chosen, rejected)
            if not prompt:
                raise _Bad(EMPTY, "'chosen' and 'rejected' share no beginning to be the prompt; give 'prompt'")
        elif not isinstance(prompt, str):
            raise _Bad(MALFORMED, f"'prompt' must be text like the answers, not {type(prompt).__name__}")
        texts = (_text_answer(chosen, "chosen"), _text_answer(rejected, "rejected"))
        if not prompt:
            raise _Bad(EMPTY, "the prompt is empty: the answer's first token would have nothing to follow")
        return AnswerRow(where, PAIRS, False, prompt, texts)
    tools = _tools(record, where)
    if isinstance(prompt, str) and _repeats_the_prompt(chosen) and _repeats_the_prompt(rejected):
        # UltraFeedback-binarized's layout: the prompt as text beside answers that are whole conversations, their
        # user turn included; the prompt is their shared beginning, as TRL reads it
        prompt = None
    if prompt is None:
        shared, chosen, rejected = implicit_messages_prompt(
            _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
        )
        if not shared:
            raise _Bad(EMPTY, "'chosen' and 'rejected' share no leading message to be the prompt; give 'prompt'")
        messages = shared
    else:
        messages = _prompt_messages(prompt, where)
    answers = (_message_answer(chosen, where, "chosen"), _message_answer(rejected, where, "rejected"))
    if answers[0] == answers[1]:
        raise _Bad(IDENTICAL, "'chosen' and 'rejected' are identical: the pair prefers nothing")
    return AnswerRow(where, PAIRS, True, messages, answers, tools=tools)


def _repeats_the_prompt(answer: Any) -> bool:
    """Whether an answer is a whole conversation: a list of messages holding a user turn."""
    return isinstance(answer, list) and any(isinstance(m, dict) and m.get("role") == "user" for m in answer)


def _kto(record: dict[str, Any], where: str, conversational: bool) -> AnswerRow:
    prompt, completion, label = _present(record, "prompt"), _present(record, "completion"), _present(record, "label")
    if isinstance(label, bool) or (isinstance(label, int) and label in (0, 1)):
        desirable = bool(label)
    else:
        raise _Bad(MALFORMED, f"'label' must be true or false, got {label!r}")
    if not conversational:
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise _Bad(MALFORMED, "'prompt' and 'completion' must both be text, or both conversations")
        if not prompt:
            raise _Bad(EMPTY, "the prompt is empty: the completion's first token would have nothing to follow")
        return AnswerRow(where, KTO, False, prompt, (_text_answer(completion, "completion"),), desirable)
    tools = _tools(record, where)
    messages = _prompt_messages(prompt, where)
    answer = _message_answer(completion, where, "completion")
    return AnswerRow(where, KTO, True, messages, (answer,), desirable, tools)


def implicit_text_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """``(prompt, chosen, rejected)`` of two texts that begin alike: the prompt is their longest common beginning,
    less its last character when that is a space (it goes with the answer's first word, as tokenizers that attach
    a space to the word after it read it)."""
    shared = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        shared += 1
    if 0 < shared and chosen[shared - 1] == " ":
        shared -= 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def implicit_messages_prompt(chosen: Messages, rejected: Messages) -> tuple[Messages, Messages, Messages]:
    """``(prompt, chosen, rejected)`` of two conversations: the prompt is the leading messages both share."""
    shared = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _text_answer(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _Bad(MALFORMED, f"{field!r} must be text, not {type(value).__name__}")
    if not value.strip():
        raise _Bad(EMPTY, f"the {field} answer is empty")
    return value


def _messages(value: Any, where: str, field: str) -> Messages:
    """``value`` (a list of messages, or one message object) checked as a chat row's messages are."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, tuple):  # what is left of a conversation once its shared prompt is taken
        value = list(value)
    if not isinstance(value, list):
        raise _Bad(MALFORMED, f"{field!r} must be a list of {{'role', 'content'}} messages, not {type(value).__name__}")
    if not value:
        raise _Bad(EMPTY, f"{field!r} holds no message")
    try:
        return conversation_from_record({"messages": value}, f"{where} {field!r}").messages
    except DataError as exc:  # a role, a content or a part the template cannot be given
        raise _Bad(MALFORMED, str(exc).removeprefix(f"{where} ")) from None  # "'chosen': message 1 ..."


def _prompt_messages(value: Any, where: str) -> Messages:
    if isinstance(value, str):
        raise _Bad(MALFORMED, "'prompt' is text but the answers are messages: give the prompt as a list of messages")
    return _messages(value, where, "prompt")


def _message_answer(value: Any, where: str, field: str) -> dict[str, Any]:
    """A conversational answer: one assistant message (a string is one)."""
    if isinstance(value, str):
        value = [{"role": "assistant", "content": value}]
    messages = _messages(value, where, field)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        roles = ", ".join(str(m["role"]) for m in messages)
        raise _Bad(MALFORMED, f"{field!r} must be one assistant message after the prompt, not {roles}")
    message = messages[0]
    if not str(message.get("content") or "").strip() and not message.get("tool_calls"):
        raise _Bad(EMPTY, f"the {field} answer is empty")
    return message


def _tools(record: dict[str, Any], where: str) -> Messages | None:
    tools = row_tools(record)
    if tools is None:
        return None
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise _Bad(MALFORMED, "'tools' must be a list of objects (function schemas)")
    return tuple(tools) or None
