"""Where the training split ends and the validation split begins: the last ``val_fraction`` is validation."""

from __future__ import annotations

SplitRanges = dict[str, tuple[int, int]]
"""``{"train": (start, stop), "val": (start, stop)}``, in that order: half-open ranges of tokens or documents."""


def packed_splits(n_tokens: int, val_fraction: float) -> SplitRanges:
    """Token ranges of a packed stream of ``n_tokens``: the last ``val_fraction`` of the tokens is validation."""
    return _ranges(n_tokens, int(n_tokens * val_fraction))


def document_splits(n_documents: int, val_fraction: float) -> SplitRanges:
    """Document ranges: the last ``val_fraction`` of the documents (rounded) is validation, at least one
    document when ``val_fraction`` is positive and there are two or more."""
    n_val = int(round(n_documents * val_fraction))
    if val_fraction > 0 and n_val == 0 and n_documents > 1:
        n_val = 1
    return _ranges(n_documents, n_val)


def _ranges(total: int, n_val: int) -> SplitRanges:
    boundary = total - n_val
    return {"train": (0, boundary), "val": (boundary, total)}
