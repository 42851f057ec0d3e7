"""Tokenizers: a byte-level one that needs nothing, GPT-2 BPE through tiktoken, a byte-level BPE trained
on the corpus itself (``bpe:VOCAB``, Hugging Face ``tokenizers``) and kept beside the shards as ``tokenizer.json``,
and a Hugging Face ``tokenizer.json`` brought with a model (``file:PATH``, see :class:`FileTokenizer`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from bigbatch.data.tokenizer_pipeline import continuation_tokenizer, transformers_pipeline
from bigbatch.errors import BigBatchError, ConfigError, DataError
from bigbatch.files.atomic import write_json_atomically, write_text_atomically
from bigbatch.settings.choices import TOKENIZER_NAMES


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


class GPT2Unavailable(BigBatchError):
    """tiktoken's GPT-2 encoding cannot be loaded (not cached, and no network)."""


NO_DOWNLOAD_TOKENIZERS = (
    "--tokenizer bpe:VOCAB (trained on the text, e.g. bpe:8192), file:PATH (a Hugging Face tokenizer.json) or byte"
)


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
            # No other tokenizer here: GPT-2 token shards and checkpoints need GPT-2's ids (see text_tokenizer)
            raise GPT2Unavailable(
                "could not load tiktoken's GPT-2 encoding (it is downloaded on first use and this machine "
                f"seems offline: {type(exc).__name__}); connect once (it is cached), or set TIKTOKEN_CACHE_DIR to a "
                "directory holding a cached copy"
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
        tokenizer.no_truncation()  # a file may ask for either; transformers turns both off for a plain call
        tokenizer.no_padding()
        self.name = name
        self._tokenizer = tokenizer
        self._continuation = continuation_tokenizer(tokenizer)  # None: a piece encodes alike anywhere in a text
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

    def encode_continuation(self, data: bytes) -> list[int]:
        """``encode`` of text that continues a text (a document's later piece, a completion after its prompt):
        without the ``▁`` a SentencePiece-style pipeline puts at the start of a text (the same as ``encode``
        for any other)."""
        if self._continuation is None:
            return self.encode(data)
        return list(self._continuation.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids)

    def decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode([t for t in tokens if 0 <= t < self.vocab_size], skip_special_tokens=False))


def continuation_decoder(tokenizer: Tokenizer, prefix: list[int]) -> Callable[[list[int]], str]:
    """``decode`` of the tokens that follow ``prefix`` (a prompt's): ``decode(prefix + tokens)`` less
    ``decode(prefix)``, so that a decoder which strips the space at the start of a text (SentencePiece-style)
    keeps the one that starts the continuation; ``decode(tokens)`` where the prefix's text is not a prefix of it."""
    head = tokenizer.decode(prefix)

    def decode(tokens: list[int]) -> str:
        whole = tokenizer.decode(prefix + tokens)
        return whole[len(head) :] if whole.startswith(head) else tokenizer.decode(tokens)

    return decode


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


