"""Rows of answers -> groups of tokenized documents, each with its trained mask; bad and over-long rows refused or
dropped (and counted) by the :class:`~bigbatch.data.answers.AnswerSettings`.

* **Text rows** are tokenized as ``prompt``/``completion`` documents are (:func:`~bigbatch.data.encode.
  encoded_documents`: the prompt and the answer each tokenized, the answer as a continuation, then the end-of-text
  token where the tokenizer has one; worker processes for a large corpus), one document per answer: the prompt's
  tokens are masked, the answer's and the end-of-text token's are trained.
* **Conversational rows** are rendered with the model's chat template through the chat path
  (:class:`~bigbatch.data.chat.ChatEncoder`, ``--loss-on last-assistant``): one conversation per answer, the
  prompt's messages followed by the answer, and only the answer (the last assistant turn, with its end-of-turn
  token as the template writes it) is trained; assistant turns inside the prompt are not.

A group whose longest document is longer than ``max_tokens`` (a row: ``seq_len + 1``) follows ``long_rows``:
``drop-oldest-turns`` renders a conversational prompt again without its oldest rounds (the system prompt stays; the
same prompt for every answer of the group) until it fits, and drops the group when no round is left to drop (a
text prompt has none); ``drop`` drops it; ``refuse`` stops on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bigbatch.data.answer_rows import EMPTY, IDENTICAL, MALFORMED, AnswerRow, BadRow
from bigbatch.data.answers import KTO, PAIRS, ROLE_DESIRABLE, ROLE_KL, ROLE_NAMES, AnswerSettings
from bigbatch.data.chat import TRAINED_CLOSE, TRAINED_OPEN, ChatEncoder, Conversation, without_oldest_round
from bigbatch.data.corpus import Document
from bigbatch.data.encode import encoded_documents
from bigbatch.data.text import InvalidUTF8
from bigbatch.data.tokenizers import Tokenizer
from bigbatch.errors import DataError
from bigbatch.progress import plural


@dataclass
class EncodedAnswer:
    """One document of a group: its tokens, which of them are trained as targets, and where its answer begins."""

    ids: np.ndarray  # (n,) token ids
    mask: np.ndarray  # (n,) uint8: 1 = trained on as a target
    start: int  # the answer's first token: ids[:start] is the prompt (as rendered)


@dataclass
class EncodedGroup:
    row: AnswerRow
    documents: list[EncodedAnswer]


@dataclass
class AnswerAudit:
    """What preparing rows of answers found: counts for ``prepare``'s report and ``meta.json``."""

    kind: str = ""  # pairs or kto
    rows: int = 0  # read
    groups: int = 0  # kept
    desirable: int = 0  # KTO rows kept with label true
    undesirable: int = 0
    bad: dict[str, int] = field(default_factory=dict)  # dropped (--bad-rows drop), by kind of problem
    first_bad: str = ""  # the first one's line
    too_long: int = 0  # left out for a document longer than max_tokens
    first_too_long: str = ""
    shortened: int = 0  # kept without the oldest rounds of their prompt
    turns_cut: int = 0  # messages left out of them
    tokens: int = 0  # of the documents kept (before a KTO row's KL document is made)
    trained: int = 0
    bad_rows: str = "refuse"
    long_rows: str = "drop-oldest-turns"
    max_tokens: int = 0
    template: str = ""  # the fingerprint of the chat template conversational rows were rendered with

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


REFUSE_FIX = "fix the row, or --bad-rows drop to leave such rows out (counted)"


