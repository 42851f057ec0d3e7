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
from bigbatch.data.shards import META_FILE, DatasetMeta, is_prepared_dataset, token_dtype
from bigbatch.data.tokenizers import get_tokenizer
from bigbatch.errors import ConfigError, DataError, require_creatable_dir

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 100_000_000


def prepare_dataset(
    source: str,
    out_dir: Path | str,
    tokenizer_name: str = "byte",
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> DatasetMeta:
    """Tokenize ``source`` into ``out_dir``.

    Documents are tokenized in sorted file order and joined (with the tokenizer's
    end-of-text token where it has one); the last ``val_fraction`` of the token
    stream becomes the validation split. The directory is built under a temporary
    name and renamed into place, so a failed run leaves nothing half-written, and an
    existing non-empty ``out_dir`` is never overwritten.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be positive, got {shard_tokens}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} already exists and is not empty; choose a new --out or remove it first")
    require_creatable_dir(out, "dataset directory")

    tokenizer = get_tokenizer(tokenizer_name)
    files = resolve_source(source)
    started = time.perf_counter()
    pieces: list[np.ndarray] = []
    n_docs = 0
    n_bytes = 0
    dtype = token_dtype(tokenizer.vocab_size)
    for doc in read_documents(files):
        if not doc.data:
            continue
        ids = tokenizer.encode(doc.data)
        if tokenizer.eot_token is not None:
            ids.append(tokenizer.eot_token)
        pieces.append(np.asarray(ids, dtype=dtype))
        n_docs += 1
        n_bytes += len(doc.data)
    if not pieces:
        raise DataError(f"the corpus {source} holds no text; point --data at non-empty text files")
    stream = np.concatenate(pieces)
    del pieces
    n_val = int(len(stream) * val_fraction)
    splits = {"train": stream[: len(stream) - n_val], "val": stream[len(stream) - n_val :]}

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shard_names: dict[str, list[str]] = {}
        for split, tokens in splits.items():
            shard_names[split] = []
            for i, start in enumerate(range(0, len(tokens), shard_tokens)):
                name = f"{split}_{i:06d}.npy"
                np.save(staging / name, np.ascontiguousarray(tokens[start : start + shard_tokens]))
                shard_names[split].append(name)
        meta = DatasetMeta(
            tokenizer=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            dtype=dtype.name,
            shards=shard_names,
            tokens={split: int(len(tokens)) for split, tokens in splits.items()},
            source=source,
            documents=n_docs,
            eot_token=tokenizer.eot_token,
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
        "prepared %s: %d documents, %.1f MB of text -> %s train + %s val tokens (%s) in %.1fs (%.1f MB/s)",
        out, n_docs, n_bytes / 1e6, f"{meta.tokens['train']:,}", f"{meta.tokens['val']:,}",
        tokenizer.name, elapsed, n_bytes / 1e6 / max(elapsed, 1e-9),
    )
    return meta


def _source_fingerprint(source: str, tokenizer_name: str, val_fraction: float) -> str:
    files = resolve_source(source)
    entries = []
    for path in files:
        stat = path.stat()
        entries.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    payload = json.dumps({"files": entries, "tokenizer": tokenizer_name, "val_fraction": val_fraction})
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("BIGBATCH_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bigbatch"


def ensure_prepared(
    data: str, tokenizer_name: str, val_fraction: float, cache_dir: Path | str | None = None
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
    key = _source_fingerprint(data, tokenizer_name, val_fraction)
    label = "builtin" if data == BUILTIN else Path(data).name.replace("*", "_") or "data"
    target = cache / f"{label}-{tokenizer_name}-{key}"
    if is_prepared_dataset(target):
        return target
    log.info("preparing %s with the %s tokenizer into %s (once; later runs reuse it)", data, tokenizer_name, target)
    try:
        prepare_dataset(data, target, tokenizer_name=tokenizer_name, val_fraction=val_fraction)
    except (DataError, OSError):
        if is_prepared_dataset(target):  # another process prepared the same source at the same time
            return target
        raise
    return target
