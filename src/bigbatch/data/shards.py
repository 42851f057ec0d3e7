"""Token shards on disk: ``.npy`` arrays of uint16 (or uint32) plus a ``meta.json``.

A prepared dataset directory looks like::

    meta.json            tokenizer, vocabulary size, token counts, shard list
    train_000000.npy     1-D uint16 token ids
    val_000000.npy

and in ``documents`` mode, beside each shard, ``.offsets.npy`` (where each document starts), ``.mask.npy`` (the
tokens trained on, when any is masked) and, for rows of answers (preference pairs, KTO), ``.roles.npy`` (each
document's role, :mod:`bigbatch.data.answers`).

``.npy`` is self-describing (dtype and length in its header) and memory-mapped on
read, so a dataset larger than RAM is fine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bigbatch.data.answers import ANSWER_KINDS
from bigbatch.data.tokenizers import BPE_FILE, file_tokenizer_fingerprint, file_tokenizer_path, is_file_tokenizer
from bigbatch.errors import DataError
from bigbatch.files.json_text import from_json, to_json
from bigbatch.settings.choices import RESOLVED_DATA_MODES

META_FILE = "meta.json"
FORMAT_NAME = "bigbatch-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass
class DatasetMeta:
    tokenizer: str
    vocab_size: int
    dtype: str
    shards: dict[str, list[str]]  # split -> shard file names
    tokens: dict[str, int]  # split -> token count
    source: str = ""
    documents: int = 0
    eot_token: int | None = None
    mode: str = "packed"  # or "documents": shards carry document offsets (and masks when masked)
    masked: bool = False  # documents mode: a .mask.npy per shard marks the tokens trained on
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    extra: dict[str, object] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)  # "tokenizer", "data": see data/fingerprint.py

    def to_json(self) -> str:
        return to_json(asdict(self), indent=2) + "\n"

    @property
    def answers(self) -> str:
        """``pairs`` or ``kto`` for a dataset of answers (``extra["answers"]``, with a ``.roles.npy`` per shard),
        ``""`` for ordinary data (and every dataset prepared before answers were)."""
        return str(self.extra.get("answers") or "")

    @classmethod
    def from_file(cls, path: Path) -> DatasetMeta:
        try:
            raw = from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8 (a damaged file)
            raise DataError(f"{path} is not a readable dataset metadata file ({exc}); re-run bigbatch prepare") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise DataError(f"{path} is not a bigbatch dataset (format field missing); re-run bigbatch prepare")
        if raw.get("version") != FORMAT_VERSION:
            raise DataError(
                f"{path} has dataset format version {raw.get('version')}, this bigbatch reads {FORMAT_VERSION}; "
                "re-run bigbatch prepare"
            )
        try:
            meta = cls(**raw)
        except TypeError as exc:
            raise DataError(f"{path} has unexpected fields ({exc}); re-run bigbatch prepare") from exc
        problem = meta._problem()
        if problem:
            raise DataError(f"{path} is malformed: {problem}; re-run bigbatch prepare")
        return meta

    def _problem(self) -> str | None:
        """What is wrong with the field values, or ``None``."""
        if self.dtype not in ("uint16", "uint32"):
            return f"dtype {self.dtype!r} is not uint16 or uint32"
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            return f"vocab_size {self.vocab_size!r} is not a positive integer"
        if not isinstance(self.shards, dict) or not all(
            isinstance(names, list) and all(isinstance(n, str) and "/" not in n for n in names)
            for names in self.shards.values()
        ):
            return "shards must map each split to a list of file names"
        if self.mode not in RESOLVED_DATA_MODES:  # never auto: it is resolved before anything is prepared
            return f"mode {self.mode!r} is not packed or documents"
        if not isinstance(self.tokens, dict) or not all(isinstance(n, int) for n in self.tokens.values()):
            return "tokens must map each split to a token count"
        if self.answers and (self.answers not in ANSWER_KINDS or self.mode != "documents" or not self.masked):
            return f"answers {self.answers!r} needs one of {', '.join(ANSWER_KINDS)} in masked documents mode"
        return None


def document_offsets_name(shard_name: str) -> str:
    """``train_000000.npy`` -> ``train_000000.offsets.npy``: int64 start of each document, then the end."""
    return shard_name.removesuffix(".npy") + ".offsets.npy"


def document_mask_name(shard_name: str) -> str:
    """``train_000000.npy`` -> ``train_000000.mask.npy``: uint8, 1 where the token is trained on as a target."""
    return shard_name.removesuffix(".npy") + ".mask.npy"


def document_roles_name(shard_name: str) -> str:
    """``train_000000.npy`` -> ``train_000000.roles.npy``: int8, each document's role (rows of answers only)."""
    return shard_name.removesuffix(".npy") + ".roles.npy"


@dataclass
class DocumentShard:
    tokens: np.ndarray  # (n_tokens,) token ids
    offsets: np.ndarray  # (n_docs + 1,) int64
    mask: np.ndarray | None  # (n_tokens,) uint8 or None (every token is trained on)
    roles: np.ndarray | None = None  # (n_docs,) int8: each document's role (bigbatch.data.answers); None: no answers


