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
from bigbatch.data.split import SplitRanges
from bigbatch.fileperm import apply_umask

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
    staging: Path, stream: np.ndarray, splits: SplitRanges, shard_tokens: int
) -> tuple[ShardNames, TokenCounts]:
    """The token ``stream`` cut into ``splits`` (token ranges), each written as shards of ``shard_tokens``."""
    names: ShardNames = {}
    counts: TokenCounts = {}
    for split, (first, stop) in splits.items():
        tokens = stream[first:stop]
        names[split] = []
        for i, start in enumerate(range(0, len(tokens), shard_tokens)):
            name = f"{split}_{i:06d}.npy"
            np.save(staging / name, np.ascontiguousarray(tokens[start : start + shard_tokens]))
            names[split].append(name)
        counts[split] = int(len(tokens))
    return names, counts


def write_documents(
    staging: Path,
    stream: np.ndarray,
    lengths: list[int],
    prompt_lengths: list[int] | None,
    splits: SplitRanges,
    shard_tokens: int,
) -> tuple[ShardNames, TokenCounts]:
    """The documents of the token ``stream`` (``lengths`` tokens each) cut into ``splits`` (document ranges), each
    written as shards of whole documents that close once they hold ``shard_tokens`` or more tokens; with offsets,
    and with a mask of the prompts when ``prompt_lengths`` is given."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)
    names: ShardNames = {"train": [], "val": []}
    counts: TokenCounts = {"train": 0, "val": 0}
    for split, (first, stop) in splits.items():
        shard_first = first
        size = 0
        for i in range(first, stop):
            size += lengths[i]
            if size >= shard_tokens:
                _save_document_shard(staging, split, shard_first, i + 1, stream, starts, prompt_lengths, names)
                shard_first, size = i + 1, 0
        if shard_first < stop:
            _save_document_shard(staging, split, shard_first, stop, stream, starts, prompt_lengths, names)
        counts[split] = int(starts[stop] - starts[first])
    return names, counts


def _save_document_shard(
    staging: Path,
    split: str,
    first: int,
    stop: int,
    stream: np.ndarray,
    starts: np.ndarray,
    prompt_lengths: list[int] | None,
    names: ShardNames,
) -> None:
    """Documents ``first..stop-1`` of the token stream as one shard (with offsets, and the mask when masked)."""
    name = f"{split}_{len(names[split]):06d}.npy"
    offsets = (starts[first : stop + 1] - starts[first]).astype(np.int64)  # (n_docs + 1,)
    np.save(staging / name, np.ascontiguousarray(stream[starts[first] : starts[stop]]))
    np.save(staging / document_offsets_name(name), offsets)
    if prompt_lengths is not None:
        mask = np.ones(int(offsets[-1]), dtype=np.uint8)  # 1 = trained on as a target
        for start, i in zip(offsets[:-1], range(first, stop), strict=False):
            mask[start : start + prompt_lengths[i]] = 0
        np.save(staging / document_mask_name(name), mask)
    names[split].append(name)
