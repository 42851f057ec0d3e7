"""``--data-mode auto`` (the default): a source whose first row is a conversation is prepared as documents (what
conversations need), anything else as the default before ``auto`` prepared it, a packed token stream.

``auto`` is resolved before anything is keyed on the mode (the data cache's key and directory name, a run's
settings and their fingerprint, ``meta.json``), so text prepared under ``auto`` is bit for bit what it was under
the old default ``packed``, and a source of conversations is what ``--data-mode documents`` makes of it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from bigbatch.data.chat import has_chat_template, is_conversation_record
from bigbatch.data.corpus import BINARY_PROBE_BYTES, BUILTIN, is_hf_source, resolve_source
from bigbatch.data.foreign import foreign_files
from bigbatch.data.shards import is_prepared_dataset
from bigbatch.data.tokenizers import file_tokenizer_path, is_file_tokenizer
from bigbatch.errors import DataError
from bigbatch.settings.choices import DATA_MODE

log = logging.getLogger(__name__)

AUTO = "auto"
TEXT_MODE = "packed"
"""What ``auto`` is for everything but conversations: the default before ``auto`` existed."""
CONVERSATION_MODE = "documents"


def resolve_data_mode(mode: str, source: str, tokenizer_name: str) -> str:
    """``mode`` itself, or for ``auto`` the mode ``source`` is prepared in (see the module's note)."""
    DATA_MODE.check(mode)
    if mode != AUTO:
        return mode
    return CONVERSATION_MODE if holds_conversations(source, tokenizer_name) else TEXT_MODE


def holds_conversations(source: str, tokenizer_name: str) -> bool:
    """Whether the first row of ``source`` is a conversation (``messages`` or ShareGPT ``conversations``).

    Read as cheaply as prepare reads it to pick its encoder: local files always (the first non-empty line of the
    first ``.jsonl``; a first file of another kind is text); an ``hf:`` source (a stream, perhaps remote) only where
    the tokenizer has a chat template that could render it. A prepared dataset or token shards are read as they
    are (the mode does not apply). A source that cannot be read here is not conversations: it goes the way it went
    before ``auto``, where preparing it says what is wrong."""
    if source == BUILTIN:
        return False
    try:
        if is_hf_source(source):
            return _hf_first_is_conversation(source, tokenizer_name)
        path = Path(source).expanduser()
        if is_prepared_dataset(path) or foreign_files(source):
            return False
        return _files_first_is_conversation(resolve_source(source))
    except (DataError, OSError) as exc:
        log.debug("--data-mode auto: %s not read (%s); %s mode", source, exc, TEXT_MODE)
        return False


def _hf_first_is_conversation(source: str, tokenizer_name: str) -> bool:
    if not (is_file_tokenizer(tokenizer_name) and has_chat_template(file_tokenizer_path(tokenizer_name).parent)):
        return False  # as prepare: without a template that could render them, an hf: source is read as text
    from bigbatch.data.hf_source import hf_text_records

    records = hf_text_records(source)
    try:
        first = next((value for _, value in records if value), None)
    finally:
        close = getattr(records, "close", None)  # a generator: its stream's files and, for the Hub, its connection
        if close is not None:
            close()
    return isinstance(first, dict)  # hf_text_records yields a conversation as its whole record


def _files_first_is_conversation(files: list[Path]) -> bool:
    """Whether the first non-empty document of ``files`` (in the order prepare reads them, binary files skipped
    as :func:`~bigbatch.data.corpus.text_files` skips them) is a conversation. Files are opened one by one until
    that is known: a directory of many files costs what its first ones do."""
    for path in files:
        with path.open("rb") as handle:
            head = handle.read(BINARY_PROBE_BYTES)
            if not head or b"\x00" in head:
                continue  # empty, or binary (skipped by prepare)
            if path.suffix != ".jsonl":
                return False  # a text document first
            handle.seek(0)
            for chunk in handle:
                for line in chunk.splitlines():  # as prepare splits them (\r too)
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:  # not JSON, or not UTF-8: prepare names it
                        return False
                    return is_conversation_record(record)
    return False


def conversations_note(flag: str) -> str:
    """The line that says a source was read as conversations because ``flag`` (``--data-mode``, prepare's
    ``--mode``) was left at auto."""
    return (
        f"read as conversations ({flag} auto: the first row holds 'messages' or ShareGPT 'conversations'), one "
        "document each, rendered with the model's chat template"
    )