def check_token_range(shards: Iterable[tuple[object, np.ndarray]], vocab_size: int, fix: str) -> None:
    """Raise :class:`DataError` naming the first shard with a token id at or above ``vocab_size``."""
    chunk = 1 << 24  # chunks keep memory flat on huge memory-mapped shards
    for where, array in shards:
        for start in range(0, len(array), chunk):
            top = int(array[start : start + chunk].max(initial=0))
            if top >= vocab_size:
                raise DataError(
                    f"shard {where} holds token id {top}, but the vocabulary has {vocab_size} ids "
                    f"(0..{vocab_size - 1}); {fix}"
                )


def check_requested_tokenizer(meta: DatasetMeta, requested: str, directory: Path | str) -> None:
    """Refuse a ``--tokenizer`` other than ``auto`` that names another tokenizer than the dataset's own: the
    tokens on disk were made by the dataset's tokenizer, and the flag cannot change them. A ``file:PATH`` one is
    compared by content (see ``data/fingerprint.py``): the same file elsewhere is the dataset's tokenizer, another
    file at the same PATH is not."""
    if requested in ("", "auto"):
        return
    if is_file_tokenizer(requested) and is_file_tokenizer(meta.tokenizer):
        wanted = file_tokenizer_fingerprint(file_tokenizer_path(requested))
        if not wanted:
            raise DataError(f"--tokenizer {requested}: {file_tokenizer_path(requested)} is missing; fix the path")
        held = str(meta.fingerprints.get("tokenizer") or "") or file_tokenizer_fingerprint(Path(directory) / BPE_FILE)
        if wanted == held:
            return
        raise DataError(
            f"--tokenizer {requested} contradicts the data: {directory} holds tokens of another tokenizer.json "
            f"(fingerprint {held or 'unknown'}, the file's is {wanted}); drop --tokenizer, or point --data at raw "
            "text to prepare it with this one"
        )
    if requested == meta.tokenizer:
        return
    raise DataError(
        f"--tokenizer {requested} contradicts the data: {directory} holds {meta.tokenizer} tokens; drop --tokenizer "
        f"(or pass --tokenizer {meta.tokenizer}), or point --data at raw text to prepare it with {requested}"
    )


def is_prepared_dataset(path: Path) -> bool:
    return (path / META_FILE).is_file()


class TokenDataset:
    """A prepared dataset directory, shards memory-mapped on demand."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        if not is_prepared_dataset(self.directory):
            raise DataError(f"{self.directory} is not a prepared dataset (no {META_FILE}); run bigbatch prepare first")
        self.meta = DatasetMeta.from_file(self.directory / META_FILE)

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    @property
    def answers(self) -> str:
        """``pairs``, ``kto`` or ``""``: what an objective must read to train on this data
        (:func:`~bigbatch.data.answers.check_answers_for_objective`)."""
        return self.meta.answers

    def shard_arrays(self, split: str) -> list[np.ndarray]:
        """The split's shards as read-only memory maps, in order."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        return [self._open_shard(name) for name in self.meta.shards.get(split, [])]

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse shards holding ids at or above ``vocab_size`` (they would index past the embedding)."""
        shards = (
            (self.directory / name, array)
            for split in SPLITS
            for name, array in zip(self.meta.shards.get(split, []), self.shard_arrays(split), strict=False)
        )
        check_token_range(shards, vocab_size, "re-prepare it with the right tokenizer")

    def document_shards(self, split: str) -> list[DocumentShard]:
        """The split's shards with their document offsets (and masks), for a ``documents`` dataset."""
        if self.meta.mode != "documents":
            raise DataError(f"{self.directory} was prepared in {self.meta.mode} mode, not documents")
        shards = []
        for name, tokens in zip(self.meta.shards.get(split, []), self.shard_arrays(split), strict=False):
            offsets = self._open_shard(document_offsets_name(name), dtype=np.dtype(np.int64))
            if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) <= 0):
                raise DataError(
                    f"document offsets of {self.directory / name} are inconsistent; re-run bigbatch prepare"
                )
            mask = self._open_shard(document_mask_name(name), dtype=np.dtype(np.uint8)) if self.meta.masked else None
            if mask is not None and len(mask) != len(tokens):
                raise DataError(
                    f"the mask of {self.directory / name} does not match its tokens; re-run bigbatch prepare"
                )
            roles = None
            if self.meta.answers:
                roles = self._open_shard(document_roles_name(name), dtype=np.dtype(np.int8))
                if len(roles) != len(offsets) - 1:
                    raise DataError(
                        f"the roles of {self.directory / name} do not match its documents; re-run bigbatch prepare"
                    )
            shards.append(DocumentShard(tokens, offsets, mask, roles))
        return shards

    def _open_shard(self, name: str, dtype: np.dtype | None = None) -> np.ndarray:
        path = self.directory / name
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError as exc:
            raise DataError(f"shard {path} is missing; re-run bigbatch prepare") from exc
        except (ValueError, OSError, EOFError) as exc:
            raise DataError(f"shard {path} is damaged or truncated ({exc}); re-run bigbatch prepare") from exc
        expected = dtype if dtype is not None else np.dtype(self.meta.dtype)
        if array.ndim != 1 or array.dtype != expected:
            raise DataError(
                f"shard {path} holds {array.dtype} with shape {array.shape}, expected 1-D {expected}; "
                "re-run bigbatch prepare"
            )
        return array
