"""``--data-mode auto`` (the default): a source whose first row is a conversation, a preference pair or a KTO row is
prepared as documents (what they need), anything else as the default before ``auto`` prepared it, a packed token
stream.

``auto`` is resolved before anything is keyed on the mode (the data cache's key and directory name, a run's
settings and their fingerprint, ``meta.json``), so text prepared under ``auto`` is bit for bit what it was under
the old default ``packed``, and a source of conversations is what ``--data-mode documents`` makes of it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from bigbatch.data.answers import ANSWER_KINDS, answer_kind
from bigbatch.data.chat import has_chat_template, is_conversation_record
from bigbatch.data.corpus import BINARY_PROBE_BYTES, BUILTIN, is_hf_source, resolve_source
from bigbatch.data.foreign import foreign_files
from bigbatch.data.shards import is_prepared_dataset
from bigbatch.data.tokenizers import file_tokenizer_path, is_file_tokenizer
from bigbatch.errors import BigBatchError
from bigbatch.settings.choices import DATA_MODE

log = logging.getLogger(__name__)

AUTO = "auto"
TEXT_MODE = "packed"
"""What ``auto`` is for everything but conversations: the default before ``auto`` existed."""
CONVERSATION_MODE = "documents"
"""What ``auto`` is for conversations and rows of answers."""
CONVERSATION = "conversation"


def resolve_data_mode(mode: str, source: str, tokenizer_name: str) -> str:
    """``mode`` itself, or for ``auto`` the mode ``source`` is prepared in (see the module's note)."""
    DATA_MODE.check(mode)
    if mode != AUTO:
        return mode
    return CONVERSATION_MODE if first_row_kind(source, tokenizer_name) else TEXT_MODE


def holds_conversations(source: str, tokenizer_name: str) -> bool:
    """Whether the first row of ``source`` is a conversation (``messages`` or ShareGPT ``conversations``)."""
    return first_row_kind(source, tokenizer_name) == CONVERSATION


def holds_answers(source: str, tokenizer_name: str, open_remote: bool = False) -> str:
    """``pairs`` or ``kto`` when the first row of ``source`` is a row of answers, else ``""``; ``open_remote``:
    read a stream from the Hub too (a source prepared as documents, which prepare opens anyway)."""
    kind = first_row_kind(source, tokenizer_name, open_remote)
    return kind if kind in ANSWER_KINDS else ""


def first_row_kind(source: str, tokenizer_name: str, open_remote: bool = False) -> str:
    """What the first row of ``source`` is, where it needs documents mode: ``conversation``, ``pairs`` or ``kto``;
    ``""`` for anything else (text, prompt/completion).

    Read as cheaply as prepare reads it to pick its encoder: local files always (the first non-empty line of the
    first ``.jsonl``; a first file of another kind is text); an ``hf:`` source (a stream, perhaps remote) where it
    is local, the tokenizer has a chat template (a conversation is only told where such a template could render
    it) or ``open_remote`` asks for it. A prepared dataset or token shards are read as they are (the mode does not
    apply). A source that cannot be read here is text: it goes the way it went before ``auto``, where preparing it
    says what is wrong."""
    if source == BUILTIN:
        return ""
    try:
        if is_hf_source(source):
            return _hf_first_kind(source, tokenizer_name, open_remote)
        path = Path(source).expanduser()
        if is_prepared_dataset(path) or foreign_files(source):
            return ""
        return _files_first_kind(resolve_source(source))
    except (BigBatchError, OSError) as exc:  # e.g. DataError, or datasets not installed for hf:
        log.debug("--data-mode auto: %s not read (%s); %s mode", source, exc, TEXT_MODE)
        return ""


def _record_kind(record: object) -> str:
    return answer_kind(record) or (CONVERSATION if is_conversation_record(record) else "")


def _hf_first_kind(source: str, tokenizer_name: str, open_remote: bool) -> str:
    from bigbatch.data.hf_source import hf_text_records, parse

    template = is_file_tokenizer(tokenizer_name) and has_chat_template(file_tokenizer_path(tokenizer_name).parent)
    if not (template or open_remote or parse(source).is_local):
        return ""  # as prepare: a remote stream is opened only where a template could render what it holds
    records = hf_text_records(source)
    try:
        first = next((value for _, value in records if value), None)
    finally:
        close = getattr(records, "close", None)  # a generator: its stream's files and, for the Hub, its connection
        if close is not None:
            close()
    if not isinstance(first, dict):  # hf_text_records yields a conversation or a row of answers as its whole record
        return ""
    kind = _record_kind(first)
    return kind if kind != CONVERSATION or template else ""  # without a template, prepare reads it as text


def _files_first_kind(files: list[Path]) -> str:
    """What the first non-empty document of ``files`` is (in the order prepare reads them, binary files skipped
    as :func:`~bigbatch.data.corpus.text_files` skips them). Files are opened one by one until that is known: a
    directory of many files costs what its first ones do."""
    for path in files:
        with path.open("rb") as handle:
            head = handle.read(BINARY_PROBE_BYTES)
            if not head or b"\x00" in head:
                continue  # empty, or binary (skipped by prepare)
            if path.suffix != ".jsonl":
                return ""  # a text document first
            handle.seek(0)
            for chunk in handle:
                for line in chunk.splitlines():  # as prepare splits them (\r too)
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:  # not JSON, or not UTF-8: prepare names it
                        return ""
                    return _record_kind(record)
    return ""


def conversations_note(flag: str) -> str:
    """The line that says a source was read as conversations because ``flag`` (``--data-mode``, prepare's
    ``--mode``) was left at auto."""
    return (
        f"read as conversations ({flag} auto: the first row holds 'messages' or ShareGPT 'conversations'), one "
        "document each, rendered with the model's chat template"
    )


def answers_note(kind: str, flag: str) -> str:
    """The line that says a source of answers was read as such because ``flag`` was left at auto."""
    what = "preference pairs (prompt, chosen, rejected)" if kind == "pairs" else "KTO rows (prompt, completion, label)"
    return (
        f"read as {what} ({flag} auto): each answer a document, its prompt masked, grouped with the row's other "
        "documents"
    )
