"""Text sources: the built-in corpus, a file, a directory, a glob, or a Hugging Face dataset (``hf:``)."""

from __future__ import annotations

import glob
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigbatch.data.answer_rows import AnswerRow, answer_row
from bigbatch.data.answers import answer_kind
from bigbatch.data.chat import Conversation, conversation_from_record, is_conversation_record
from bigbatch.data.text import bad_utf8_in_line
from bigbatch.errors import DataError

log = logging.getLogger(__name__)
BUILTIN = "builtin"
"""Name of the built-in corpus: the Python standard library's top-level ``.py`` sources."""

HF_PREFIX = "hf:"
"""``hf:NAME[:CONFIG][:SPLIT]``: the ``text`` field of a Hugging Face dataset, streamed (needs ``datasets``)."""
HF_DEFAULT_SPLIT = "train"

BINARY_PROBE_BYTES = 8192


@dataclass(frozen=True)
class Document:
    """One document. ``prompt`` is a prefix that is read but not trained on (its targets are masked). A chat row is
    its ``conversation`` instead (rendered and masked by :mod:`bigbatch.data.chat`; ``data`` is empty); a row of
    preference pairs or KTO is its ``answers`` (:mod:`bigbatch.data.answer_rows`; it becomes a group of documents)."""

    name: str
    data: bytes
    prompt: bytes = b""
    conversation: Conversation | None = None
    answers: AnswerRow | None = None

    @property
    def empty(self) -> bool:
        return not (self.data or self.prompt or self.conversation or self.answers)


def builtin_corpus_files() -> list[Path]:
    """The standard library's top-level ``.py`` files in sorted order (about 5 MB, on every machine)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))


def resolve_source(source: str) -> list[Path]:
    """The files a source names, sorted: ``builtin``, a file, a directory (recursive) or a glob."""
    if source == BUILTIN:
        files = builtin_corpus_files()
        if not files:
            raise DataError("the built-in corpus (the Python standard library's .py files) was not found")
        return files
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not _is_hidden(p.relative_to(path)))
        if not files:
            raise DataError(f"directory {source} holds no files; give a directory of text files, a text file or a glob")
        return files
    if glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"the pattern {source!r} matches no files")
        return files
    raise DataError(f"data source {source} does not exist; give a text file, a directory, a glob or 'builtin'")


def _is_hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def text_files(files: list[Path]) -> list[Path]:
    """``files`` without the binary ones (a NUL byte in the first 8 KiB), which a directory of text often holds
    beside it (images, archives); how many were skipped is said once, as a warning."""
    kept: list[Path] = []
    binary: list[Path] = []
    for path in files:
        try:
            with path.open("rb") as handle:
                head = handle.read(BINARY_PROBE_BYTES)
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror}; check the path and its permissions") from exc
        (binary if b"\x00" in head else kept).append(path)
    if binary:
        log.warning(
            "skipped %d binary file%s (e.g. %s): not text (a NUL byte in the first %d KiB)",
            len(binary),
            "" if len(binary) == 1 else "s",
            binary[0],
            BINARY_PROBE_BYTES // 1024,
        )
    return kept


def read_documents(files: list[Path]) -> Iterator[Document]:
    """Each readable text file as one document; binary files (NUL bytes) are skipped (see :func:`text_files`,
    which says so).

    A ``.jsonl`` file holds one document per line: ``{"text": ...}``,
    ``{"prompt": ..., "completion": ...}`` where the prompt's targets are masked, or a conversation
    ``{"messages": [...], "tools": [...]}`` (:mod:`bigbatch.data.chat`); or one row of answers per line:
    a preference pair ``{"prompt", "chosen", "rejected"}`` or a KTO row ``{"prompt", "completion", "label"}``
    (:mod:`bigbatch.data.answer_rows`; a ``label`` beside ``completion`` makes a KTO row, never prompt/completion).
    """
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror}; check the path and its permissions") from exc
        if b"\x00" in data[:BINARY_PROBE_BYTES]:
            continue
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path, data)
        else:
            yield Document(name=str(path), data=data)


def _jsonl_documents(path: Path, data: bytes) -> Iterator[Document]:
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} is not valid JSON ({exc.msg}); each line must be one JSON object") from exc
        except UnicodeDecodeError as exc:  # JSON text is UTF-8 (RFC 8259): a byte that is not cannot be read
            bad = bad_utf8_in_line(line, number)
            message = bad.describe(path) if bad is not None else f"{where} is not valid UTF-8 ({exc.reason})"
            raise DataError(message) from None
        if not isinstance(record, dict):
            raise DataError(
                f"{where} must be a JSON object with 'text', 'prompt' and 'completion', or 'messages' (or ShareGPT "
                "'conversations')"
            )
        if answer_kind(record):
            yield Document(name=where, data=b"", answers=answer_row(record, where))
        elif is_conversation_record(record):
            yield Document(name=where, data=b"", conversation=conversation_from_record(record, where))
        elif "text" in record and isinstance(record["text"], str):
            yield Document(name=where, data=_utf8(record["text"]))
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            yield Document(name=where, data=_utf8(record["completion"]), prompt=_utf8(record["prompt"]))
        else:
            raise DataError(
                f"{where} needs a string 'text', string 'prompt' and 'completion' fields, or 'messages' (or ShareGPT "
                f"'conversations'){_fields(record)}"
            )


def _fields(record: dict[str, Any]) -> str:
    """`` (fields: a, b)``: what a refused row holds, so that the message shows what was read."""
    names = [str(name) for name in record][:8]
    return f" (fields: {', '.join(names)}{', ...' if len(record) > 8 else ''})" if names else " (an empty object)"


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8; a lone surrogate (``"\\ud800"`` in JSON) becomes the bytes it stands for, invalid UTF-8
    that text tokenizers count and replace, rather than an encoding error."""
    return text.encode("utf-8", errors="surrogatepass")


def is_hf_source(source: str) -> bool:
    return source.startswith(HF_PREFIX)


def parse_hf_source(source: str) -> tuple[str, str | None, str]:
    """``hf:NAME[:CONFIG][:SPLIT]`` as ``(name, config or None, split)``; the split defaults to ``train``."""
    parts = source[len(HF_PREFIX) :].split(":")
    if not parts[0] or len(parts) > 3:
        raise DataError(
            f"bad Hugging Face source {source!r}; write hf:NAME[:CONFIG][:SPLIT], "
            "e.g. hf:HuggingFaceFW/fineweb-edu:sample-10BT:train"
        )
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else HF_DEFAULT_SPLIT
    return name, config, split


def hf_documents(source: str) -> Iterator[Document]:
    """Each record's text of the Hugging Face dataset ``source`` names (see :mod:`bigbatch.data.hf_source`:
    the Hub, streamed, or local files and directories), in order."""
    from bigbatch.data.hf_source import hf_text_records

    for name, value in hf_text_records(source):
        if isinstance(value, dict) and answer_kind(value):  # a row of answers (pairs or KTO)
            yield Document(name=name, data=b"", answers=answer_row(value, name))
        elif isinstance(value, dict):  # a conversation (the source reads 'messages')
            yield Document(name=name, data=b"", conversation=conversation_from_record(value, name))
        else:
            yield Document(name=name, data=value.encode("utf-8", errors="surrogatepass"))
