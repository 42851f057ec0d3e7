"""Rows of answers prepared: each row's group of documents tokenized into a stream file as it comes, the rows split
into train and validation, and each split written as shards of whole groups with every document's role.

* **The split** is drawn over rows, not documents (:func:`~bigbatch.data.split.document_splits` of the rows, the
  same seeded rule documents follow), so a group's documents are never parted between train and validation.
* **A KTO row's KL document** is made here, once the split is known: row ``i``'s prompt tokens (everything before
  its answer, as rendered) followed by row ``i + 1``'s answer tokens and what follows them (with their trained
  mask), in the split's order, the last row taking the first row's (the mismatched completion TRL's KTO pairs a
  prompt with, made from the tokens as TRL makes it). A split of one row pairs that row with its own completion.
  The KL document may be longer than the row's own; the loader cuts it to a row (it is read for its reference
  point only).
* **Shards** close at a group's end once they hold ``shard_tokens`` or more tokens, so a group never straddles two
  shards; beside each shard its offsets, its trained mask and its roles (``.roles.npy``, int8), all written in the
  staging directory that becomes the dataset only when everything is written (:mod:`bigbatch.data.writer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bigbatch.data.answer_encode import AnswerAudit, AnswerEncoder
from bigbatch.data.answers import KTO, ROLE_KL
from bigbatch.data.corpus import Document
from bigbatch.data.corpus_progress import CorpusProgress
from bigbatch.data.shards import document_mask_name, document_offsets_name, document_roles_name
from bigbatch.data.split import document_splits
from bigbatch.data.writer import ShardNames, TokenCounts
from bigbatch.errors import DataError
from bigbatch.progress import plural

STREAM_FILE = ".answers.tokens.tmp"
MASK_FILE = ".answers.mask.tmp"


@dataclass
class PreparedAnswers:
    """What :func:`prepare_answers` wrote, and what it found."""

    shard_names: ShardNames
    token_counts: TokenCounts
    lengths: list[int]  # tokens of each document written, every split (KL documents included)
    masked: list[int]  # of those, the tokens that are not trained targets
    audit: AnswerAudit
    n_bytes: int = 0  # text read
    seconds: float = 0.0  # tokenizing


@dataclass
class _Stream:
    """The groups tokenized so far, laid end to end in the stream file: per document its length, where its answer
    begins and its role; per group its first document."""

    lengths: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    roles: list[int] = field(default_factory=list)
    group_first: list[int] = field(default_factory=lambda: [0])  # (groups + 1,) documents before each group
    n_bytes: int = 0


def prepare_answers(
    documents: Callable[[], Iterable[Document]],
    encoder: AnswerEncoder,
    staging: Path,
    dtype: np.dtype,
    val_fraction: float,
    shard_tokens: int,
    source: str,
    total_bytes: int | None = None,
) -> PreparedAnswers:
    """Every usable row of ``documents`` tokenized by ``encoder`` and written to ``staging`` as shards (see the
    module's note); a source without a single usable row is refused."""
    started = time.perf_counter()
    stream_path, mask_path = staging / STREAM_FILE, staging / MASK_FILE
    found = _tokenize(documents, encoder, stream_path, mask_path, started, total_bytes)
    seconds = time.perf_counter() - started
    groups = len(found.group_first) - 1
    if not groups:
        audit = encoder.audit
        dropped = sum(audit.bad.values())
        raise DataError(
            f"the corpus {source} holds no usable row of answers ({plural(audit.rows, 'row')} read, {dropped:,} bad "
            f"and {audit.too_long:,} too long left out); fix the rows, or raise --seq-len"
        )
    splits = document_splits(groups, val_fraction)  # rows held out at random (seeded): groups stay whole
    stream = np.memmap(stream_path, dtype=dtype, mode="r")
    masks = np.memmap(mask_path, dtype=np.uint8, mode="r")
    try:
        writer = _ShardWriter(staging, shard_tokens, dtype)
        for split, rows in splits.items():
            _write_split(writer, split, rows.tolist(), found, stream, masks, encoder.audit.kind)
    finally:
        del stream, masks
    stream_path.unlink()
    mask_path.unlink()
    return PreparedAnswers(
        writer.names, writer.counts, writer.lengths, writer.masked, encoder.audit, found.n_bytes, seconds
    )


def _tokenize(
    documents: Callable[[], Iterable[Document]],
    encoder: AnswerEncoder,
    stream_path: Path,
    mask_path: Path,
    started: float,
    total_bytes: int | None,
) -> _Stream:
    found = _Stream()
    with ExitStack() as stack:
        progress = stack.enter_context(CorpusProgress("tokenized", started, total_bytes=total_bytes))
        stream_file = stack.enter_context(open(stream_path, "wb"))
        mask_file = stack.enter_context(open(mask_path, "wb"))
        for group in encoder.groups(documents):
            for document in group.documents:
                stream_file.write(document.ids.tobytes())
                mask_file.write(document.mask.astype(np.uint8).tobytes())
                found.lengths.append(len(document.ids))
                found.starts.append(document.start)
            found.roles.extend(group.row.roles)
            found.group_first.append(len(found.lengths))
            found.n_bytes += group.row.size()
            progress.update(len(found.group_first) - 1, found.n_bytes)
    return found


def _write_split(
    writer: _ShardWriter,
    split: str,
    rows: list[int],
    found: _Stream,
    stream: np.ndarray,
    masks: np.ndarray,
    kind: str,
) -> None:
    """The split's groups in row order; a KTO row followed by its KL document (see the module's note)."""
    offsets = np.concatenate([[0], np.cumsum(np.asarray(found.lengths, dtype=np.int64))]).astype(np.int64)

    def document(index: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        first, stop = int(offsets[index]) + start, int(offsets[index + 1])
        return np.asarray(stream[first:stop]), np.asarray(masks[first:stop])

    writer.begin(split)
    for k, row in enumerate(rows):
        first, stop = found.group_first[row], found.group_first[row + 1]
        group = [(*document(i), found.roles[i]) for i in range(first, stop)]
        if kind == KTO:
            following = found.group_first[rows[(k + 1) % len(rows)]]  # the next row's completion, wrapping
            prompt_ids, _ = document(first)
            prompt_ids = prompt_ids[: found.starts[first]]
            answer_ids, answer_mask = document(following, found.starts[following])
            kl_ids = np.concatenate([prompt_ids, answer_ids])
            kl_mask = np.concatenate([np.zeros(len(prompt_ids), dtype=np.uint8), answer_mask])
            group.append((kl_ids, kl_mask, ROLE_KL))
        writer.add_group(group)
    writer.end()


class _ShardWriter:
    """Groups of documents written as shards that close at a group's end once they hold ``shard_tokens``."""

    def __init__(self, staging: Path, shard_tokens: int, dtype: np.dtype) -> None:
        self.staging = staging
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self.names: ShardNames = {"train": [], "val": []}
        self.counts: TokenCounts = {"train": 0, "val": 0}
        self.lengths: list[int] = []
        self.masked: list[int] = []
        self._split = "train"
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._roles: list[int] = []
        self._size = 0

    def begin(self, split: str) -> None:
        self._split = split

    def add_group(self, documents: list[tuple[np.ndarray, np.ndarray, int]]) -> None:
        for ids, mask, role in documents:
            self._tokens.append(ids)
            self._masks.append(mask)
            self._roles.append(role)
            self._size += len(ids)
            self.lengths.append(len(ids))
            self.masked.append(len(ids) - int(mask.sum()))
        if self._size >= self.shard_tokens:
            self._flush()

    def end(self) -> None:
        if self._tokens:
            self._flush()

    def _flush(self) -> None:
        split = self._split
        name = f"{split}_{len(self.names[split]):06d}.npy"
        sizes = np.asarray([len(t) for t in self._tokens], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # (n_docs + 1,)
        np.save(self.staging / name, np.concatenate(self._tokens).astype(self.dtype))
        np.save(self.staging / document_offsets_name(name), offsets)
        np.save(self.staging / document_mask_name(name), np.concatenate(self._masks).astype(np.uint8))
        np.save(self.staging / document_roles_name(name), np.asarray(self._roles, dtype=np.int8))
        self.names[split].append(name)
        self.counts[split] += int(offsets[-1])
        self._tokens, self._masks, self._roles, self._size = [], [], [], 0
