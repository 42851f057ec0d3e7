"""The shapes a row of chat data comes in, brought to the one a chat template reads: ``messages`` of ``{"role",
"content"}`` objects whose content is a string.

Accepted beside that shape:

* **ShareGPT** rows, ``{"conversations": [{"from": "human", "value": ...}, ...]}`` (the layout of ShareGPT dumps,
  LLaMA-Factory's ``sharegpt`` format and many Hub datasets): each ``from`` becomes a role (:data:`SHAREGPT_ROLES`),
  ``function_call`` an assistant turn that calls a tool, and a top-level ``system`` string a first system message.
  ``conversations`` holding ``{"role", "content"}`` objects are read as ``messages``.
* **Content as a list of parts**, ``[{"type": "text", "text": ...}, ...]`` (OpenAI's and the multimodal datasets'
  format): the texts of the parts are joined with nothing between them, as OpenAI joins them, so the template
  receives a string. A part that is not text (an image, audio, a file) is refused in one line naming the row,
  the message and the part's type: only text is trained on here. Parts are not passed through to templates that
  render parts themselves (Gemma 3's, Llama 4's): every template here receives strings, which all of them render.

Nothing here checks roles or renders anything: :func:`bigbatch.data.chat.conversation_from_record` does that with
what :func:`row_messages` and :func:`content_text` return.
"""

from __future__ import annotations

import json
from typing import Any

from bigbatch.errors import DataError

MESSAGES = "messages"
SHAREGPT = "conversations"
CONVERSATION_COLUMNS = (MESSAGES, SHAREGPT)
"""The fields (and dataset columns) that hold a conversation, in the order they are looked for."""

SHAREGPT_ROLES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",  # LLaMA-Factory: a tool's result
    "function_response": "tool",
}
"""ShareGPT's ``from`` values and the roles they become."""
TOOL_CALL_FROM = "function_call"
"""LLaMA-Factory's ``from`` for a tool call; its ``value`` is the call as JSON (``{"name", "arguments"}``, or a list
of them); it becomes an assistant message with ``tool_calls``."""

TEXT_PART_TYPES = ("text", "input_text", "output_text")
"""Part types whose ``text`` is text: OpenAI chat's ``text``, and its Responses API's two."""


def is_conversation_row(record: object) -> bool:
    """Whether a row is a conversation: it holds ``messages``, or a ShareGPT ``conversations`` list and no
    ``text`` or ``prompt`` (a text or prompt/completion row that happens to carry a field of that name stays what
    it was read as before ShareGPT rows were)."""
    if not isinstance(record, dict):
        return False
    if MESSAGES in record:
        return True
    return isinstance(record.get(SHAREGPT), list) and "text" not in record and "prompt" not in record


def conversation_field(record: dict[str, Any]) -> str:
    """The field of ``record`` that holds its conversation (``messages`` when it has both)."""
    return MESSAGES if MESSAGES in record or SHAREGPT not in record else SHAREGPT


def row_messages(record: dict[str, Any], where: str) -> Any:
    """The row's messages in the ``{"role", "content"}`` shape (ShareGPT objects mapped; a top-level ``system``
    string of a ShareGPT row prepended); anything else (not a list, an object of another shape) is returned as it
    is, for the caller to refuse naming the message."""
    key = conversation_field(record)
    messages = record.get(key)
    if key == MESSAGES or not isinstance(messages, list):
        return messages
    mapped = [_from_sharegpt(message, where, number) for number, message in enumerate(messages, start=1)]
    system = record.get("system")
    if isinstance(system, str) and system and not (mapped and _role(mapped[0]) == "system"):
        mapped.insert(0, {"role": "system", "content": system})  # LLaMA-Factory keeps it in a column of its own
    return mapped


def _role(message: object) -> object:
    return message.get("role") if isinstance(message, dict) else None


def _from_sharegpt(message: object, where: str, number: int) -> object:
    """One ShareGPT message as ``{"role", "content"}``; one already in that shape (or not an object) as it is."""
    if not isinstance(message, dict) or "role" in message or "from" not in message:
        return message
    speaker = message["from"]
    value = message.get("value")
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}  # e.g. a tool message's "name"
    if speaker == TOOL_CALL_FROM:
        return {**rest, "role": "assistant", "content": "", "tool_calls": _tool_calls(value, where, number)}
    role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
    if role is None:
        mapping = ", ".join(f"{name}->{role}" for name, role in SHAREGPT_ROLES.items())
        raise DataError(
            f"{where}: message {number} is from {speaker!r}, which no role is known for (ShareGPT's from values map "
            f"as {mapping}, {TOOL_CALL_FROM}->assistant tool call); rename it in the data"
        )
    return {**rest, "role": role, "content": value}


def _tool_calls(value: object, where: str, number: int) -> list[dict[str, Any]]:
    """A ``function_call`` message's value (JSON text, or already an object or a list of them) as the
    ``tool_calls`` of an assistant message."""
    calls: object = value
    if isinstance(value, str):
        try:
            calls = json.loads(value)
        except ValueError:
            calls = None
    if isinstance(calls, dict):
        calls = [calls]
    if not (isinstance(calls, list) and calls and all(isinstance(c, dict) and "name" in c for c in calls)):
        raise DataError(
            f"{where}: message {number} ({TOOL_CALL_FROM}) is not a tool call: its value must be JSON of "
            '{"name": ..., "arguments": {...}} (or a list of them)'
        )
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def content_text(content: list[Any], where: str, number: int, role: object) -> str:
    """A message's content given as a list of parts, as one string: the texts of its text parts joined with
    nothing between them (as OpenAI joins them); a part that is not text is refused in one line."""
    texts = []
    for index, part in enumerate(content, start=1):
        if not isinstance(part, dict):
            raise DataError(
                f"{where}: message {number} ({role}) has no string 'content' (part {index} is a "
                f"{type(part).__name__}, not a {{'type': 'text', 'text': ...}} object); give its text as a string "
                "or as text parts"
            )
        kind = part.get("type", "text" if "text" in part else None)
        text = part.get("text")
        if kind in TEXT_PART_TYPES and isinstance(text, str):
            texts.append(text)
            continue
        what = f"a part of type {kind!r}" if kind not in TEXT_PART_TYPES else "a text part without a string 'text'"
        raise DataError(
            f"{where}: message {number} ({role}) holds {what} (part {index}); only text parts are read here: leave "
            "the part or the row out of the data"
        )
    return "".join(texts)


def row_tools(record: dict[str, Any]) -> Any:
    """The row's ``tools``; JSON text of them (how datasets such as LLaMA-Factory's keep schemas of varying shape
    in one column) is read as JSON, and anything else returned as it is for the caller to check."""
    tools = record.get("tools")
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            return json.loads(tools)
        except ValueError:
            return tools
    return tools
