"""Tokenize text into a prepared dataset directory (shards + meta.json)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bigbatch.data.corpus import BUILTIN, read_documents, resolve_source
from bigbatch.data.shards import (
    META_FILE,
    DatasetMeta,
    document_mask_name,
    document_offsets_name,
    is_prepared_dataset,
    token_dtype,
)
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.errors import ConfigError, DataError, require_creatable_dir

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 100_000_000


MODES = ("packed", "documents")


def prepare_dataset(
    source: str,
    out_dir: Path | str,
    tokenizer_name: str = "byte",
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    mode: str = "packed",
) -> DatasetMeta:
    """Tokenize ``source`` into ``out_dir``.

    ``packed``: documents are tokenized in sorted file order and joined (with the
    tokenizer's end-of-text token where it has one) into one stream; the last
    ``val_fraction`` of the stream becomes the validation split.

    ``documents``: each document stays a unit (one sequence when training, cut to
    the sequence length and padded); shards store document offsets beside the
    tokens, a ``.mask.npy`` marks the tokens to train on when any document has a
    masked prompt, and the last ``val_fraction`` of the documents is validation.

    The directory is built under a temporary name and renamed into place, so a
    failed run leaves nothing half-written; an existing non-empty ``out_dir`` is
    never overwritten.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be positive, got {shard_tokens}")
    if mode not in MODES:
        raise ConfigError(f"unknown data mode {mode!r}; choose one of: {', '.join(MODES)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} already exists and is not empty; choose a new --out or remove it first")
    require_creatable_dir(out, "dataset directory")

    tokenizer = get_tokenizer(tokenizer_name)
    files = resolve_source(source)
    started = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    docs: list[np.ndarray] = []
    prompt_lengths: list[int] = []
    n_bytes = 0
    for doc in read_documents(files):
        prompt_ids = tokenizer.encode(doc.prompt) if doc.prompt else []
        ids = prompt_ids + tokenizer.encode(doc.data)
        if not ids:
            continue
        if tokenizer.eot_token is not None:
            ids.append(tokenizer.eot_token)
        docs.append(np.asarray(ids, dtype=dtype))
        prompt_lengths.append(len(prompt_ids))
        n_bytes += len(doc.data) + len(doc.prompt)
    if not docs:
        raise DataError(f"the corpus {source} holds no text; point --data at non-empty text files")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if mode == "packed":
            shard_names, token_counts = _write_packed(staging, docs, val_fraction, shard_tokens)
            masked = False
        else:
            masked = any(prompt_lengths)
            shard_names, token_counts = _write_documents(
                staging, docs, prompt_lengths if masked else None, val_fraction, shard_tokens
            )
        meta = DatasetMeta(
            tokenizer=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            dtype=dtype.name,
            shards=shard_names,
            tokens=token_counts,
            source=source,
            documents=len(docs),
            eot_token=tokenizer.eot_token,
            mode=mode,
            masked=masked,
        )
        (staging / META_FILE).write_text(meta.to_json())
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - started
    log.info(
        "prepared %s: %d documents, %.1f MB of text -> %s train + %s val tokens (%s, %s) in %.1fs (%.1f MB/s)",
        out, len(docs), n_bytes / 1e6, f"{meta.tokens['train']:,}", f"{meta.tokens['val']:,}",
        tokenizer.name, mode, elapsed, n_bytes / 1e6 / max(elapsed, 1e-9),
    )
    return meta


def _write_packed(
    staging: Path, docs: list[np.ndarray], val_fraction: float, shard_tokens: int
) -> tuple[dict[str, list[str]], dict[str, int]]:
    stream = np.concatenate(docs)
    n_val = int(len(stream) * val_fraction)
    splits = {"train": stream[: len(stream) - n_val], "val": stream[len(stream) - n_val :]}
    names: dict[str, list[str]] = {}
    for split, tokens in splits.items():
        names[split] = []
        for i, start in enumerate(range(0, len(tokens), shard_tokens)):
            name = f"{split}_{i:06d}.npy"
            np.save(staging / name, np.ascontiguousarray(tokens[start : start + shard_tokens]))
            names[split].append(name)
    return names, {split: int(len(tokens)) for split, tokens in splits.items()}


def _write_documents(
    staging: Path,
    docs: list[np.ndarray],
    prompt_lengths: list[int] | None,
    val_fraction: float,
    shard_tokens: int,
) -> tuple[dict[str, list[str]], dict[str, int]]:
    n_val = int(round(len(docs) * val_fraction))
    if val_fraction > 0 and n_val == 0 and len(docs) > 1:
        n_val = 1
    boundary = len(docs) - n_val
    names: dict[str, list[str]] = {"train": [], "val": []}
    counts: dict[str, int] = {"train": 0, "val": 0}
    for split, indices in (("train", range(0, boundary)), ("val", range(boundary, len(docs)))):
        shard: list[int] = []
        size = 0
        for i in indices:
            shard.append(i)
            size += len(docs[i])
            if size >= shard_tokens:
                _save_document_shard(staging, split, len(names[split]), shard, docs, prompt_lengths, names)
                shard, size = [], 0
        if shard:
            _save_document_shard(staging, split, len(names[split]), shard, docs, prompt_lengths, names)
        counts[split] = int(sum(len(docs[i]) for i in indices))
    return names, counts


def _save_document_shard(
    staging: Path,
    split: str,
    number: int,
    indices: list[int],
    docs: list[np.ndarray],
    prompt_lengths: list[int] | None,
    names: dict[str, list[str]],
) -> None:
    name = f"{split}_{number:06d}.npy"
    lengths = np.array([len(docs[i]) for i in indices], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # (n_docs + 1,)
    np.save(staging / name, np.concatenate([docs[i] for i in indices]))
    np.save(staging / document_offsets_name(name), offsets)
    if prompt_lengths is not None:
        mask = np.ones(int(offsets[-1]), dtype=np.uint8)  # 1 = trained on as a target
        for start, i in zip(offsets[:-1], indices):
            mask[start : start + prompt_lengths[i]] = 0
        np.save(staging / document_mask_name(name), mask)
    names[split].append(name)


def _source_fingerprint(source: str, tokenizer_name: str, val_fraction: float, mode: str) -> str:
    files = resolve_source(source)
    entries = []
    for path in files:
        stat = path.stat()
        entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    payload = json.dumps({"files": entries, "tokenizer": tokenizer_name, "val_fraction": val_fraction, "mode": mode})
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("BIGBATCH_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bigbatch"


def ensure_prepared(
    data: str,
    tokenizer_name: str,
    val_fraction: float,
    cache_dir: Path | str | None = None,
    mode: str = "packed",
) -> Path:
    """A prepared dataset directory for ``data``.

    ``data`` is either a prepared directory (used as is) or raw text (``builtin``,
    a file, a directory or a glob), prepared once into the cache and reused while
    the files are unchanged.
    """
    path = Path(data).expanduser()
    if data != BUILTIN and is_prepared_dataset(path):
        return path
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = _source_fingerprint(data, tokenizer_name, val_fraction, mode)
    label = "builtin" if data == BUILTIN else Path(data).name.replace("*", "_") or "data"
    target = cache / f"{label}-{tokenizer_name}-{mode}-{key}"
    if is_prepared_dataset(target):
        return target
    log.info("preparing %s with the %s tokenizer into %s (once; later runs reuse it)", data, tokenizer_name, target)
    try:
        prepare_dataset(data, target, tokenizer_name=tokenizer_name, val_fraction=val_fraction, mode=mode)
    except (DataError, OSError):
        if is_prepared_dataset(target):  # another process prepared the same source at the same time
            return target
        raise
    return target