FILE_PREFIX = "file:"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
"""Beside a ``tokenizer.json``: transformers' settings, of which only ``eos_token`` is read here."""
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""End-of-text tokens looked for when no ``tokenizer_config.json`` names one (GPT-2, Llama 3, Llama 2, Gemma)."""


class FileTokenizer(BPETokenizer):
    """A Hugging Face ``tokenizer.json`` brought with a model: ``file:PATH``, where PATH is the file (or the
    directory that holds it), loaded offline with the ``tokenizers`` library.

    It encodes as the model's ``AutoTokenizer`` does: where transformers builds the pipeline of the directory's
    tokenizer class its own way (a Llama-2-style ``LlamaTokenizer``: see ``data/tokenizer_pipeline.py``), the
    text kept is that pipeline, else the file's text as it was read. Its identity is that text, not its path (see
    ``data/fingerprint.py``), and every copy (beside the shards, in the run directory, in a checkpoint) is that
    text, so a copy has the fingerprint of the original, and a file transformers keeps as it is keeps its own
    fingerprint. The end-of-text token is ``eos_token`` of a ``tokenizer_config.json`` beside the file, else the
    first of :data:`EOS_CANDIDATES` in the vocabulary, else none.

    Encoding is :class:`BPETokenizer`'s (no special tokens added, special-token text in a document stays text),
    which also encodes it in prepare's worker processes from :meth:`to_str`; a piece that continues a text
    (:meth:`encode_continuation`) gets no SentencePiece ``▁`` prefix. Lossless for byte-level tokenizers
    (GPT-2, Llama 3); SentencePiece-style ones with byte fallback (Llama 2) read a text's first space as the
    ``▁`` they put there (``" hi"`` encodes as ``"hi"``, as with ``AutoTokenizer``); others (WordPiece, a Unigram
    without byte fallback) may map unknown characters to an unknown token.
    """

    def __init__(self, name: str, tokenizer: Any, text: str | None = None, eos_token: str | None = None) -> None:
        super().__init__(name, tokenizer)
        self._text = text if text is not None else str(tokenizer.to_str())
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.vocab_size, max(ids, default=-1) + 1)  # ids may leave gaps
        self.eot_text: str | None = None
        self.eot_token = None
        for candidate in ([eos_token] if eos_token else []) + list(EOS_CANDIDATES):
            token = tokenizer.token_to_id(candidate)
            if token is not None:  # an eos_token missing from the vocabulary: the candidates decide
                self.eot_text, self.eot_token = candidate, int(token)
                break

    @classmethod
    def from_file(cls, name: str, path: Path) -> FileTokenizer:
        """The tokenizer in ``path`` (a ``tokenizer.json``, in the pipeline transformers encodes it with), with
        the end-of-text token of the ``tokenizer_config.json`` beside it."""
        text = file_tokenizer_text(Path(path))
        return cls.from_str(name, text, read_eos_token(Path(path).parent), where=str(path))

    @classmethod
    def from_str(cls, name: str, text: str, eos_token: str | None = None, where: str = "") -> FileTokenizer:
        try:
            tokenizer = _hf_tokenizers().Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises plain Exceptions on a damaged or foreign file
            detail = (str(exc).splitlines() or [""])[0][:120]
            raise DataError(
                f"{where or name} is not a Hugging Face tokenizer.json that this tokenizers library reads "
                f"({type(exc).__name__}: {detail}); give the tokenizer.json that save_pretrained wrote"
            ) from exc
        return cls(name, tokenizer, text, eos_token)

    def to_str(self) -> str:
        return self._text

    def save(self, path: Path) -> None:
        """``path`` (the text as it was read) and, beside it, a ``tokenizer_config.json`` that names the
        end-of-text token, so a copy loads with the same one."""
        write_text_atomically(Path(path), self._text)
        config = {"eos_token": self.eot_text} if self.eot_text is not None else {}
        write_json_atomically(Path(path).parent / TOKENIZER_CONFIG_FILE, config)


def file_tokenizer_text(path: Path) -> str:
    """The ``tokenizer.json`` text that encodes as the model's ``AutoTokenizer`` does: the file at ``path`` as it
    is, or the pipeline transformers builds for its directory's tokenizer class (see ``data/tokenizer_pipeline.py``:
    a one-line error where that cannot be known or reproduced)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(
            f"cannot read the tokenizer {path} ({type(exc).__name__}); give --tokenizer file:PATH of a Hugging "
            "Face tokenizer.json (or the directory that holds it)"
        ) from exc
    return transformers_pipeline(Path(path), text)