def answer_audit_lines(values: dict[str, Any]) -> list[str]:
    """The lines ``prepare`` prints, from ``meta.json``'s ``answer_rows`` record."""
    kind = str(values.get("kind", PAIRS))
    groups, rows = int(values.get("groups", 0)), int(values.get("rows", 0))
    what = "pair" if kind == PAIRS else "KTO row"
    line = f"{kind}: {plural(groups, what)} kept of {plural(rows, 'row')}"
    if kind == KTO:
        line += (
            f" ({int(values.get('desirable', 0)):,} desirable, {int(values.get('undesirable', 0)):,} undesirable; "
            "each followed by its KL document: its prompt, then the next row's completion)"
        )
    tokens, trained = int(values.get("tokens", 0)), int(values.get("trained", 0))
    lines = [f"{line}; {trained:,} of {tokens:,} tokens are answers (trained)"]
    bad = {str(k): int(v) for k, v in dict(values.get("bad") or {}).items()}
    if bad:
        counts = ", ".join(f"{n:,} {k}" for k, n in sorted(bad.items()))
        lines.append(
            f"{kind}: {plural(sum(bad.values()), 'bad row')} left out ({counts}; e.g. {values.get('first_bad')}) "
            "(--bad-rows drop)"
        )
    limit, too_long = int(values.get("max_tokens", 0)), int(values.get("too_long", 0))
    shortened = int(values.get("shortened", 0))
    if limit and (too_long or shortened):
        lines.append(
            f"{kind}: longer than {limit:,} tokens (--seq-len + 1): {plural(shortened, 'row')} kept without the "
            f"oldest rounds of their prompt ({plural(int(values.get('turns_cut', 0)), 'message')} left out), "
            f"{plural(too_long, 'row')} left out"
            + (f" (e.g. {values.get('first_too_long')})" if too_long else "")
            + f" (--long-conversations {values.get('long_rows')})"
        )
    return lines


