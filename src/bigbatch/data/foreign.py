"""Token shards written by other GPT-2 training code, read where they are (no conversion, no copy).

Two formats, both uint16 GPT-2 token ids (vocabulary 50257) in one token stream per file:

* **build-nanogpt** ``.npy`` (``fineweb.py``): a directory of NumPy arrays such as
  ``edufineweb_train_000001.npy`` and ``edufineweb_val_000000.npy``.
* **llm.c / modded-nanogpt** ``.bin``: a header of 256 int32 (``header[0]`` = 20240520, ``header[1]`` = 1,
  ``header[2]`` = number of tokens), then the tokens; memory-mapped after the 1024-byte header.

``--data`` names a directory (without bigbatch's ``meta.json``) holding such files, one such file, or a glob
that matches only such files. Files whose name contains ``val`` form the validation split, the rest the
training split, each in name order. One format at a time: a mix is an error.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import numpy as np

from bigbatch.data.shards import (
    SPLITS,
    DatasetMeta,
    DocumentShard,
    check_token_range,
    is_prepared_dataset,
)
from bigbatch.errors import DataError

GPT2_VOCAB_SIZE = 50257
GPT2_EOT_TOKEN = 50256
BIN_MAGIC = 20240520
BIN_VERSION = 1
BIN_HEADER_INTS = 256
BIN_HEADER_BYTES = BIN_HEADER_INTS * 4
FORMATS = {".npy": "build-nanogpt .npy", ".bin": "llm.c .bin"}
"""File suffix -> format name."""


def foreign_files(data: str | Path) -> list[Path] | None:
    """The token shard files ``data`` names (a directory, a file or a glob), sorted, or ``None`` when ``data``
    is not foreign token data (raw text, a bigbatch dataset, ``builtin``, nothing).

    Shards of bigbatch's own layout are refused, never read as foreign GPT-2 tokens: a file inside a prepared
    dataset, or a prepared dataset whose ``meta.json`` is lost (its tokenizer and vocabulary went with it)."""
    files = _token_files(data)
    if files:
        refuse_bigbatch_layout(files)
    return files


OWN_SHARD = re.compile(r"^(train|val)_\d{6}(\.offsets|\.mask|\.roles)?\.npy$")
"""The shard names ``bigbatch prepare`` writes."""


def refuse_bigbatch_layout(files: list[Path]) -> None:
    """Raise :class:`DataError` when ``files`` are shards of a bigbatch dataset rather than foreign token shards."""
    for parent in sorted({p.parent for p in files}):
        if is_prepared_dataset(parent):
            raise DataError(
                f"{files[0]} is a shard of the bigbatch dataset {parent}; point --data at the directory {parent}"
            )
    if all(OWN_SHARD.match(p.name) for p in files):
        parent = files[0].parent
        raise DataError(
            f"{parent} holds shards in bigbatch's own layout ({files[0].name}, ...) but no meta.json: a prepared "
            "dataset whose metadata was lost, not GPT-2 token shards (its tokenizer and vocabulary are unknown); "
            "restore meta.json, or run bigbatch prepare on the original text into a new directory (shards that "
            "really are GPT-2 tokens: rename them, e.g. data_train_000000.npy)"
        )


def _token_files(data: str | Path) -> list[Path] | None:
    text = str(data)
    if text == "builtin":
        return None
    path = Path(text).expanduser()
    if path.is_dir():
        if is_prepared_dataset(path):
            return None
        files = sorted(p for p in path.iterdir() if _is_token_file(p))
        return files or None
    if path.is_file():
        return [path] if _is_token_file(path) else None
    if glob.has_magic(text):
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(text), recursive=True) if Path(p).is_file())
        shards = [p for p in matches if _is_token_file(p)]
        if not shards:
            return None
        others = [p for p in matches if not _is_token_file(p)]
        if others:
            raise DataError(
                f"the pattern {text!r} matches token shards ({shards[0].name}, ...) and other files "
                f"({others[0].name}, ...); narrow it to the shards, e.g. {shards[0].parent}/*{shards[0].suffix}"
            )
        return shards
    return None


def _is_token_file(path: Path) -> bool:
    return path.suffix in FORMATS and not path.name.startswith(".") and path.is_file()


def split_of(path: Path) -> str:
    """``val`` when the file name contains ``val``, else ``train``."""
    return "val" if "val" in path.name.lower() else "train"


class ForeignDataset:
    """Foreign token shards with the interface the trainer uses from :class:`~bigbatch.data.shards.TokenDataset`.

    Every file's header is checked when the dataset is opened, so a damaged file fails before training starts.
    """

    def __init__(self, source: str | Path, files: list[Path] | None = None) -> None:
        self.source = str(source)
        found = files if files is not None else foreign_files(self.source)
        if not found:
            raise DataError(
                f"{self.source} holds no token shards (.npy from build-nanogpt or .bin from llm.c); "
                "point --data at them, or at raw text to prepare"
            )
        suffixes = sorted({p.suffix for p in found})
        if len(suffixes) > 1:
            examples = ", ".join(next(p.name for p in found if p.suffix == s) for s in suffixes)
            raise DataError(
                f"{self.source} mixes {' and '.join(FORMATS[s] for s in suffixes)} token shards ({examples}); "
                "use one format: move the others away or pass a glob such as DIR/*.bin"
            )
        self.suffix = suffixes[0]
        self.format = FORMATS[self.suffix]
        source_path = Path(self.source).expanduser()
        self.directory = source_path if source_path.is_dir() else Path(os.path.commonpath([p.parent for p in found]))
        self._files: dict[str, list[Path]] = {split: [p for p in found if split_of(p) == split] for split in SPLITS}
        if not self._files["train"]:
            raise DataError(
                f"{self.source} holds no training shards: the name of every file ({found[0].name}, ...) contains "
                "'val'; training shards are the files whose name does not"
            )
        self._lengths = {path: self._token_count(path) for path in found}
        self.meta = DatasetMeta(
            tokenizer="gpt2",
            vocab_size=GPT2_VOCAB_SIZE,
            dtype="uint16",
            shards={split: [os.path.relpath(p, self.directory) for p in self._files[split]] for split in SPLITS},
            tokens={split: sum(self._lengths[p] for p in self._files[split]) for split in SPLITS},
            source=self.source,
            documents=0,
            eot_token=GPT2_EOT_TOKEN,
            mode="packed",
            extra={"format": self.format},
        )

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    @property
    def answers(self) -> str:
        return ""  # a token stream: no answers

    def shard_paths(self, split: str) -> list[Path]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        return list(self._files[split])

    def shard_arrays(self, split: str) -> list[np.ndarray]:
        """The split's shards as read-only 1-D uint16 memory maps, in name order."""
        return [self._open(path) for path in self.shard_paths(split)]

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse shards holding ids at or above ``vocab_size`` (they would index past the embedding)."""
        shards = (
            (path, array)
            for split in SPLITS
            for path, array in zip(self._files[split], self.shard_arrays(split), strict=True)
        )
        check_token_range(shards, vocab_size, "these are not GPT-2 tokens, or the model's vocabulary is too small")

    def document_shards(self, split: str) -> list[DocumentShard]:
        raise DataError(
            f"{self.source} holds {self.format} token shards, one packed token stream without document boundaries; "
            "--data-mode documents needs raw text (bigbatch prepares it), so use --data-mode packed"
        )

    # ------------------------------------------------------------------ reading

    def _token_count(self, path: Path) -> int:
        if self.suffix == ".bin":
            return read_bin_header(path)
        return len(self._open_npy(path))

    def _open(self, path: Path) -> np.ndarray:
        if self.suffix == ".npy":
            return self._open_npy(path)
        count = self._lengths[path] if path in self._lengths else read_bin_header(path)
        if count == 0:
            return np.zeros(0, dtype=np.uint16)
        try:
            return np.memmap(path, dtype=np.uint16, mode="r", offset=BIN_HEADER_BYTES, shape=(count,))
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {path} ({exc}); check the file and its permissions") from exc

    @staticmethod
    def _open_npy(path: Path) -> np.ndarray:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError as exc:
            raise DataError(f"token shard {path} is missing; check --data") from exc
        except (ValueError, OSError, EOFError) as exc:
            raise DataError(
                f"{path} is not a readable .npy token shard ({exc}); it is truncated or damaged: regenerate it "
                "(build-nanogpt's fineweb.py) or re-download it"
            ) from exc
        if array.ndim != 1 or array.dtype != np.uint16:
            raise DataError(
                f"{path} holds {array.dtype} with shape {array.shape}, expected 1-D uint16 GPT-2 tokens "
                "(as build-nanogpt's fineweb.py writes them); convert it with np.save(path, tokens.astype(np.uint16))"
            )
        return array


def read_bin_header(path: Path) -> int:
    """The token count of an llm.c ``.bin`` token file, after checking its header and size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            raw = handle.read(BIN_HEADER_BYTES)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}; check the path and its permissions") from exc
    fix = "regenerate it with the llm.c / modded-nanogpt data scripts or re-download it"
    if len(raw) < BIN_HEADER_BYTES:
        raise DataError(
            f"{path} is {size} bytes, shorter than the {BIN_HEADER_BYTES}-byte llm.c header: it is truncated or not "
            f"a token file; {fix}"
        )
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic != BIN_MAGIC:
        raise DataError(
            f"{path} has the wrong magic number {magic} (an llm.c token file starts with {BIN_MAGIC}): it is not "
            f"an llm.c .bin token file; {fix}, or point --data elsewhere"
        )
    if version != BIN_VERSION:
        raise DataError(
            f"{path} has llm.c token format version {version}, bigbatch reads version {BIN_VERSION} (uint16 GPT-2 "
            f"tokens); {fix} with GPT-2 tokens"
        )
    expected = BIN_HEADER_BYTES + 2 * count
    if count < 0 or size != expected:
        held = (size - BIN_HEADER_BYTES) / 2
        held_text = f"{int(held):,}" if held == int(held) else f"{held:,.1f}"
        raise DataError(
            f"{path} holds {held_text} tokens, header says {count:,} (file is {size:,} bytes, expected {expected:,}): "
            f"it is truncated or damaged; {fix}"
        )
    return count
