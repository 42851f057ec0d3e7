"""Which documents are held out for validation: a seeded random set of them, not the tail of the sorted list.

The tail of a sorted list of files is rarely like the rest (the last author, the last year, the last module):
validation on it measures something else than the training data. So validation is drawn at random, with a
fixed seed (:data:`SPLIT_SEED`), from the documents:

* packed data: documents are taken whole in a seeded random order while they fit in the validation share
  (``int(tokens x val_fraction)`` tokens exactly); what is still missing then is the tail of the first document
  that did not fit, so at most one document is cut in two. A single text (one file, e.g. tiny Shakespeare)
  therefore keeps the usual split of such a corpus: its last ``val_fraction`` of tokens is validation.
* documents mode: ``round(documents x val_fraction)`` documents (at least one of two or more when
  ``val_fraction`` is positive) chosen at random.

Each split keeps the documents in the order of the data. :data:`SPLIT_RULE` names the rule; it is part of the
prepared-data cache key, so data prepared under another rule is prepared again, not reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SPLIT_RULE = "random-documents-v1"
SPLIT_SEED = 1337

TokenPieces = dict[str, list[tuple[int, int]]]
"""``{"train": [...], "val": [...]}``: half-open token ranges of the stream, in stream order."""
DocumentSets = dict[str, np.ndarray]
"""``{"train": ..., "val": ...}``: sorted document indices."""


def document_order(n_documents: int, seed: int = SPLIT_SEED) -> np.ndarray:
    return np.random.Generator(np.random.PCG64(seed)).permutation(n_documents)


def packed_splits(lengths: Sequence[int], val_fraction: float, seed: int = SPLIT_SEED) -> TokenPieces:
    """Token ranges of the stream of documents of ``lengths`` tokens each, laid end to end (see the module)."""
    sizes = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(starts[-1])
    missing = int(total * val_fraction)
    held: list[tuple[int, int]] = []
    first_too_long = None
    for doc in document_order(len(sizes), seed).tolist() if missing else []:
        size = int(sizes[doc])
        if size == 0:
            continue
        if size <= missing:
            held.append((int(starts[doc]), int(starts[doc + 1])))
            missing -= size
        elif first_too_long is None:
            first_too_long = doc
        if missing == 0:
            break
    if missing:
        assert first_too_long is not None  # the documents hold more than the validation share
        held.append((int(starts[first_too_long + 1]) - missing, int(starts[first_too_long + 1])))
    held.sort()
    train, position = [], 0
    for start, stop in held:
        if start > position:
            train.append((position, start))
        position = stop
    if position < total:
        train.append((position, total))
    return {"train": train, "val": held}


def document_splits(n_documents: int, val_fraction: float, seed: int = SPLIT_SEED) -> DocumentSets:
    """Document indices of each split: ``round(n_documents x val_fraction)`` documents chosen at random are
    validation, at least one when ``val_fraction`` is positive and there are two or more."""
    n_val = int(round(n_documents * val_fraction))
    if val_fraction > 0 and n_val == 0 and n_documents > 1:
        n_val = 1
    val = np.zeros(n_documents, dtype=bool)
    val[document_order(n_documents, seed)[:n_val]] = True
    return {"train": np.flatnonzero(~val), "val": np.flatnonzero(val)}