class AnswerEncoder:
    """Rows of answers -> :class:`EncodedGroup` in order, bad ones refused or dropped (see the module's note).
    ``chat``: the encoder of conversational rows (the model's template), or None for text rows; every row of a
    source has the shape of its first one."""

    def __init__(
        self,
        settings: AnswerSettings,
        tokenizer: Tokenizer,
        dtype: np.dtype,
        chat: ChatEncoder | None = None,
        workers: int = 1,
        invalid: InvalidUTF8 | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.chat = chat
        self.workers = workers
        self.invalid = invalid
        self.audit = AnswerAudit(
            bad_rows=settings.bad_rows, long_rows=settings.long_rows, max_tokens=settings.max_tokens
        )
        self._shape: tuple[str, bool] | None = None  # (kind, conversational) of the first row

    def groups(self, documents: Callable[[], Iterable[Document]]) -> Iterator[EncodedGroup]:
        """Each usable row of ``documents`` (rows of answers; empty documents skipped) as a group, in order."""
        rows = self._checked(documents)
        encoded = self._text_groups(rows) if self.chat is None else (self._chat_group(row) for row in rows)
        for group in encoded:
            if group is None or self._same_answers(group):
                continue
            self._count(group)
            yield group

    def _same_answers(self, group: EncodedGroup) -> bool:
        """A pair whose answers are the same tokens once rendered and tokenized (a template that trims the
        whitespace they differ by) prefers nothing: a bad row, like identical text."""
        if group.row.kind != PAIRS:
            return False
        chosen, rejected = group.documents

        def answer(document: EncodedAnswer) -> list[int]:
            return [int(t) for t, m in zip(document.ids.tolist(), document.mask.tolist(), strict=True) if m]

        if answer(chosen) != answer(rejected):
            return False
        self.bad(BadRow(IDENTICAL, f"{group.row.name}: 'chosen' and 'rejected' are the same tokens once rendered"))
        return True

    def bad(self, bad: BadRow) -> None:
        """A bad row: refused in one line, or (``--bad-rows drop``) left out and counted."""
        if self.settings.bad_rows == "refuse":
            raise DataError(f"{bad.message}; {REFUSE_FIX}")
        audit = self.audit
        audit.bad[bad.kind] = audit.bad.get(bad.kind, 0) + 1
        audit.first_bad = audit.first_bad or bad.message

    def _checked(self, documents: Callable[[], Iterable[Document]]) -> Iterator[AnswerRow]:
        for doc in documents():
            if doc.empty:
                continue
            row = doc.answers
            if row is None:
                what = "a conversation" if doc.conversation is not None else "text"
                raise DataError(
                    f"{doc.name} is {what} among rows of answers (the first row's shape); give every row as "
                    "prompt/chosen/rejected (pairs) or prompt/completion/label (KTO), or prepare them apart"
                )
            self._check_shape(row)
            self.audit.rows += 1
            if row.bad is not None:
                self.bad(row.bad)
                continue
            yield row

    def _check_shape(self, row: AnswerRow) -> None:
        """Every row has the first row's kind and form: a mix is an error of the data's assembly, not a bad row."""
        shape = (row.kind, row.conversational)
        if self._shape is None:
            self._shape = shape
            self.audit.kind = row.kind
            return
        if shape != self._shape:
            kind, conversational = self._shape
            first = f"{kind} {'as conversations' if conversational else 'as text'}"
            here = f"{row.kind} {'as conversations' if row.conversational else 'as text'}"
            raise DataError(
                f"{row.name} holds {here}, the rows before it {first}; give every row of a source in one shape"
            )

    # -- text rows: through the text tokenizer pipeline -----------------------------------------------------------

    def _text_groups(self, rows: Iterable[AnswerRow]) -> Iterator[EncodedGroup | None]:
        """Text rows tokenized as prompt/completion documents (in worker processes for a large corpus), results
        matched back to their rows in order."""
        pending: deque[AnswerRow] = deque()

        def documents() -> Iterator[Document]:
            for row in rows:
                pending.append(row)
                prompt = _utf8(str(row.prompt))
                answers = [_utf8(str(answer)) for answer in row.answers]
                if self.invalid is not None:  # once per row: the prompt is in each of its documents
                    self.invalid.check(row.name, [prompt, *answers])
                for answer in answers:
                    yield Document(row.name, answer, prompt=prompt)

        encoded = encoded_documents(documents, self.tokenizer, self.dtype, self.workers)
        parts: list[EncodedAnswer] = []
        for ids, prompt_length, _ in encoded:
            mask = np.ones(len(ids), dtype=np.uint8)
            mask[: max(prompt_length, 1)] = 0  # the prompt's tokens, and a document's first, are never targets
            parts.append(EncodedAnswer(ids, mask, prompt_length))
            if len(parts) < len(pending[0].answers):
                continue
            row = pending.popleft()
            group, parts = EncodedGroup(row, parts), []
            yield self._fitted_text(group)

    def _fitted_text(self, group: EncodedGroup) -> EncodedGroup | None:
        for field_name, document in zip(_answer_fields(group.row), group.documents, strict=True):
            if not int(document.mask.sum()):
                self.bad(BadRow(EMPTY, f"{group.row.name}: the {field_name} answer tokenizes to nothing"))
                return None
        longest = max(len(d.ids) for d in group.documents)
        limit = self.settings.max_tokens
        if limit and longest > limit:
            self._too_long(group.row, longest, "a text prompt has no oldest round to leave out")
            return None
        return group

    # -- conversational rows: through the chat template ------------------------------------------------------------

    def _chat_group(self, row: AnswerRow) -> EncodedGroup | None:
        """The row's answers each rendered after its prompt; over-long, the prompt loses its oldest rounds (the
        same for every answer) by ``long_rows``."""
        assert self.chat is not None and not isinstance(row.prompt, str)
        messages: list[dict[str, Any]] = list(row.prompt)
        cut = 0
        limit = self.settings.max_tokens
        while True:
            documents = []
            for field_name, answer in zip(_answer_fields(row), row.answers, strict=True):
                document = self._render(row, messages, answer, field_name)
                if document is None:
                    return None
                documents.append(document)
            longest = max(len(d.ids) for d in documents)
            if not limit or longest <= limit:
                break
            shorter = without_oldest_round(messages) if self.settings.long_rows == "drop-oldest-turns" else None
            if shorter is None or self.settings.long_rows == "refuse":
                self._too_long(row, longest, "its prompt has no older round to leave out")
                return None
            cut += len(messages) - len(shorter)
            messages = shorter
        if cut:
            self.audit.shortened += 1
            self.audit.turns_cut += cut
        return EncodedGroup(row, documents)

    def _render(
        self, row: AnswerRow, messages: list[dict[str, Any]], answer: Any, field_name: str
    ) -> EncodedAnswer | None:
        assert self.chat is not None
        conversation = Conversation(row.name, (*messages, answer), row.tools)
        try:
            encoded = self.chat.encode(conversation)
        except DataError as exc:  # the template refuses it, special-token text in it, a reply that splits a token
            self.bad(BadRow(MALFORMED, str(exc)))
            return None
        if encoded is None:  # nothing trained: the template renders the answer empty
            self.bad(BadRow(EMPTY, f"{row.name}: the {field_name} answer renders to no trained token"))
            return None
        start = int(np.argmax(encoded.mask))  # the first trained token: everything before it is the prompt
        return EncodedAnswer(encoded.ids.astype(self.dtype), encoded.mask.astype(np.uint8), start)

    # -- both ------------------------------------------------------------------------------------------------------

    def _too_long(self, row: AnswerRow, longest: int, why: str) -> None:
        limit, policy = self.settings.max_tokens, self.settings.long_rows
        if policy == "refuse":
            raise DataError(
                f"{row.name}: a document of the row is {longest:,} tokens, longer than a row of {limit:,} "
                "(--seq-len + 1); raise --seq-len, or --long-conversations drop-oldest-turns | drop"
            )
        audit = self.audit
        audit.too_long += 1
        audit.first_too_long = audit.first_too_long or f"{row.name} ({longest:,} tokens; {why})"

    def _count(self, group: EncodedGroup) -> None:
        audit = self.audit
        audit.groups += 1
        if group.row.kind == KTO:
            if group.row.roles[0] == ROLE_DESIRABLE:
                audit.desirable += 1
            else:
                audit.undesirable += 1
        for document in group.documents:
            audit.tokens += len(document.ids)
            audit.trained += int(document.mask.sum())


def _answer_fields(row: AnswerRow) -> tuple[str, ...]:
    return ("chosen", "rejected") if row.kind == PAIRS else ("completion",)


def _utf8(text: str) -> bytes:
    """As :mod:`bigbatch.data.corpus` reads text: a lone surrogate becomes the bytes it stands for."""
    return text.encode("utf-8", errors="surrogatepass")


def shown_groups(
    encoder: AnswerEncoder, documents: Callable[[], Iterable[Document]], decode: Callable[[list[int]], str]
) -> Iterator[str]:
    """Each group of ``documents`` (rows of answers) as ``prepare --show`` prints it: every document decoded, its
    trained tokens (the answer) between ⟦ and ⟧; a dropped row is not shown (the audit counts it)."""
    for group in encoder.groups(documents):
        row = group.row
        lines = [f"--- {row.name}: {row.kind} ({'conversation' if row.conversational else 'text'})"]
        for role, document in zip(row.roles, group.documents, strict=True):
            lines.append(f"[{ROLE_NAMES[role]}] {marked(decode, document.ids.tolist(), document.mask.tolist())}")
        if row.kind == KTO:
            lines.append(f"[{ROLE_NAMES[ROLE_KL]}] this prompt, then the next row's completion (made with the split)")
        yield "\n".join(lines)


def marked(decode: Callable[[list[int]], str], ids: list[int], mask: list[int]) -> str:
    """``ids`` decoded run by run, the trained runs between ⟦ and ⟧."""
    parts = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = decode(ids[start:i])
            parts.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if mask[start] else text)
            start = i
    return "".join(parts)
