"""Document text cut into pieces that tokenize as the whole does, and the count of invalid UTF-8 in it."""

from __future__ import annotations

import re
from collections.abc import Iterable

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
