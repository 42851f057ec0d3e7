"""Chat conversations as training documents: rendered with the model's own chat template, tokenized once, and
masked so that only what the assistant says is trained on.

A conversation (``{"messages": [...], "tools": [...]}``) is rendered whole by transformers' own renderer with the
template of the tokenizer's directory (``tokenizer_config.json`` or ``chat_template.jinja``), offline. Which
characters of that one rendering each reply is, and so which tokens are trained, is decided by
:mod:`~bigbatch.data.chat_spans` (the rendering cut along a second one whose texts are markers; no prefix of the
conversation is rendered). The character spans are mapped onto the one tokenization of the whole text by the
tokens' character offsets; a token that straddles the end of the generation prompt and the reply's start means the
prompt the model sees at inference tokenizes differently, and is refused. A conversation longer than a row is
shortened by its oldest rounds, left out, or refused (``ChatSettings.long_conversations``), never cut.

``transformers`` is imported only when a template is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bigbatch.data.chat_rows import content_text, conversation_field, is_conversation_row, row_messages, row_tools
from bigbatch.data.chat_spans import TemplateMarks, TurnSpan, learn_marks, reply_spans, skeleton_of
from bigbatch.errors import ConfigError, DataError, install_hint
from bigbatch.progress import plural
from bigbatch.settings.choices import LONG_CONVERSATIONS, LOSS_ON, NO_ASSISTANT

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
    long_conversations: str = "drop-oldest-turns"  # drop-oldest-turns, drop or refuse (see max_tokens)
    max_tokens: int = 0  # the longest conversation kept whole (a row: seq_len + 1 tokens); 0: no limit

    def __post_init__(self) -> None:
        LOSS_ON.check(self.loss_on)
        NO_ASSISTANT.check(self.no_assistant)
        LONG_CONVERSATIONS.check(self.long_conversations)
        if self.max_tokens < 0:
            raise ConfigError(f"max_tokens must be 0 (no limit) or positive, not {self.max_tokens}")

    def key(self) -> str:
        # spans=2: replies located in the one rendering of the whole conversation (data prepared by the prefix
        # rule before it is prepared again)
        limit = f",long={self.long_conversations},max_tokens={self.max_tokens}" if self.max_tokens else ""
        return f"loss_on={self.loss_on},no_assistant={self.no_assistant},spans=2{limit}"


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
    """Whether a row is a conversation: ``messages``, or ShareGPT ``conversations`` (see
    :func:`bigbatch.data.chat_rows.is_conversation_row`)."""
    return is_conversation_row(record)


def conversation_from_record(record: dict[str, Any], where: str) -> Conversation:
    """The conversation of a row holding ``messages`` (or ShareGPT ``conversations``, and optionally ``tools``);
    one line naming the row and the message for anything the template cannot be given.

    The row is first brought to ``{"role", "content"}`` messages with string content by
    :mod:`bigbatch.data.chat_rows` (ShareGPT ``from``/``value`` objects mapped to roles; content given as a list of
    text parts joined into one string, a non-text part refused). Parts are never passed through as parts, so a
    template that renders them itself (Gemma 3's) receives the joined string, which it renders as well."""
    key = conversation_field(record)
    messages = row_messages(record, where)
    if not isinstance(messages, list):
        raise DataError(f"{where}: {key!r} must be a list of {{'role', 'content'}} objects")
    if not messages:
        raise DataError(f"{where}: {key!r} is empty; give at least a user and an assistant message, or drop the row")
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
        if isinstance(content, list):  # OpenAI's parts: [{"type": "text", "text": ...}, ...]
            content = content_text(content, where, number, role)
        if not isinstance(content, str):
            raise DataError(
                f"{where}: message {number} ({role}) has no string 'content' (got {type(content).__name__}); "
                "give its text as a string"
            )
        checked.append({**message, "content": content})
    tools = row_tools(record)
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

    def render(
        self,
        name: str,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        generation_prompt: bool = False,
    ) -> str:
        """``messages`` rendered as text; one line naming the conversation when the template refuses them."""
        try:
            text = self._tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja's raise_exception, a missing variable, a bad tool schema
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise DataError(f"{name}: the chat template refused the conversation ({detail})") from exc
        if not isinstance(text, str):
            raise DataError(f"{name}: the chat template rendered {type(text).__name__}, not text")
        return text

    def try_render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str | None:
        """A probe's rendering, or None where the template refuses it."""
        try:
            return self.render("probe", messages, None, generation_prompt)
        except DataError:
            return None


@dataclass
class ChatAudit:
    """What preparing conversations found: counts for ``prepare``'s report and ``meta.json``."""

    conversations: int = 0  # kept
    dropped: int = 0  # without any assistant token (--no-assistant drop)
    assistant_turns: int = 0  # trained turns
    turns_with_stop: int = 0  # trained turns whose trained tokens end on an end-of-turn token
    tokens: int = 0
    trained: int = 0  # target tokens trained on
    first_without_stop: str = ""  # a conversation whose turn ends in no end-of-turn token, to name
    partial_turns: int = 0  # trained turns of which the template renders only a part (earlier reasoning dropped)
    first_partial: str = ""
    unrendered_turns: int = 0  # assistant turns the template does not render at all (not trained)
    first_unrendered: str = ""
    shortened: int = 0  # conversations over max_tokens kept without their oldest turns
    turns_cut: int = 0  # messages left out of them
    too_long: int = 0  # conversations over max_tokens left out (--long-conversations drop, or no turn to drop)
    first_too_long: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def note(self, what: str, name: str) -> None:
        """Count one of ``partial_turns``, ``unrendered_turns``, ``too_long``, keeping the first conversation's
        name."""
        setattr(self, what, getattr(self, what) + 1)
        first = {"partial_turns": "first_partial", "unrendered_turns": "first_unrendered"}.get(what, "first_too_long")
        if not getattr(self, first):
            setattr(self, first, name)


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
    partial, unrendered = int(values.get("partial_turns", 0)), int(values.get("unrendered_turns", 0))
    if partial:
        lines.append(
            f"chat: the template renders only part of {plural(partial, 'trained turn')} (e.g. "
            f"{values.get('first_partial')}: reasoning or text it leaves out of history); what it renders is trained"
        )
    if unrendered:
        lines.append(
            f"chat: the template does not render {plural(unrendered, 'assistant turn')} at all (e.g. "
            f"{values.get('first_unrendered')}: an empty reply, or tool calls it drops); they are not trained"
        )
    shortened, too_long = int(values.get("shortened", 0)), int(values.get("too_long", 0))
    if shortened or too_long or values.get("max_tokens"):
        limit = int(values.get("max_tokens", 0))
        lines.append(
            f"chat: longer than {limit:,} tokens (--seq-len + 1): {plural(shortened, 'conversation')} kept without "
            f"their oldest turns ({plural(int(values.get('turns_cut', 0)), 'message')} left out), "
            f"{plural(too_long, 'conversation')} left out"
            + (f" (e.g. {values.get('first_too_long')})" if too_long else "")
            + f" (--long-conversations {values.get('long_conversations', 'drop-oldest-turns')})"
        )
    return lines


@dataclass
class EncodedConversation:
    ids: np.ndarray  # (n,) token ids
    mask: np.ndarray  # (n,) uint8: 1 = trained on as a target
    spans: list[tuple[int, int]] = field(default_factory=list)  # trained token ranges, per turn
    text: str = ""  # the conversation as rendered
    offsets: np.ndarray | None = None  # (n, 2) characters of each token in ``text``

    def trained_text(self) -> list[str]:
        """The characters of each trained range (what ``--show`` marks), exact where decoding a piece is not
        (a SentencePiece tokenizer drops a piece's leading space when decoding it alone)."""
        assert self.offsets is not None
        return [self.text[int(self.offsets[a, 0]) : int(self.offsets[b - 1, 1])] for a, b in self.spans]


def without_oldest_round(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` without their first round (from the first message after the system prompt up to the second
    user message); the system and developer messages at the start stay. None when one round is all there is."""
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    users = [i for i in range(head, len(messages)) if messages[i]["role"] == "user"]
    later = [i for i in users if i > head]
    if not later:
        return None
    return [*messages[:head], *messages[later[0] :]]


class ChatEncoder:
    """Conversations -> (token ids, trained mask), through the template and the one tokenizer of a model directory.

    ``tokenizer_json`` is the text of the run's ``tokenizer.json`` (the one the shards are made with); special-token
    text the template writes (``<|im_end|>``) becomes the special token. A message whose content itself holds a
    special token's text is refused: it would be read as a control token. Which tokens are trained is decided by
    :mod:`~bigbatch.data.chat_spans` from the one rendering of the whole conversation."""

    def __init__(self, tokenizer_json: str, directory: Path, settings: ChatSettings) -> None:
        import tokenizers  # a pinned dependency (the file tokenizer's own library)

        self.template = ChatTemplate(directory)
        self.settings = settings
        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._tokenizer.encode_special_tokens = False  # the template's control tokens are tokens, not text
        self._tokenizer.no_truncation()  # a file's own truncation would cut conversations without a word
        self._tokenizer.no_padding()
        self._special_ids = {
            int(i)
            for i, token in self._tokenizer.get_added_tokens_decoder().items()
            if getattr(token, "special", False)
        }
        self.audit = ChatAudit()
        self._marks: TemplateMarks | None = None

    @property
    def marks(self) -> TemplateMarks:
        """The template's assistant header and end-of-turn texts (learned on first use)."""
        if self._marks is None:
            try:
                self._marks = learn_marks(self.template.try_render, self._token_pieces, self._stop_texts())
            except DataError as exc:
                raise DataError(f"{self.template.directory}: {exc}") from None
        return self._marks

    def _stop_texts(self) -> list[str]:
        """The special tokens ``generation_config.json`` beside the template stops generating at (if any)."""
        try:
            config = json.loads((self.template.directory / "generation_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        ids = config.get("eos_token_id") if isinstance(config, dict) else None
        ids = ids if isinstance(ids, list) else [ids]
        texts = [self._tokenizer.id_to_token(i) for i in ids if isinstance(i, int) and i in self._special_ids]
        return [t for t in texts if t]

    def _token_pieces(self, text: str) -> list[tuple[int, int, bool]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return [(a, b, int(i) in self._special_ids) for i, (a, b) in zip(encoding.ids, encoding.offsets, strict=True)]

    def _check_content(self, conversation: Conversation) -> None:
        """Refuse special-token text anywhere the template may write it: a message's text, its reasoning, its tool
        calls' names and arguments, and the tools' schemas (it would be read as a control token, and end a reply
        in the middle of a call)."""
        fields: list[tuple[str, str]] = []
        for number, message in enumerate(conversation.messages, start=1):
            where = f"message {number} ({message['role']})"
            for key, value in message.items():
                if key != "role" and value is not None:
                    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                    fields.append((where if key == "content" else f"{where}'s {key}", text))
        if conversation.tools:
            fields.append(("the tools", json.dumps(list(conversation.tools), ensure_ascii=False)))
        for where, text in fields:
            for special in self.template.special_texts:
                if special and special in text:
                    raise DataError(
                        f"{conversation.name}: {where} holds the special token text {special!r}, which would be read "
                        "as a control token; remove or escape it in the data"
                    )

    def _fitted(self, conversation: Conversation) -> tuple[list[dict[str, Any]], str, Any] | None:
        """The messages kept, their rendering and its encoding, within ``max_tokens`` by the settings' policy for
        long conversations; None when the conversation is left out (counted)."""
        messages = list(conversation.messages)
        limit, policy = self.settings.max_tokens, self.settings.long_conversations
        cut = 0
        while True:
            text = self.template.render(conversation.name, messages, conversation.tools)
            encoding = self._tokenizer.encode(text, add_special_tokens=False)
            if not limit or len(encoding.ids) <= limit:
                break
            if policy == "refuse":
                raise DataError(
                    f"{conversation.name}: the conversation is {len(encoding.ids):,} tokens, longer than a row of "
                    f"{limit:,} (--seq-len + 1); raise --seq-len, or --long-conversations drop-oldest-turns | drop"
                )
            shorter = without_oldest_round(messages) if policy == "drop-oldest-turns" else None
            if shorter is None:
                self.audit.note("too_long", conversation.name)
                return None
            cut += len(messages) - len(shorter)
            messages = shorter
        if cut:
            self.audit.shortened += 1
            self.audit.turns_cut += cut
        return messages, text, encoding

    def encode(self, conversation: Conversation) -> EncodedConversation | None:
        """The conversation's tokens and mask; None when it is left out (no assistant token with ``--no-assistant
        drop``, or too long; counted)."""
        import numpy as np

        self._check_content(conversation)
        fitted = self._fitted(conversation)
        if fitted is None:
            return None
        messages, text, encoding = fitted
        everything = self.settings.loss_on == "all"
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)  # (n, 2) characters of each token
        mask = np.ones(len(ids), dtype=np.uint8) if everything else np.zeros(len(ids), dtype=np.uint8)
        turns: list[tuple[int, int, TurnSpan]] = []
        if not everything:
            for span in self._spans(conversation.name, messages, conversation.tools, text):
                located = self._token_range(conversation.name, text, offsets, span)
                if located is not None:
                    mask[located[0] : located[1]] = 1
                    turns.append((*located, span))
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
        for _, stop, span in turns:
            audit.assistant_turns += 1
            if span.stopped and int(ids[stop - 1]) in self._special_ids:
                audit.turns_with_stop += 1
            elif not audit.first_without_stop:
                audit.first_without_stop = conversation.name
            if span.partial:
                audit.note("partial_turns", conversation.name)
        return EncodedConversation(ids, mask, [(a, b) for a, b, _ in turns], text, offsets)

    def _spans(
        self, name: str, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, text: str
    ) -> list[TurnSpan]:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.settings.loss_on == "last-assistant":
            turns = turns[-1:]
        turns = [i for i in turns if messages[i].get("weight", 1) != 0]  # OpenAI's fine-tuning rows: weight 0 shown
        skeleton = skeleton_of(messages)
        marked = self.template.render(name, skeleton.messages, tools)
        spans, unrendered = reply_spans(
            name, messages, text, marked, skeleton, self.marks, turns, self.template.special_texts
        )
        for _ in unrendered:
            self.audit.note("unrendered_turns", name)
        return spans

    def _token_range(self, name: str, text: str, offsets: np.ndarray, span: TurnSpan) -> tuple[int, int] | None:
        """The tokens ``[first, last + 1)`` of a reply's characters. A first token that also holds characters before
        the reply: white space the template writes between header and reply belongs to the reply (the model writes
        it, as Mistral's ``[/INST] Hello``); anything else means the prompt tokenizes differently at inference."""
        import numpy as np

        inside = (offsets[:, 0] < span.end) & (offsets[:, 1] > span.start)
        if not inside.any():
            return None
        first = int(np.argmax(inside))
        before = text[int(offsets[first, 0]) : span.start]
        if before and (span.after_header or before.strip()):
            raise DataError(
                f"{name}: turn {span.message + 1} (assistant): its first token also holds the end of the prompt "
                f"({text[offsets[first, 0] : offsets[first, 1]]!r}), so the prompt tokenizes differently at "
                "inference; fix the template or the data (e.g. no leading space in the reply)"
            )
        last = len(inside) - 1 - int(np.argmax(inside[::-1]))
        return first, last + 1

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
