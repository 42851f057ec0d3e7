"""Following a bad document: a micro-batch found bad holds documents, and a document longer than a sequence is read
as several windows, which may sit in other micro-batches of the step (on any rank) or in other steps. Leaving out
only the micro-batch found would apply the rest of a bad document. So each document of a bad micro-batch that has
parts elsewhere is measured alone (the micro-batch's forward as it ran, every target but that document's masked
out): when that part is bad the way the micro-batch was (a non-finite loss or gradient, a loss per token or gradient
norm over the spike limits), every micro-batch of the step that holds a part of it is left out too, and its parts
in other steps are named (a rewind leaves them out as well).

Only documents data knows documents (:attr:`~bigbatch.engine.batch.MicroBatch.parts`); a token stream records no
boundaries between them, and its windows stand each for itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bigbatch.engine.batch import IGNORE_INDEX, DocumentPart, MicroBatch, window_starts


@dataclass(frozen=True)
class BadDocument:
    """A document found bad in one micro-batch (``rank``, ``micro``: its index as the step read it), and how."""

    key: str
    shard: int
    start: int
    windows: int
    seq_len: int
    rank: int
    micro: int
    cause: str


def spread_documents(batch: object) -> dict[str, list[DocumentPart]]:
    """The documents of ``batch`` read as more windows than it holds (their parts here, by document key)."""
    parts = getattr(batch, "parts", ())
    by_document: dict[str, list[DocumentPart]] = {}
    for part in parts:
        by_document.setdefault(part.key, []).append(part)
    return {key: held for key, held in by_document.items() if held[0].windows > len({p.window for p in held})}


def alone(batch: MicroBatch, parts: list[DocumentPart]) -> tuple[MicroBatch, int]:
    """``batch`` with every target but those of ``parts`` masked out (its inputs, rows and positions as they were,
    so the forward is the one that ran), and the targets left."""
    targets = torch.full_like(batch.targets, IGNORE_INDEX)
    for part in parts:
        cells = (part.row, slice(part.column, part.column + part.length))
        targets[cells] = batch.targets[cells]
    return replace(batch, targets=targets), int((targets != IGNORE_INDEX).sum())


def describe_parts(document: BadDocument, here: list[tuple[int, int, int]]) -> str:
    """``document shard 0 @ 1,024 (4 windows): windows 1, 2 in rank 0, micro-batch 1; window 3 in rank 0,
    micro-batch 2; windows 0 (shard 0 @ 1,024) in other steps``: where a bad document's parts are, given the
    ``(rank, micro-batch, window)`` of each part this step holds."""
    places: dict[tuple[int, int], list[int]] = {}
    for rank, micro, window in sorted(here):
        places.setdefault((rank, micro), []).append(window)
    said = [f"{_windows(ws)} in rank {rank}, micro-batch {micro}" for (rank, micro), ws in places.items()]
    seen = {window for _, _, window in here}
    starts = window_starts(document.start, document.windows, document.seq_len)
    others = [w for w in range(document.windows) if w not in seen]
    if others:
        at = ", ".join(f"{starts[w]:,}" for w in others[:4]) + (
            f" (+{len(others) - 4} more)" if len(others) > 4 else ""
        )
        said.append(f"{_windows(others)} (shard {document.shard} @ {at}) in other steps")
    name = f"document shard {document.shard} @ {document.start:,} ({document.windows} windows)"
    return f"{name}: " + "; ".join(said)


def _windows(windows: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, windows[:limit])) + (f" (+{len(windows) - limit} more)" if len(windows) > limit else "")
    return ("window " if len(windows) == 1 else "windows ") + shown
