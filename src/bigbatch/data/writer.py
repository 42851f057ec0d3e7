"""A prepared dataset written to disk: shards and ``meta.json`` built under a temporary name, renamed into place
(a failed run leaves nothing half-written)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bigbatch.data.shards import META_FILE, DatasetMeta, document_mask_name, document_offsets_name
from bigbatch.data.split import DocumentSets, TokenPieces
from bigbatch.files.atomic import apply_umask

ShardNames = dict[str, list[str]]
"""Split -> shard file names, in order."""
TokenCounts = dict[str, int]
"""Split -> token count."""


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A new directory beside ``out`` to write the dataset in, renamed to ``out`` (empty or absent) when the
    block ends without an error, and removed when it ends with one (any exception, an interrupt included)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    apply_umask(staging, directory=True)  # mkdtemp makes it 0700; the dataset is the user's, umask applies
    try:
        yield staging
        if out.exists():
            out.rmdir()  # empty, checked by the caller
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_meta(staging: Path, meta: DatasetMeta) -> None:
    (staging / META_FILE).write_text(meta.to_json())


def write_packed(
    staging: Path, stream: np.ndarray, splits: TokenPieces, shard_tokens: int
) -> tuple[ShardNames, TokenCounts]:
    """The token ``stream`` cut into ``splits`` (token ranges; a split's ranges joined in order), each written as
    shards of ``shard_tokens``; one shard in memory at a time."""
    names: ShardNames = {}
    counts: TokenCounts = {}
    for split, pieces in splits.items():
        names[split] = []
        ends = np.cumsum([stop - start for start, stop in pieces], dtype=np.int64)
        length = int(ends[-1]) if len(pieces) else 0
        for i, start in enumerate(range(0, length, shard_tokens)):
            name = f"{split}_{i:06d}.npy"
            np.save(staging / name, _joined(stream, pieces, ends, start, min(start + shard_tokens, length)))
            names[split].append(name)
        counts[split] = length
    return names, counts


def _joined(stream: np.ndarray, pieces: list[tuple[int, int]], ends: np.ndarray, first: int, stop: int) -> np.ndarray:
    """Tokens ``[first, stop)`` of ``pieces`` of ``stream`` laid end to end (``ends``: their cumulative lengths)."""
    parts = []
    index = int(np.searchsorted(ends, first, side="right"))  # the piece holding position ``first``
    position = first
    while position < stop:
        start, _ = pieces[index]
        piece_first = int(ends[index]) - (pieces[index][1] - start)  # where this piece begins in the joined split
        take = min(stop, int(ends[index])) - position
        offset = start + position - piece_first
        parts.append(stream[offset : offset + take])
        position += take
        index += 1
    return np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0])


def write_documents(
    staging: Path,
    stream: np.ndarray,
    lengths: list[int],
    masks: np.ndarray | None,
    splits: DocumentSets,
    shard_tokens: int,
) -> tuple[ShardNames, TokenCounts]:
    """The documents of the token ``stream`` (``lengths`` tokens each) cut into ``splits`` (document indices, in
    order), each written as shards of whole documents that close once they hold ``shard_tokens`` or more tokens;
    with offsets, and with the trained-token mask when ``masks`` (aligned with ``stream``: 1 = trained) is given."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)
    names: ShardNames = {"train": [], "val": []}
    counts: TokenCounts = {"train": 0, "val": 0}
    for split, documents in splits.items():
        docs = [int(i) for i in documents]
        shard_first = 0  # index into docs
        size = 0
        for j, i in enumerate(docs):
            size += lengths[i]
            if size >= shard_tokens:
                _save_document_shard(staging, split, docs[shard_first : j + 1], stream, starts, masks, names)
                shard_first, size = j + 1, 0
        if shard_first < len(docs):
            _save_document_shard(staging, split, docs[shard_first:], stream, starts, masks, names)
        counts[split] = int(sum(int(starts[i + 1] - starts[i]) for i in docs))
    return names, counts


def _save_document_shard(
    staging: Path,
    split: str,
    docs: list[int],
    stream: np.ndarray,
    starts: np.ndarray,
    masks: np.ndarray | None,
    names: ShardNames,
) -> None:
    """Documents ``docs`` (indices, in order) of the token stream as one shard (with offsets, and the mask when
    masked)."""
    name = f"{split}_{len(names[split]):06d}.npy"
    sizes = np.asarray([starts[i + 1] - starts[i] for i in docs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # (n_docs + 1,)
    contiguous = docs == list(range(docs[0], docs[-1] + 1))

    def gathered(values: np.ndarray) -> np.ndarray:
        if contiguous:
            return np.ascontiguousarray(values[starts[docs[0]] : starts[docs[-1] + 1]])
        return np.concatenate([values[starts[i] : starts[i + 1]] for i in docs])

    np.save(staging / name, gathered(stream))
    np.save(staging / document_offsets_name(name), offsets)
    if masks is not None:
        np.save(staging / document_mask_name(name), gathered(masks).astype(np.uint8))  # 1 = trained on as a target
    names[split].append(name)
