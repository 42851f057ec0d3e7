"""Chat conversations as training documents: rendered with the model's own chat template, tokenized once, and
masked so that only what the assistant says is trained on.

A conversation (``{"messages": [...], "tools": [...]}``) is rendered whole by transformers' own renderer with the
template of the tokenizer's directory (``tokenizer_config.json`` or ``chat_template.jinja``), offline. The
assistant's part of turn ``i`` is found by rendering, not by template markers: it starts where the conversation up
to that turn, rendered with the generation prompt, ends (what the model would be asked to continue at inference)
and ends where the conversation through that turn, rendered, ends (trailing white space left out, so the
end-of-turn token is the last character trained). Both renderings must be prefixes of the whole one; a template
that renders a prefix differently (e.g. one that strips earlier turns' reasoning) is refused in one line naming
the conversation and the turn. The character spans are then mapped onto the one tokenization of the whole text by
the tokens' character offsets; a token that straddles the start of a span (the prompt's last characters merged
with the reply's first) means the prompt the model sees at inference tokenizes differently, and is refused too.

``transformers`` is imported only when a template is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bigbatch.errors import ConfigError, DataError, install_hint
from bigbatch.progress import plural
from bigbatch.settings.choices import LOSS_ON, NO_ASSISTANT

ROLES = ("system", "developer", "user", "assistant", "tool")
if TYPE_CHECKING:
    import numpy as np

TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
TRAINED_OPEN, TRAINED_CLOSE = "\u27e6", "\u27e7"  # around trained tokens in --show: ⟦ ⟧


@dataclass(frozen=True)
class ChatSettings:
    """Which tokens of a conversation are trained on, and what becomes of a conversation with none."""

    loss_on: str = "assistant"  # assistant (every assistant turn), last-assistant, all (every token)
    no_assistant: str = "refuse"  # refuse (one line naming it) or drop (counted in the audit)

    def __post_init__(self) -> None:
        LOSS_ON.check(self.loss_on)
        NO_ASSISTANT.check(self.no_assistant)

    def key(self) -> str:
        return f"loss_on={self.loss_on},no_assistant={self.no_assistant}"


@dataclass(frozen=True)
class Conversation:
    """One row of chat data, checked: ``messages`` as the template receives them, ``tools`` when given."""

    name: str  # where it came from: FILE:LINE or SOURCE#NUMBER
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None

    def size(self) -> int:
        """Characters of content (for progress and throughput)."""
        return sum(len(str(m.get("content") or "")) for m in self.messages)


def is_conversation_record(record: object) -> bool:
    return isinstance(record, dict) and "messages" in record


def conversation_from_record(record: dict[str, Any], where: str) -> Conversation:
    """The conversation of a row holding ``messages`` (and optionally ``tools``); one line naming the row and the
    message for anything the template cannot be given."""
    messages = record.get("messages")
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
    if not messages:
        raise DataError(f"{where}: 'messages' is empty; give at least a user and an assistant message, or drop the row")
    checked = []
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise DataError(f"{where}: message {number} is not an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(
                f"{where}: message {number} has role {role!r}; use one of {', '.join(ROLES)} (rename it in the data)"
            )
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""  # a turn that only calls tools
        if not isinstance(content, str):
            raise DataError(
                f"{where}: message {number} ({role}) has no string 'content' (got {type(content).__name__}); "
                "give its text as a string"
            )
        checked.append({**message, "content": content})
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of objects (function schemas)")
    return Conversation(where, tuple(checked), tuple(tools) if tools else None)


def has_chat_template(directory: Path) -> bool:
    """Whether a tokenizer directory carries a chat template (``chat_template.jinja``, or ``chat_template`` in its
    ``tokenizer_config.json``)."""
    if (directory / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def template_fingerprint(directory: Path) -> str:
    """What of a tokenizer directory decides how conversations render: its template files' contents."""
    import hashlib

    digest = hashlib.sha256()
    for name in TEMPLATE_FILES:
        path = directory / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return digest.hexdigest()[:16]


