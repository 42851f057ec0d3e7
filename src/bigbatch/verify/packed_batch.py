"""A verification batch of packed rows, read by the training run's own loader: random documents packed by
:class:`~bigbatch.data.documents.DocumentLoader` (``--pack on``), and the same documents each in its own padded
row, built here from the documents alone, whose gradient the packed rows must give. :func:`position_mismatch`
checks the loader's positions against those recomputed from where each document starts in its row."""

from __future__ import annotations

import numpy as np
import torch

from bigbatch.data.documents import DocumentLoader
from bigbatch.data.shards import DocumentShard
from bigbatch.engine.batch import IGNORE_INDEX

PackedBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs, targets, positions, each (rows, T)
UnpackedBatch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets, each (documents, T)

PAD = 0
"""The padding token: no document holds it."""
START = 1
"""Every document's first token and no other: where a row's positions must restart. Documents' other tokens are
drawn from ``2..vocab_size - 1``."""
MIN_VOCAB = 3


def random_documents(rows: int, seq_len: int, vocab_size: int, generator: torch.Generator) -> DocumentShard:
    """Documents that fill about ``rows`` rows of ``seq_len``: row after row, documents of random lengths (1 to
    ``seq_len // 2`` positions) until the next does not fit. Each begins with :data:`START`; a random first part
    of each is a masked prompt, so rows and documents hold different valid counts."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"packed documents need a vocabulary of at least {MIN_VOCAB} tokens, got {vocab_size}")
    tokens: list[torch.Tensor] = []
    mask: list[torch.Tensor] = []
    longest = max(1, seq_len // 2)
    for _ in range(rows):
        used = 0
        while True:
            n = int(torch.randint(1, longest + 1, (1,), generator=generator))  # positions: n + 1 tokens
            if used + n > seq_len:
                break
            document = torch.randint(START + 1, vocab_size, (n + 1,), generator=generator)
            document[0] = START
            trained = torch.ones(n + 1, dtype=torch.uint8)
            trained[1 : 1 + int(torch.randint(0, n, (1,), generator=generator))] = 0  # the prompt's targets
            tokens.append(document)
            mask.append(trained)
            used += n
    lengths = [len(t) for t in tokens]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return DocumentShard(torch.cat(tokens).numpy(), offsets, torch.cat(mask).numpy())


def loader_rows(shard: DocumentShard, rows: int, seq_len: int) -> PackedBatch:
    """The first micro-batch of ``rows`` rows the training loader packs from ``shard`` (``--pack on``, one process,
    the data's order), read as training reads it; rows the documents do not fill are padding."""
    loader = DocumentLoader([shard], rows, seq_len, pad_token=PAD, pack=True)
    batch = loader.next_micro_batch()
    assert batch.positions is not None  # a packing loader gives every row its positions
    return batch.inputs, batch.targets, batch.positions


def fitting_documents(shard: DocumentShard, rows: int, seq_len: int) -> DocumentShard:
    """``shard`` without its last documents, as few as need to go for the loader to pack the rest into at most
    ``rows`` rows."""
    count = len(shard.offsets) - 1
    while count > 1 and DocumentLoader([_first(shard, count)], rows, seq_len, pack=True).n_sequences > rows:
        count -= 1
    return _first(shard, count)


def _first(shard: DocumentShard, count: int) -> DocumentShard:
    end = int(shard.offsets[count])
    mask = None if shard.mask is None else shard.mask[:end]
    return DocumentShard(shard.tokens[:end], shard.offsets[: count + 1], mask)


def one_per_row(shard: DocumentShard, seq_len: int) -> UnpackedBatch:
    """Each document of ``shard`` in its own row of ``seq_len``, padded (targets -100 on padding and masked
    tokens), straight from the documents: what the packed rows must give."""
    count = len(shard.offsets) - 1
    inputs = torch.full((count, seq_len), PAD, dtype=torch.int64)
    targets = torch.full((count, seq_len), IGNORE_INDEX, dtype=torch.int64)
    for index in range(count):
        start, end = int(shard.offsets[index]), int(shard.offsets[index + 1])
        tokens = torch.from_numpy(np.asarray(shard.tokens[start:end], dtype=np.int64))
        document_targets = tokens[1:].clone()
        if shard.mask is not None:
            trained = torch.from_numpy(np.asarray(shard.mask[start + 1 : end], dtype=np.bool_))
            document_targets[~trained] = IGNORE_INDEX
        inputs[index, : len(tokens) - 1] = tokens[:-1]
        targets[index, : len(tokens) - 1] = document_targets
    return inputs, targets


def packed_documents(
    rows: int, seq_len: int, vocab_size: int, generator: torch.Generator
) -> tuple[PackedBatch, UnpackedBatch]:
    """``rows`` rows of random documents (:func:`random_documents`) packed by the training loader, and the same
    documents one per row (:func:`one_per_row`)."""
    shard = fitting_documents(random_documents(rows, seq_len, vocab_size, generator), rows, seq_len)
    return loader_rows(shard, rows, seq_len), one_per_row(shard, seq_len)


def position_mismatch(inputs: torch.Tensor, positions: torch.Tensor) -> str | None:
    """Where the loader's ``positions`` of packed rows differ from those recomputed from the document boundaries
    (0 at each :data:`START` token, one more at each following document token; padding is not compared), said in
    one line; None when they agree."""
    columns = torch.arange(inputs.shape[1]).expand_as(inputs)
    document = inputs != PAD
    starts = torch.where(inputs == START, columns, torch.full_like(columns, -1))
    began = torch.cummax(starts, dim=1).values  # the column of each token's document start, -1 before any
    expected = columns - began
    wrong = document & ((began < 0) | (positions != expected))
    if not bool(wrong.any()):
        return None
    row, column = (int(i) for i in torch.nonzero(wrong)[0])
    if int(began[row, column]) < 0:
        return f"row {row}, column {column} holds a document token before any document starts"
    return (
        f"row {row}, column {column}: the loader gives position {int(positions[row, column])}, the document "
        f"boundaries give {int(expected[row, column])} (its document starts at column {int(began[row, column])})"
    )