def read_eos_token(directory: Path) -> str | None:
    """``eos_token`` of ``directory/tokenizer_config.json`` (a string, or transformers' ``{"content": ...}``),
    or ``None`` when there is no such file or setting."""
    try:
        config = json.loads((Path(directory) / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # no config (a bare tokenizer.json) or an unreadable one: the candidates decide
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def is_file_tokenizer(name: str) -> bool:
    return name.startswith(FILE_PREFIX)


def carries_tokenizer_json(name: str) -> bool:
    """Whether the tokenizer is a ``tokenizer.json`` (``bpe:VOCAB``, ``file:PATH``): identified by its content,
    kept beside the shards, in the run directory and in checkpoints."""
    return is_bpe(name) or is_file_tokenizer(name)


def file_tokenizer_path(name: str) -> Path:
    """The ``tokenizer.json`` that ``file:PATH`` names (PATH itself, or ``PATH/tokenizer.json`` for a
    directory)."""
    text = name[len(FILE_PREFIX) :]
    if not text:
        raise ConfigError(
            f"tokenizer {name!r}: write file:PATH with the path of a Hugging Face tokenizer.json or of the "
            "directory that holds it"
        )
    path = Path(text).expanduser()
    return path / BPE_FILE if path.is_dir() else path


def file_tokenizer_name(path: Path | str) -> str:
    """``file:`` and the absolute path of ``path``; symbolic links are kept (a Hugging Face cache snapshot links
    to its blobs, and ``tokenizer_config.json`` is beside the link, not beside the blob)."""
    return FILE_PREFIX + os.path.abspath(Path(path).expanduser())


def tokenizer_label(name: str) -> str:
    """A short name for file and directory names: ``bpe4096``; ``file-DIR`` for ``file:.../DIR/tokenizer.json``."""
    if is_file_tokenizer(name):
        path = Path(name[len(FILE_PREFIX) :])
        base = path.parent.name if path.name == BPE_FILE else path.name
        return "file-" + (re.sub(r"[^\w.-]+", "_", base).strip("_") or "tokenizer")
    return re.sub(r"[^\w.-]+", "_", name.replace(":", ""))


def model_dir_tokenizer(directory: Path | str) -> str | None:
    """The tokenizer name (``file:/abs/DIR/tokenizer.json``) of a model directory that holds a
    ``tokenizer.json`` (what ``tokenizer.save_pretrained`` writes), else ``None``."""
    path = Path(directory).expanduser() / BPE_FILE
    return file_tokenizer_name(path) if path.is_file() else None


def check_tokenizer_fits(tokenizer_vocab: int, model_vocab: int, tokenizer: str = "the tokenizer") -> None:
    """Refuse a tokenizer whose ids can reach past the model's vocabulary (a :class:`ConfigError`); a smaller
    tokenizer is fine: models pad their vocabulary (GPT-2 to a multiple, Llama beyond its special tokens)."""
    if tokenizer_vocab > model_vocab:
        raise ConfigError(
            f"{tokenizer} has {tokenizer_vocab:,} tokens but the model's vocabulary is {model_vocab:,}: ids "
            f"{model_vocab:,} and up would have no embedding; use the model's own tokenizer (--tokenizer auto) or a "
            f"model with at least {tokenizer_vocab:,} tokens"
        )


FINGERPRINT_LENGTH = 16  # hex digits kept, as for every fingerprint of data/fingerprint.py


def tokenizer_json_fingerprint(text: str) -> str:
    """The fingerprint of a Hugging Face ``tokenizer.json`` document, independent of its formatting (here, not in
    data/fingerprint.py, so that shards.py can compare tokenizers without importing what reads shards)."""
    try:
        canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except json.JSONDecodeError:
        canonical = text
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:FINGERPRINT_LENGTH]


def file_tokenizer_fingerprint(path: Path) -> str:
    """:func:`tokenizer_json_fingerprint` of what the file ``path`` encodes with (:func:`file_tokenizer_text`: the
    file itself unless transformers builds another pipeline for it); "" when it is missing."""
    if not path.is_file():
        return ""
    return tokenizer_json_fingerprint(file_tokenizer_text(path))


def text_tokenizer(name: str) -> Tokenizer:
    """The tokenizer ``name`` chosen to tokenize raw text (prepare): as :func:`get_tokenizer`, and when GPT-2's
    encoding cannot be loaded its error also names the tokenizers that need no download, which only raw text may
    choose instead (token shards and checkpoints made with GPT-2 hold its ids)."""
    try:
        return get_tokenizer(name)
    except GPT2Unavailable as exc:
        raise GPT2Unavailable(
            f"{exc}; or tokenize the text with one that needs no download: {NO_DOWNLOAD_TOKENIZERS}"
        ) from exc


def get_tokenizer(name: str, directory: Path | None = None) -> Tokenizer:
    """A tokenizer by name: ``byte``, ``gpt2``, ``bpe:VOCAB`` or ``file:PATH``. ``directory`` is the prepared
    dataset it belongs to, where a tokenizer trained on that data (``bpe:VOCAB``) keeps its ``tokenizer.json``,
    and a ``file:PATH`` one its copy (used first: the tokens were made with it, and PATH may have moved)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenGPT2Tokenizer()
    if is_file_tokenizer(name):
        if directory is not None and (Path(directory) / BPE_FILE).is_file():
            return FileTokenizer.from_file(name, Path(directory) / BPE_FILE)
        path = file_tokenizer_path(name)
        if not path.is_file():
            raise DataError(
                f"{path} is missing: the {name} tokenizer is read from there; restore the file or point "
                "--tokenizer file:PATH at its new place"
            )
        return FileTokenizer.from_file(file_tokenizer_name(path), path)
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