class ChatTemplate:
    """The chat template of a tokenizer directory, rendered by transformers (``apply_chat_template``, offline)."""

    def __init__(self, directory: Path) -> None:
        if not has_chat_template(directory):
            raise ConfigError(
                f"{directory} has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json); "
                "conversations are rendered with the model's own template: give the tokenizer of a chat model "
                "(--tokenizer file:DIR), or write the rows as text or prompt/completion"
            )
        try:
            import transformers
        except ImportError as exc:
            raise ConfigError(f"chat data is rendered by transformers' chat templates: {install_hint('hf')}") from exc
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:  # transformers raises many types for a directory it cannot read
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise ConfigError(
                f"{directory}: transformers cannot load its tokenizer and chat template ({detail})"
            ) from exc
        self.directory = directory
        self.special_texts = tuple(sorted({str(t) for t in self._tokenizer.all_special_tokens} | self._added_special()))

    def _added_special(self) -> set[str]:
        decoder = getattr(self._tokenizer, "added_tokens_decoder", {}) or {}
        return {str(token.content) for token in decoder.values() if getattr(token, "special", False)}

    def render(self, conversation: Conversation, messages: int, generation_prompt: bool) -> str:
        """The first ``messages`` messages of ``conversation`` rendered as text."""
        try:
            text = self._tokenizer.apply_chat_template(
                list(conversation.messages[:messages]),
                tools=list(conversation.tools) if conversation.tools else None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja's raise_exception, a missing variable, a bad tool schema
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise DataError(f"{conversation.name}: the chat template refused the conversation ({detail})") from exc
        if not isinstance(text, str):
            raise DataError(f"{conversation.name}: the chat template rendered {type(text).__name__}, not text")
        return text


@dataclass(frozen=True)
class Span:
    """Characters ``[start, end)`` of the rendered text that message ``message`` (0-based) says as the assistant."""

    start: int
    end: int
    message: int


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _refuse_prefix(conversation: Conversation, message: int, prefix: str, whole: str, what: str) -> DataError:
    at = _first_difference(prefix, whole)
    return DataError(
        f"{conversation.name}: turn {message + 1} (assistant): the chat template renders {what} differently from the "
        f"whole conversation (at character {at}: {prefix[at : at + 24]!r} vs {whole[at : at + 24]!r}), so the "
        "assistant's tokens cannot be located; --loss-on last-assistant trains only the last turn, which needs no "
        "earlier prefix, or fix the template"
    )


def assistant_spans(conversation: Conversation, template: ChatTemplate, last_only: bool) -> tuple[str, list[Span]]:
    """The whole conversation rendered, and the character span of each assistant turn (only the last with
    ``last_only``), found by rendering prefixes (see the module's note)."""
    n = len(conversation.messages)
    whole = template.render(conversation, n, generation_prompt=False)
    turns = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
    if last_only:
        turns = turns[-1:]
    spans = []
    for i in turns:
        asked = template.render(conversation, i, generation_prompt=True) if i else ""
        if not whole.startswith(asked):
            raise _refuse_prefix(conversation, i, asked, whole, "the conversation up to this turn")
        said = template.render(conversation, i + 1, generation_prompt=False) if i + 1 < n else whole
        if not whole.startswith(said):
            raise _refuse_prefix(conversation, i, said, whole, "the conversation through this turn")
        end = len(said.rstrip())
        if end > len(asked):
            spans.append(Span(len(asked), end, i))
    return whole, spans


@dataclass
class ChatAudit:
    """What preparing conversations found: counts for ``prepare``'s report and ``meta.json``."""

    conversations: int = 0  # kept
    dropped: int = 0  # without any assistant token (--no-assistant drop)
    assistant_turns: int = 0  # trained turns
    turns_with_stop: int = 0  # trained turns whose last trained token is a special token (an end of turn)
    tokens: int = 0
    trained: int = 0  # target tokens trained on
    first_without_stop: str = ""  # a conversation whose turn ends in no special token, to name

    def to_dict(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "dropped": self.dropped,
            "assistant_turns": self.assistant_turns,
            "turns_with_stop": self.turns_with_stop,
            "tokens": self.tokens,
            "trained": self.trained,
            "first_without_stop": self.first_without_stop,
        }


def audit_lines(values: dict[str, Any], loss_on: str) -> list[str]:
    """The audit ``prepare`` prints, from ``meta.json``'s ``chat`` record."""
    tokens, trained = int(values.get("tokens", 0)), int(values.get("trained", 0))
    turns, stops = int(values.get("assistant_turns", 0)), int(values.get("turns_with_stop", 0))
    share = trained / tokens if tokens else 0.0
    lines = [
        f"chat: {plural(int(values.get('conversations', 0)), 'conversation')} ({int(values.get('dropped', 0)):,} "
        f"dropped without an assistant token), {plural(turns, 'trained assistant turn')}, {trained:,} of {tokens:,} "
        f"tokens trained ({share:.1%}; --loss-on {loss_on})"
    ]
    if loss_on != "all":
        example = f", e.g. {values['first_without_stop']}" if values.get("first_without_stop") else ""
        verdict = (
            "every one" if stops == turns else f"{turns - stops:,} do not{example}: the model may not learn to stop"
        )
        lines.append(
            f"chat: {stops:,} of {plural(turns, 'trained turn')} end on a trained end-of-turn token ({verdict})"
        )
    return lines


@dataclass
class EncodedConversation:
    ids: np.ndarray  # (n,) token ids
    mask: np.ndarray  # (n,) uint8: 1 = trained on as a target
    spans: list[tuple[int, int]] = field(default_factory=list)  # trained token ranges, per turn


class ChatEncoder:
    """Conversations -> (token ids, trained mask), through the template and the one tokenizer of a model directory.

    ``tokenizer_json`` is the text of the run's ``tokenizer.json`` (the one the shards are made with); special-token
    text the template writes (``<|im_end|>``) becomes the special token. A message whose content itself holds a
    special token's text is refused: it would be read as a control token."""

    def __init__(self, tokenizer_json: str, directory: Path, settings: ChatSettings) -> None:
        import tokenizers  # a pinned dependency (the file tokenizer's own library)

        self.template = ChatTemplate(directory)
        self.settings = settings
        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._tokenizer.encode_special_tokens = False  # the template's control tokens are tokens, not text
        self._special_ids = {
            int(i)
            for i, token in self._tokenizer.get_added_tokens_decoder().items()
            if getattr(token, "special", False)
        }
        self.audit = ChatAudit()

    def _check_content(self, conversation: Conversation) -> None:
        for number, message in enumerate(conversation.messages, start=1):
            content = message["content"]
            for text in self.template.special_texts:
                if text and text in content:
                    raise DataError(
                        f"{conversation.name}: message {number} ({message['role']}) holds the special token text "
                        f"{text!r}, which would be read as a control token; remove or escape it in the data"
                    )

    def encode(self, conversation: Conversation) -> EncodedConversation | None:
        """The conversation's tokens and mask; None when it is dropped (no assistant token, ``--no-assistant
        drop``)."""
        import numpy as np

        self._check_content(conversation)
        everything = self.settings.loss_on == "all"
        text, spans = assistant_spans(conversation, self.template, self.settings.loss_on == "last-assistant")
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)  # (n, 2) characters of each token
        mask = np.ones(len(ids), dtype=np.uint8) if everything else np.zeros(len(ids), dtype=np.uint8)
        token_spans = []
        for span in [] if everything else spans:
            inside = (offsets[:, 0] < span.end) & (offsets[:, 1] > span.start)
            first = int(np.argmax(inside)) if inside.any() else -1
            if first < 0:
                continue
            if offsets[first, 0] < span.start:
                raise DataError(
                    f"{conversation.name}: turn {span.message + 1} (assistant): its first token also holds the end of "
                    f"the prompt ({text[offsets[first, 0] : offsets[first, 1]]!r}), so the prompt tokenizes "
                    "differently at inference; fix the template or the data (e.g. no leading space in the reply)"
                )
            last = len(inside) - 1 - int(np.argmax(inside[::-1]))
            mask[first : last + 1] = 1
            token_spans.append((first, last + 1))
        if len(mask):
            mask[0] = 0  # never a target
        trained = int(mask[1:].sum()) if len(mask) else 0
        if not trained:
            if self.settings.no_assistant == "drop":
                self.audit.dropped += 1
                return None
            raise DataError(
                f"{conversation.name}: the conversation has no assistant token to train on; add an assistant reply, "
                "or --no-assistant drop to leave such conversations out (counted)"
            )
        audit = self.audit
        audit.conversations += 1
        audit.tokens += len(ids)
        audit.trained += trained
        if not everything:
            audit.assistant_turns += len(token_spans)
            for _, stop in token_spans:
                if int(ids[stop - 1]) in self._special_ids:
                    audit.turns_with_stop += 1
                elif not audit.first_without_stop:
                    audit.first_without_stop = conversation.name
        return EncodedConversation(ids, mask, token_spans)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))


def marked_text(encoder: ChatEncoder, encoded: EncodedConversation) -> str:
    """The conversation's tokens decoded, the trained ones between ⟦ and ⟧: what ``prepare --show`` prints."""
    parts = []
    ids, mask = encoded.ids.tolist(), encoded.mask.tolist()
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = encoder.decode(ids[start:i])
            parts.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if mask[start] else text)
            start = i
    return "".join(parts)


def shown_conversations(encoder: ChatEncoder, conversations: Iterator[Conversation], n: int) -> Iterator[str]:
    """The first ``n`` conversations that are kept, each rendered and marked (a dropped one is said as dropped)."""
    for conversation in conversations:
        if n <= 0:
            return
        encoded = encoder.encode(conversation)
        n -= 1
        if encoded is None:
            yield f"--- {conversation.name}: dropped (no assistant token)"
            continue
        trained = int(encoded.mask.sum())
        heading = f"--- {conversation.name}: {len(encoded.ids):,} tokens, {trained:,} trained"
        yield f"{heading}\n{marked_text(encoder, encoded)}"
