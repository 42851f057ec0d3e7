"""Tokenize text into a prepared dataset directory (shards + meta.json).

Documents are read, cut into pieces at boundaries every tokenizer here keeps (a single newline between two
printable ASCII characters, never inside a pre-token) and tokenized — in worker processes when the corpus is
large and the tokenizer is not the byte one, results in order — and the tokens are written to disk as they
come, so memory holds neither the corpus nor its tokens. A ``bpe:VOCAB`` tokenizer is first trained on the
same documents (streamed) and saved as ``tokenizer.json`` beside the shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bigbatch.data.corpus import (
    BUILTIN,
    Document,
    hf_documents,
    is_hf_source,
    read_documents,
    resolve_source,
)
from bigbatch.data.fingerprint import (
    prepared_data_fingerprint,
    tokenizer_fingerprint,
    tokenizer_json_fingerprint,
)
from bigbatch.data.foreign import foreign_files
from bigbatch.data.shards import (
    META_FILE,
    DatasetMeta,
    document_mask_name,
    document_offsets_name,
    is_prepared_dataset,
    token_dtype,
)
from bigbatch.data.tokenizers import (
    BPE_FILE,
    BPETokenizer,
    Tokenizer,
    bpe_vocab_size,
    get_tokenizer,
    is_bpe,
    train_bpe,
)
from bigbatch.errors import ConfigError, DataError, require_creatable_dir
from bigbatch.fileperm import apply_umask
from bigbatch.progress import ProgressBar

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 100_000_000


MODES = ("packed", "documents")

PIECE_BYTES = 1 << 17
"""Documents are tokenized in pieces of about this size (128 KiB): memory stays flat and one big file still
spreads over the workers."""
TASK_BYTES = 1 << 18  # text per worker task
PARALLEL_MIN_BYTES = 1_000_000 if sys.platform.startswith("linux") else 16_000_000
"""Below this much text (estimated from the file sizes) a worker pool costs more than it saves."""
MAX_WORKERS = 32
PROGRESS_SECONDS = 5.0
_STREAM_FILE = ".tokens.tmp"
# A cut after a newline that sits between two printable ASCII characters: the newline is a pre-token of its own
# for the byte, GPT-2 and byte-level BPE tokenizers alike, so cutting there changes no token.
_SAFE_CUT = re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])")


def prepare_dataset(
    source: str,
    out_dir: Path | str,
    tokenizer_name: str = "byte",
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    mode: str = "packed",
    workers: int | None = None,
    bpe_json: str | None = None,
) -> DatasetMeta:
    """Tokenize ``source`` into ``out_dir``.

    ``packed``: documents are tokenized in sorted file order and joined (with the
    tokenizer's end-of-text token where it has one) into one stream; the last
    ``val_fraction`` of the stream becomes the validation split.

    ``documents``: each document stays a unit (one sequence when training, padded; a document longer than
    the sequence length is split into windows or truncated by the training run's ``long_documents`` policy,
    which needs the sequence length and so is not fixed here); shards store document offsets beside the
    tokens, a ``.mask.npy`` marks the tokens to train on when any document has a
    masked prompt, and the last ``val_fraction`` of the documents is validation.

    ``tokenizer_name`` ``bpe:VOCAB`` trains a byte-level BPE with that vocabulary on the documents first and
    keeps it in ``out_dir/tokenizer.json``; with ``bpe_json`` (a ``tokenizer.json`` document, e.g. a run's own)
    that tokenizer is used and kept instead of training one.

    ``workers``: processes that tokenize; ``None`` picks one per CPU core when the corpus is large enough
    to gain from it and the tokenizer is not ``byte``, 1 tokenizes in this process. The shards are the same
    either way.

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
    if workers is not None and workers < 1:
        raise ConfigError(f"workers must be positive, got {workers}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} already exists and is not empty; choose a new --out or remove it first")
    require_creatable_dir(out, "dataset directory")

    tokenizer: Tokenizer | None = None
    if is_bpe(tokenizer_name):
        bpe_vocab_size(tokenizer_name)  # a bad name fails before any work
        if bpe_json:
            tokenizer = BPETokenizer.from_str(tokenizer_name, bpe_json)
    else:
        tokenizer = get_tokenizer(tokenizer_name)
    hf = is_hf_source(source)
    files = [] if hf else resolve_source(source)

    def documents() -> Iterator[Document]:
        return hf_documents(source) if hf else read_documents(files)

    total_bytes = None if hf else sum(path.stat().st_size for path in files)  # unknown for a stream
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    apply_umask(staging, directory=True)  # mkdtemp makes it 0700; the dataset is the user's, umask applies
    try:
        if tokenizer is None:
            tokenizer = _train_bpe(tokenizer_name, documents, source)
        if isinstance(tokenizer, BPETokenizer):
            tokenizer.save(staging / BPE_FILE)
        dtype = token_dtype(tokenizer.vocab_size)
        n_workers = _worker_count(workers, tokenizer, total_bytes)
        stream_path = staging / _STREAM_FILE
        lengths: list[int] = []
        prompt_lengths: list[int] = []
        n_bytes = 0
        tokenize_started = time.perf_counter()
        progress = _Progress("tokenized", tokenize_started, total_bytes=total_bytes)
        invalid = InvalidUTF8()
        checked = invalid if tokenizer.name != "byte" else None  # the byte tokenizer keeps any bytes as they are
        with progress, open(stream_path, "wb") as stream_file:
            for ids, prompt_length, size in _encoded_documents(documents, tokenizer, dtype, n_workers, checked):
                stream_file.write(ids.tobytes())
                lengths.append(len(ids))
                prompt_lengths.append(prompt_length)
                n_bytes += size
                progress.update(len(lengths), n_bytes)
        if not lengths:
            raise DataError(f"the corpus {source} holds no text; point --data at non-empty text files")
        tokenize_seconds = time.perf_counter() - tokenize_started
        stream = np.memmap(stream_path, dtype=dtype, mode="r")
        try:
            if mode == "packed":
                shard_names, token_counts = _write_packed(staging, stream, val_fraction, shard_tokens)
                masked = False
            else:
                masked = any(prompt_lengths)
                shard_names, token_counts = _write_documents(
                    staging, stream, lengths, prompt_lengths if masked else None, val_fraction, shard_tokens
                )
        finally:
            del stream
        stream_path.unlink()
        fingerprints = {
            "tokenizer": tokenizer_fingerprint(tokenizer.name, staging),
            "data": prepared_data_fingerprint(staging, shard_names, mode, masked),
        }
        meta = DatasetMeta(
            tokenizer=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            dtype=dtype.name,
            shards=shard_names,
            tokens=token_counts,
            source=source,
            documents=len(lengths),
            eot_token=tokenizer.eot_token,
            mode=mode,
            masked=masked,
            fingerprints=fingerprints,
        )
        if checked is not None:
            meta.extra["utf8_replacements"] = invalid.replacements
        if mode == "documents":
            meta.extra["longest_document"] = max(lengths)
            # targets are positions 1.. of a document; a prompt masks the first prompt-length of them
            untrained = sum(1 for n, p in zip(lengths, prompt_lengths) if n - max(p, 1) <= 0)
            meta.extra["documents_without_targets"] = untrained
        (staging / META_FILE).write_text(meta.to_json())
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - started
    log.info(
        "prepared %s: %d documents, %.1f MB of text -> %s train + %s val tokens (%s, %s) in %.1fs (%.1f MB/s; "
        "tokenizing %.1f MB/s with %d %s)",
        out, len(lengths), n_bytes / 1e6, f"{meta.tokens['train']:,}", f"{meta.tokens['val']:,}",
        tokenizer.name, mode, elapsed, n_bytes / 1e6 / max(elapsed, 1e-9),
        n_bytes / 1e6 / max(tokenize_seconds, 1e-9), n_workers, "process" if n_workers == 1 else "processes",
    )  # fmt: skip
    if invalid.replacements:
        log.warning("%s: %s", out, invalid.describe(tokenizer.name))
    return meta


def prepared_notes(meta: DatasetMeta) -> list[str]:
    """What ``bigbatch prepare`` reports beside the token counts: invalid UTF-8 replaced by a text tokenizer, and
    in documents mode what the long-document policy drops (decided when training, where seq_len is known)."""
    notes = []
    replaced = int(meta.extra.get("utf8_replacements", 0) or 0)  # type: ignore[call-overload]
    if "utf8_replacements" in meta.extra:
        notes.append(f"{replaced:,} invalid UTF-8 sequences replaced by U+FFFD ({meta.tokenizer} tokenizer)")
    if meta.mode == "documents":
        untrained = int(meta.extra.get("documents_without_targets", 0) or 0)  # type: ignore[call-overload]
        if untrained:
            refused = "; training on them alone is refused" if untrained == meta.documents else ""
            notes.append(
                f"{untrained:,} of {meta.documents:,} documents have no target to train on (a single token, or "
                f"wholly prompt: an empty completion){refused}"
            )
        longest = int(meta.extra.get("longest_document", 0) or 0)  # type: ignore[call-overload]
        notes.append(
            f"long documents: longest {longest:,} tokens; training splits those longer than seq_len+1 into seq_len "
            "windows (--long-documents split, the default: 0 tokens dropped); --long-documents truncate keeps only "
            "the first seq_len+1 tokens of each (the run header counts what that drops)"
        )
    return notes


class InvalidUTF8:
    """Counts what a tokenizer that reads text (gpt2, bpe) cannot see as it is: invalid UTF-8 sequences, each
    decoded as U+FFFD (the byte tokenizer keeps the bytes)."""

    def __init__(self) -> None:
        self.replacements = 0
        self.documents = 0
        self.first = ""

    def check(self, name: str, parts: Iterable[bytes]) -> None:
        found = sum(utf8_replacements(part) for part in parts)
        if found:
            self.replacements += found
            self.documents += 1
            self.first = self.first or name

    def describe(self, tokenizer: str) -> str:
        return (
            f"{self.replacements:,} invalid UTF-8 sequences in {self.documents:,} documents (the first in "
            f"{self.first}) were replaced by U+FFFD for the {tokenizer} tokenizer; fix the encoding of the text, "
            "or use --tokenizer byte, which keeps every byte"
        )


def utf8_replacements(data: bytes) -> int:
    """The U+FFFD characters that decoding ``data`` as UTF-8 with ``errors="replace"`` introduces."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace").count("\ufffd") - data.count("\ufffd".encode())
    return 0


class _Progress:
    """Logs ``documents, MB of text, MB/s`` every few seconds; or, given ``total_bytes`` and with stderr a
    terminal, draws a progress bar (MB done of the total, MB/s, ETA) instead.

    ``total_bytes`` is the size of the files, so JSON Lines overhead and skipped binary files leave the bar
    short of 100% at the end; it is erased then either way.
    """

    def __init__(self, what: str, started: float, total_bytes: int | None = None) -> None:
        self.what = what
        self.started = started
        self.next_report = started + PROGRESS_SECONDS
        self.bar: ProgressBar | None = None
        if total_bytes:
            bar = ProgressBar(total_bytes, label=f"{what} MB", format_count=lambda n: f"{n / 1e6:.1f}")
            self.bar = bar if bar.enabled else None

    def update(self, documents: int, n_bytes: int) -> None:
        now = time.perf_counter()
        if self.bar is not None:
            rate = n_bytes / 1e6 / max(now - self.started, 1e-9)
            self.bar.update(min(n_bytes, self.bar.total), extra=f"{documents:,} documents | {rate:.1f} MB/s")
            return
        if now < self.next_report:
            return
        self.next_report = now + PROGRESS_SECONDS
        log.info(
            "%s %s documents, %.1f MB of text, %.1f MB/s",
            self.what, f"{documents:,}", n_bytes / 1e6, n_bytes / 1e6 / max(now - self.started, 1e-9),
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_text(data: bytes, size: int = PIECE_BYTES) -> list[bytes]:
    """``data`` cut into pieces of about ``size`` bytes at token-safe newlines (see ``_SAFE_CUT``).

    Tokenizing the pieces one by one gives the same tokens as tokenizing ``data`` whole; text without such a
    newline stays in one piece.
    """
    pieces: list[bytes] = []
    start = 0
    while len(data) - start > size:
        match = _SAFE_CUT.search(data, start + size - 1)
        if match is None:
            break
        cut = match.end()
        pieces.append(data[start:cut])
        start = cut
    pieces.append(data[start:] if start else data)
    return pieces


def _train_bpe(name: str, documents: Callable[[], Iterable[Document]], source: str) -> Tokenizer:
    log.info("training the %s tokenizer on %s", name, source)
    started = time.perf_counter()
    progress = _Progress(f"{name} training read", started)
    seen = {"documents": 0, "bytes": 0}

    def texts() -> Iterator[str]:
        for doc in documents():
            for part in (doc.prompt, doc.data):
                for piece in split_text(part) if part else ():
                    yield piece.decode("utf-8", errors="replace")
            seen["documents"] += 1
            seen["bytes"] += len(doc.data) + len(doc.prompt)
            progress.update(seen["documents"], seen["bytes"])

    tokenizer = train_bpe(name, texts())
    elapsed = time.perf_counter() - started
    log.info(
        "trained %s: vocabulary %d on %.1f MB of text in %.1fs (%.1f MB/s)",
        name, tokenizer.vocab_size, seen["bytes"] / 1e6, elapsed, seen["bytes"] / 1e6 / max(elapsed, 1e-9),
    )  # fmt: skip
    return tokenizer


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _worker_count(workers: int | None, tokenizer: Tokenizer, total_bytes: int | None) -> int:
    """``total_bytes``: the size of the corpus files; ``None`` for a stream of unknown size (taken as large)."""
    if workers is not None:
        return workers
    if tokenizer.name == "byte":
        return 1  # a vectorized copy: faster than shipping the text to another process
    if total_bytes is not None and total_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(_cpu_count(), MAX_WORKERS))


def _encode_piece(tokenizer: Tokenizer, data: bytes, dtype: np.dtype) -> np.ndarray:
    encode_array = getattr(tokenizer, "encode_array", None)
    if encode_array is not None:
        return encode_array(data, dtype)
    return np.asarray(tokenizer.encode(data), dtype=dtype)


def _encoded_documents(
    documents: Callable[[], Iterable[Document]],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    workers: int,
    invalid: InvalidUTF8 | None = None,
) -> Iterator[tuple[np.ndarray, int, int]]:
    """``(token ids, prompt length in tokens, bytes of text)`` per non-empty document, in corpus order; the ids
    end with the end-of-text token where the tokenizer has one. ``invalid`` counts invalid UTF-8."""
    plans: deque[tuple[int, int, int]] = deque()  # per document: prompt pieces, all pieces, bytes

    def pieces() -> Iterator[bytes]:
        for doc in documents():
            prompt = split_text(doc.prompt) if doc.prompt else []
            data = split_text(doc.data) if doc.data else []
            if invalid is not None:  # piece by piece (cut between ASCII characters): memory stays flat
                invalid.check(doc.name, prompt + data)
            if not prompt and not data:
                continue
            plans.append((len(prompt), len(prompt) + len(data), len(doc.data) + len(doc.prompt)))
            yield from prompt
            yield from data

    if workers > 1:
        arrays = _encode_in_workers(pieces(), tokenizer, dtype, workers)
    else:
        arrays = (_encode_piece(tokenizer, piece, dtype) for piece in pieces())
    eot = [np.array([tokenizer.eot_token], dtype=dtype)] if tokenizer.eot_token is not None else []
    parts: list[np.ndarray] = []
    for array in arrays:
        parts.append(array)
        n_prompt, n_pieces, size = plans[0]
        if len(parts) < n_pieces:
            continue
        plans.popleft()
        prompt_length = sum(len(part) for part in parts[:n_prompt])
        ids = np.concatenate(parts + eot) if len(parts) + len(eot) > 1 else parts[0]
        parts = []
        if len(ids):
            yield ids, prompt_length, size


_WORKER_TOKENIZER: Any = None


def _init_worker(name: str, tokenizer_json: str | None) -> None:
    global _WORKER_TOKENIZER
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool is ended by the parent, which handles signals
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_TOKENIZER = BPETokenizer.from_str(name, tokenizer_json) if tokenizer_json else get_tokenizer(name)


def _encode_task(pieces: list[bytes], dtype: str) -> list[np.ndarray]:
    return [_encode_piece(_WORKER_TOKENIZER, piece, np.dtype(dtype)) for piece in pieces]


def _tasks(pieces: Iterable[bytes]) -> Iterator[list[bytes]]:
    task: list[bytes] = []
    size = 0
    for piece in pieces:
        task.append(piece)
        size += len(piece)
        if size >= TASK_BYTES:
            yield task
            task, size = [], 0
    if task:
        yield task


@contextmanager
def _quiet_hf_fork() -> Iterator[None]:
    """Hugging Face tokenizers warns in every forked child once its thread pool has run (BPE training);
    the workers are single-threaded on purpose, so say so for the fork."""
    key = "TOKENIZERS_PARALLELISM"
    before = os.environ.get(key)
    os.environ.setdefault(key, "false")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)


def _encode_in_workers(
    pieces: Iterable[bytes], tokenizer: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[np.ndarray]:
    """Tokenize ``pieces`` in a process pool, in order, with at most ``2 x workers`` tasks in flight (the
    corpus is read as fast as the workers tokenize, not ahead of them)."""
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    tokenizer_json = tokenizer.to_str() if isinstance(tokenizer, BPETokenizer) else None
    with _quiet_hf_fork():
        pool = multiprocessing.get_context(method).Pool(
            workers, initializer=_init_worker, initargs=(tokenizer.name, tokenizer_json)
        )
    try:
        in_flight: deque[Any] = deque()
        for task in _tasks(pieces):
            in_flight.append(pool.apply_async(_encode_task, (task, dtype.str)))
            while len(in_flight) >= 2 * workers:
                yield from in_flight.popleft().get()
        while in_flight:
            yield from in_flight.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _write_packed(
    staging: Path, stream: np.ndarray, val_fraction: float, shard_tokens: int
) -> tuple[dict[str, list[str]], dict[str, int]]:
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
    stream: np.ndarray,
    lengths: list[int],
    prompt_lengths: list[int] | None,
    val_fraction: float,
    shard_tokens: int,
) -> tuple[dict[str, list[str]], dict[str, int]]:
    n_docs = len(lengths)
    starts = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)
    n_val = int(round(n_docs * val_fraction))
    if val_fraction > 0 and n_val == 0 and n_docs > 1:
        n_val = 1
    boundary = n_docs - n_val
    names: dict[str, list[str]] = {"train": [], "val": []}
    counts: dict[str, int] = {"train": 0, "val": 0}
    for split, first, stop in (("train", 0, boundary), ("val", boundary, n_docs)):
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
    names: dict[str, list[str]],
) -> None:
    """Documents ``first..stop-1`` of the token stream as one shard (with offsets, and the mask when masked)."""
    name = f"{split}_{len(names[split]):06d}.npy"
    offsets = (starts[first : stop + 1] - starts[first]).astype(np.int64)  # (n_docs + 1,)
    np.save(staging / name, np.ascontiguousarray(stream[starts[first] : starts[stop]]))
    np.save(staging / document_offsets_name(name), offsets)
    if prompt_lengths is not None:
        mask = np.ones(int(offsets[-1]), dtype=np.uint8)  # 1 = trained on as a target
        for start, i in zip(offsets[:-1], range(first, stop)):
            mask[start : start + prompt_lengths[i]] = 0
        np.save(staging / document_mask_name(name), mask)
    names[split].append(name)


def _source_fingerprint(source: str, tokenizer_name: str, val_fraction: float, mode: str) -> str:
    entries: list[Any] = []
    if is_hf_source(source):
        entries.append(source)  # a remote stream: no files to stat; the source names it
    else:
        for path in resolve_source(source):
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
    bpe_json: str | None = None,
) -> Path:
    """A prepared dataset directory for ``data``.

    ``data`` is either a prepared directory or foreign token shards (build-nanogpt ``.npy``, llm.c ``.bin``:
    a directory, file or glob), used as they are, or raw text (``builtin``, a file, a directory or a glob),
    prepared once into the cache and reused while the files are unchanged. ``bpe_json``: see
    :func:`prepare_dataset` (its fingerprint becomes part of the cache key).
    """
    path = Path(data).expanduser()
    if tokenizer_name in ("", "auto"):  # raw text's default; prepared or token-shard data keeps its own
        tokenizer_name = "byte"
    raw = data == BUILTIN or is_hf_source(data)
    if not raw and is_prepared_dataset(path):
        return path
    if not raw and foreign_files(data):
        return path  # token shards from build-nanogpt or llm.c: read as they are
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = _source_fingerprint(data, tokenizer_name, val_fraction, mode)
    if bpe_json and is_bpe(tokenizer_name):
        key = hashlib.sha256(f"{key}:{tokenizer_json_fingerprint(bpe_json)}".encode()).hexdigest()[:16]
    if is_hf_source(data):
        label = re.sub(r"[^\w.-]+", "_", data[3:]).strip("_") or "hf"
    else:
        label = "builtin" if data == BUILTIN else Path(data).name.replace("*", "_") or "data"
    target = cache / f"{label}-{tokenizer_name.replace(':', '')}-{mode}-{key}"
    if is_prepared_dataset(target):
        return target
    log.info("preparing %s with the %s tokenizer into %s (once; later runs reuse it)", data, tokenizer_name, target)
    try:
        prepare_dataset(data, target, tokenizer_name=tokenizer_name, val_fraction=val_fraction, mode=mode,
                        bpe_json=bpe_json if is_bpe(tokenizer_name) else None)  # fmt: skip
    except (DataError, OSError):
        if is_prepared_dataset(target):  # another process prepared the same source at the same time
            return target
        raise
    return target
