"""Document text cut into pieces that tokenize as the whole does, and the count of invalid UTF-8 in it."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bigbatch.progress import plural

PIECE_BYTES = 1 << 17
"""Documents are tokenized in pieces of about this size (128 KiB): memory stays flat and one big file still
spreads over the workers."""
# A cut after a newline that sits between two printable ASCII characters: the newline is a pre-token of its own
# for the byte, GPT-2 and byte-level BPE tokenizers alike, so cutting there changes no token.
_SAFE_CUT = re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])")


def split_text(data: bytes, size: int | None = None) -> list[bytes]:
    """``data`` cut into pieces of about ``size`` bytes (default :data:`PIECE_BYTES`) at token-safe newlines
    (see ``_SAFE_CUT``).

    Tokenizing the pieces one by one gives the same tokens as tokenizing ``data`` whole; text without such a
    newline stays in one piece.
    """
    size = size or PIECE_BYTES  # read when called, so a test can shrink it
    pieces: list[bytes] = []
    start = 0
    while len(data) - start > size:
        match = _SAFE_CUT.search(data, start + size - 1)
        if match is None:
            break
        cut = match.end()
        pieces.append(data[start:cut])
        start = cut
    pieces.append(data[start:] if start else data)
    return pieces


class InvalidUTF8:
    """Counts what a tokenizer that reads text (gpt2, bpe) cannot see as it is: invalid UTF-8 sequences, each
    decoded as U+FFFD (the byte tokenizer keeps the bytes)."""

    def __init__(self) -> None:
        self.replacements = 0
        self.documents = 0
        self.first = ""

    def check(self, name: str, parts: Iterable[bytes]) -> None:
        found = sum(utf8_replacements(part) for part in parts)
        if found:
            self.replacements += found
            self.documents += 1
            self.first = self.first or name

    def describe(self, tokenizer: str) -> str:
        return (
            f"{plural(self.replacements, 'invalid UTF-8 sequence')} in {plural(self.documents, 'document')} (the "
            f"first in {self.first}) {'was' if self.replacements == 1 else 'were'} replaced by U+FFFD for the "
            f"{tokenizer} tokenizer; fix the encoding of the text, "
            "or use --tokenizer byte, which keeps every byte"
        )


def utf8_replacements(data: bytes) -> int:
    """The U+FFFD characters that decoding ``data`` as UTF-8 with ``errors="replace"`` introduces."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace").count("\ufffd") - data.count("\ufffd".encode())
    return 0


@dataclass(frozen=True)
class BadUTF8:
    """Where a file first stops being UTF-8: its 1-based line, the 1-based byte of that line, and the byte."""

    line: int
    column: int
    byte: int

    def describe(self, path: Path | str) -> str:
        """One line naming the place and what to do (formats read as text, JSON above all, must be UTF-8)."""
        return (
            f"{path}:{self.line}: not valid UTF-8 (byte 0x{self.byte:02x} at byte {self.column} of the line); "
            "the file is read as UTF-8: re-encode it as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 FILE > NEW, with "
            "its real encoding) or fix that line"
        )


def bad_utf8_in_line(line: bytes, number: int) -> BadUTF8 | None:
    """Where ``line`` (line ``number`` of a file) is not UTF-8, or None."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadUTF8(number, exc.start + 1, line[exc.start])
    return None


def first_bad_utf8(path: Path) -> BadUTF8 | None:
    """The first place ``path`` is not UTF-8 (read line by line: memory stays flat), or None; used to name the
    place when a reader that decodes a whole file (``datasets``' json, csv and text builders) fails on it."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            found = bad_utf8_in_line(line, number)
            if found is not None:
                return found
    return None
