"""Tokenizers: a byte-level one that needs nothing, GPT-2 BPE through tiktoken, and a byte-level BPE trained
on the corpus itself (``bpe:VOCAB``, Hugging Face ``tokenizers``) and kept beside the shards as ``tokenizer.json``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from bigbatch.errors import BigBatchError, ConfigError, DataError


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    @property
    def eot_token(self) -> int | None:  # read-only: a tokenizer may declare it as None or as an int
        """The separator appended after each document, if the vocabulary has one."""
        ...

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

    def encode_array(self, data: bytes, dtype: Any) -> Any:
        """``encode`` as a NumPy array of ``dtype``, without a Python list (what prepare uses)."""
        import numpy as np

        return np.frombuffer(data, dtype=np.uint8).astype(dtype)


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


BPE_PREFIX = "bpe:"
BPE_FILE = "tokenizer.json"
"""The trained ``bpe:VOCAB`` tokenizer, in the prepared dataset directory (Hugging Face ``tokenizers`` format)."""
EOT_TEXT = "<|endoftext|>"
BPE_MIN_VOCAB = 257  # the 256 byte symbols and the end-of-text token
BPE_MAX_VOCAB = 1 << 20


class BPETokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenization, no normalization) trained by :func:`train_bpe`.

    Lossless on any UTF-8 text. ``<|endoftext|>`` is the end-of-text token; the same characters inside a
    document are encoded as ordinary text, never as the separator.
    """

    def __init__(self, name: str, tokenizer: Any) -> None:
        tokenizer.encode_special_tokens = True  # a literal "<|endoftext|>" in the text is text, as with tiktoken
        self.name = name
        self._tokenizer = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        eot = tokenizer.token_to_id(EOT_TEXT)
        self.eot_token = int(eot) if eot is not None else None

    @classmethod
    def from_file(cls, name: str, path: Path) -> BPETokenizer:
        hf = _hf_tokenizers()
        try:
            return cls(name, hf.Tokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises plain Exceptions on a damaged file
            detail = (str(exc).splitlines() or [""])[0][:120]
            raise DataError(
                f"{path} is not a readable tokenizer file ({type(exc).__name__}: {detail}); re-run bigbatch prepare"
            ) from exc

    @classmethod
    def from_str(cls, name: str, text: str) -> BPETokenizer:
        return cls(name, _hf_tokenizers().Tokenizer.from_str(text))

    def to_str(self) -> str:
        return str(self._tokenizer.to_str())

    def save(self, path: Path) -> None:
        self._tokenizer.save(str(path))

    def encode(self, data: bytes) -> list[int]:
        text = data.decode("utf-8", errors="replace")
        fast = getattr(self._tokenizer, "encode_batch_fast", None)  # tokenizers >= 0.21: no character offsets
        if fast is not None:
            return list(fast([text], add_special_tokens=False)[0].ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode([t for t in tokens if 0 <= t < self.vocab_size], skip_special_tokens=False))


def _hf_tokenizers():
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - tokenizers is a pinned dependency
        raise BigBatchError("the bpe tokenizer needs Hugging Face tokenizers: pip install tokenizers") from exc
    return tokenizers


def is_bpe(name: str) -> bool:
    return name.startswith(BPE_PREFIX)


def bpe_vocab_size(name: str) -> int:
    """The vocabulary size asked for by ``bpe:VOCAB`` (a :class:`ConfigError` when it is not a valid one)."""
    text = name[len(BPE_PREFIX) :].replace("_", "")
    try:
        vocab = int(text)
    except ValueError:
        vocab = 0
    if not BPE_MIN_VOCAB <= vocab <= BPE_MAX_VOCAB:
        raise ConfigError(
            f"tokenizer {name!r}: write bpe:VOCAB with a vocabulary size from {BPE_MIN_VOCAB} to {BPE_MAX_VOCAB:,} "
            "(e.g. bpe:4096)"
        )
    return vocab


def train_bpe(name: str, texts: Iterable[str], show_progress: bool = False) -> BPETokenizer:
    """Train the byte-level BPE ``bpe:VOCAB`` on ``texts`` (streamed: any iterable of strings)."""
    vocab = bpe_vocab_size(name)
    hf = _hf_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = hf.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(name, tokenizer)


TOKENIZER_NAMES = ("byte", "gpt2", "bpe:VOCAB")


def get_tokenizer(name: str, directory: Path | None = None) -> Tokenizer:
    """A tokenizer by name: ``byte``, ``gpt2`` or ``bpe:VOCAB``. ``directory`` is the prepared dataset it belongs
    to, where a tokenizer trained on that data (``bpe:VOCAB``) keeps its ``tokenizer.json``."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenGPT2Tokenizer()
    if is_bpe(name):
        bpe_vocab_size(name)
        if directory is None:
            raise ConfigError(
                f"the {name} tokenizer is trained on the data by bigbatch prepare and kept in the dataset directory; "
                "load it with that directory"
            )
        path = Path(directory) / BPE_FILE
        if not path.is_file():
            raise DataError(
                f"{path} is missing: the {name} tokenizer of this dataset is kept there; re-run bigbatch prepare "
                f"with --tokenizer {name} (or restore the file)"
            )
        return BPETokenizer.from_file(name, path)
    raise ConfigError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZER_NAMES)}")
