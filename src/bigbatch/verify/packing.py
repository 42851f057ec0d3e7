"""A verification batch of packed rows: random documents back to back in rows of ``seq_len`` (their positions
restarting at each), and the same documents each in its own padded row, whose gradient the packed rows must give."""

from __future__ import annotations

import torch

from bigbatch.engine.batch import IGNORE_INDEX

PackedBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs, targets, positions, each (rows, T)
UnpackedBatch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets, each (documents, T)


def packed_documents(
    rows: int, seq_len: int, vocab_size: int, generator: torch.Generator
) -> tuple[PackedBatch, UnpackedBatch]:
    """``rows`` rows filled in turn with documents of random lengths (1 to ``seq_len // 2`` positions) until the next
    one does not fit; the rest of a row is padding (targets -100, positions counted from 0). A random first part
    of each document is a masked prompt (targets -100), so rows and documents hold different valid counts."""
    inputs = torch.zeros(rows, seq_len, dtype=torch.int64)
    targets = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros(rows, seq_len, dtype=torch.int64)
    documents: list[tuple[torch.Tensor, torch.Tensor]] = []
    longest = max(1, seq_len // 2)
    for row in range(rows):
        used = 0
        while True:
            n = int(torch.randint(1, longest + 1, (1,), generator=generator))
            if used + n > seq_len:
                break
            tokens = torch.randint(0, vocab_size, (n + 1,), generator=generator)
            doc_targets = tokens[1:].clone()
            doc_targets[: int(torch.randint(0, n, (1,), generator=generator))] = IGNORE_INDEX  # the prompt
            inputs[row, used : used + n] = tokens[:-1]
            targets[row, used : used + n] = doc_targets
            positions[row, used : used + n] = torch.arange(n)
            documents.append((tokens[:-1], doc_targets))
            used += n
        positions[row, used:] = torch.arange(seq_len - used)  # the padding: a segment of its own
    one_inputs = torch.zeros(len(documents), seq_len, dtype=torch.int64)
    one_targets = torch.full((len(documents), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for index, (doc_inputs, doc_targets) in enumerate(documents):
        one_inputs[index, : len(doc_inputs)] = doc_inputs
        one_targets[index, : len(doc_targets)] = doc_targets
    return (inputs, targets, positions), (one_inputs, one_targets)
