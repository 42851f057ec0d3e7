"""Tokenizers: a byte-level one that needs nothing, and GPT-2 BPE through tiktoken."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from bigbatch.errors import BigBatchError, ConfigError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_token: int | None  # separator appended after each document, if the vocabulary has one

    def encode(self, data: bytes) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...


class ByteTokenizer:
    """Every byte is a token: vocabulary 256, no download, lossless on any input."""

    name = "byte"
    vocab_size = 256
    eot_token = None

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


class TiktokenGPT2Tokenizer:
    """GPT-2 BPE (vocabulary 50257, ``<|endoftext|>`` = 50256) through tiktoken.

    tiktoken downloads the encoding file once and caches it; without network and
    without a cached copy this raises a :class:`BigBatchError` that says so.
    """

    name = "gpt2"

    def __init__(self) -> None:
        try:
            import tiktoken
        except ImportError as exc:  # pragma: no cover - tiktoken is a pinned dependency
            raise BigBatchError("the gpt2 tokenizer needs tiktoken: pip install tiktoken") from exc
        try:
            self._encoding = tiktoken.get_encoding("gpt2")
        except Exception as exc:  # network errors surface as many types
            raise BigBatchError(
                "could not load tiktoken's GPT-2 encoding (it is downloaded on first use and this machine "
                f"seems offline: {type(exc).__name__}); connect once or set TIKTOKEN_CACHE_DIR to a cached copy, "
                "or use --tokenizer byte"
            ) from exc
        self.vocab_size = self._encoding.n_vocab
        self.eot_token = self._encoding.eot_token

    def encode(self, data: bytes) -> list[int]:
        return self._encoding.encode_ordinary(data.decode("utf-8", errors="replace"))

    def decode(self, tokens: list[int]) -> str:
        return self._encoding.decode([t for t in tokens if 0 <= t < self.vocab_size])


TOKENIZER_NAMES = ("byte", "gpt2")


def get_tokenizer(name: str, directory: Path | None = None) -> Tokenizer:
    """A tokenizer by name: ``byte`` or ``gpt2``. ``directory`` is the prepared dataset it belongs to, where a
    tokenizer trained on that data keeps its files."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenGPT2Tokenizer()
    raise ConfigError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZER_NAMES)}")
