"""What a dataset offers the loaders, training and evaluation, and :func:`open_dataset`, which tells the kinds
apart: a directory prepared by bigbatch (:class:`~bigbatch.data.shards.TokenDataset`) or foreign token shards
read where they are (:class:`~bigbatch.data.foreign.ForeignDataset`)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from bigbatch.data.foreign import ForeignDataset, foreign_files
from bigbatch.data.shards import DatasetMeta, DocumentShard, TokenDataset, is_prepared_dataset


class Dataset(Protocol):
    """A tokenized dataset with a ``train`` and a ``val`` split."""

    meta: DatasetMeta  # tokenizer, vocabulary, token counts, mode, fingerprints
    directory: Path  # where its files are

    @property
    def vocab_size(self) -> int: ...

    @property
    def answers(self) -> str:
        """``pairs`` (preference pairs), ``kto`` (KTO rows) or ``""`` (ordinary data): the answers an objective
        must read to train on it (:func:`~bigbatch.data.answers.check_answers_for_objective`)."""
        ...

    def shard_arrays(self, split: str) -> list[np.ndarray]:
        """The split's token shards as read-only 1-D memory maps, in order."""
        ...

    def document_shards(self, split: str) -> list[DocumentShard]:
        """The split's shards with their document offsets (and masks); a :class:`DataError` unless the
        dataset was prepared in ``documents`` mode."""
        ...

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse shards holding ids at or above ``vocab_size`` (a :class:`DataError`)."""
        ...


def open_dataset(directory: Path | str) -> Dataset:
    """The dataset ``directory`` names: a directory prepared by bigbatch, or foreign token shards read as they
    are (build-nanogpt ``.npy`` or llm.c ``.bin``: a directory without ``meta.json``, a file or a glob)."""
    if not is_prepared_dataset(Path(directory)):
        files = foreign_files(directory)
        if files:
            return ForeignDataset(directory, files)
    return TokenDataset(directory)
