"""The reader a dataset's split needs, and what every reader offers.

A ``packed`` dataset is read as an endless token stream (:mod:`bigbatch.data.stream`), a ``documents`` one a
document per sequence with epochs (:mod:`bigbatch.data.documents`), and a dataset of answers (preference pairs, KTO
rows) as whole groups of documents per micro-batch (:mod:`bigbatch.data.answer_groups`); :func:`loader_for` picks
among them.
Whichever it is, the trainer sees a :class:`ResumableLoader`: the step assembler's micro-batch source plus a
position it can save, restore and rewind, which is what makes a resumed run continue bitwise.
"""

from __future__ import annotations

from typing import Any, Protocol

from bigbatch.data.answer_groups import AnswerGroupLoader
from bigbatch.data.dataset import Dataset
from bigbatch.data.documents import DocumentLoader
from bigbatch.data.stream import ShuffledTokenStreamLoader, TokenStreamLoader
from bigbatch.engine.batch import MicroBatchSource


class ResumableLoader(MicroBatchSource, Protocol):
    """A rank's reader of micro-batches (:class:`~bigbatch.engine.batch.MicroBatchSource`) whose position is
    saved in each checkpoint: ``state_dict()`` is the same on every rank, ``load_state_dict`` puts the reader
    back there, ``reset`` at the start of the split."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def reset(self) -> None: ...


def loader_for(
    dataset: Dataset,
    split: str,
    micro_batch: int,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
    name: str = "",
    long_documents: str = "split",
    shuffle: bool = False,
    seed: int = 0,
    pack: bool = False,
) -> TokenStreamLoader | DocumentLoader | AnswerGroupLoader:
    """The reader a dataset's split needs: one document per sequence for a ``documents`` dataset (padded
    with its end-of-text token; documents longer than a sequence by ``long_documents``), whole groups of documents
    for a dataset of answers (``dataset.answers``; ``long_documents`` does not apply: every document must fit a
    row), else the token stream.
    ``shuffle``: a seeded order per epoch (packed: of ``T``-token windows, see :class:`ShuffledTokenStreamLoader`;
    documents: of the epoch's sequences), else the order of the data. ``pack``: a documents dataset's sequences
    packed into rows (see :class:`DocumentLoader`); a token stream holds no padding to pack away and ignores it."""
    name = name or split
    if dataset.meta.mode == "documents" and dataset.meta.answers:
        return AnswerGroupLoader(
            dataset.document_shards(split),
            micro_batch,
            seq_len,
            rank,
            world_size,
            pad_token=dataset.meta.eot_token or 0,
            name=name,
            shuffle=shuffle,
            seed=seed,
            pack=pack,
            answers=dataset.meta.answers,
        )
    if dataset.meta.mode == "documents":
        pad = dataset.meta.eot_token or 0
        shards = dataset.document_shards(split)
        return DocumentLoader(
            shards,
            micro_batch,
            seq_len,
            rank,
            world_size,
            pad_token=pad,
            name=name,
            long_documents=long_documents,
            shuffle=shuffle,
            seed=seed,
            pack=pack,
        )
    if shuffle:
        return ShuffledTokenStreamLoader(
            dataset.shard_arrays(split), micro_batch, seq_len, rank, world_size, name, seed
        )
    return TokenStreamLoader(dataset.shard_arrays(split), micro_batch, seq_len, rank, world_size, name=name)
