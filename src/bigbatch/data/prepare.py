"""Tokenize text into a prepared dataset directory (shards + meta.json): the orchestration.

Documents are read (:mod:`~bigbatch.data.corpus`), cut into pieces at boundaries every tokenizer here keeps
(:mod:`~bigbatch.data.text`) and tokenized — in worker processes when the corpus is large and the tokenizer is
not the byte one, results in order (:mod:`~bigbatch.data.encode`) — and the tokens are written to disk as they
come, so memory holds neither the corpus nor its tokens; then the stream is split (:mod:`~bigbatch.data.split`)
and written as shards (:mod:`~bigbatch.data.writer`). A ``bpe:VOCAB`` tokenizer is first trained on the same
documents (streamed) and saved as ``tokenizer.json`` beside the shards. The cache of prepared raw text is
:mod:`~bigbatch.data.cache`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bigbatch.data.corpus import Document, hf_documents, is_hf_source, read_documents, resolve_source, text_files
from bigbatch.data.corpus_progress import CorpusProgress
from bigbatch.data.encode import encoded_documents, worker_count
from bigbatch.data.fingerprint import prepared_data_fingerprint, tokenizer_fingerprint
from bigbatch.data.resumable import (
    LENGTHS_FILE,
    Checkpoint,
    restore_lengths,
    resumable_directory,
    skip_done,
    write_lengths,
)
from bigbatch.data.shards import META_FILE, DatasetMeta, is_prepared_dataset, token_dtype
from bigbatch.data.split import SPLIT_RULE, SPLIT_SEED, document_splits, packed_splits
from bigbatch.data.text import InvalidUTF8, split_text
from bigbatch.data.tokenizers import BPE_FILE, BPETokenizer, Tokenizer, bpe_vocab_size, get_tokenizer, is_bpe, train_bpe
from bigbatch.data.writer import ShardNames, TokenCounts, staged_directory, write_documents, write_meta, write_packed
from bigbatch.errors import ConfigError, DataError, require_creatable_dir
from bigbatch.files.lock import FileLock, Holder, LockBusy, acquire
from bigbatch.progress import plural
from bigbatch.settings.choices import DATA_MODE

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 100_000_000
_STREAM_FILE = ".tokens.tmp"


@dataclass
class _Tokenized:
    """What tokenizing the corpus into the stream file found, per document and in all."""

    lengths: list[int] = field(default_factory=list)  # tokens per document
    prompt_lengths: list[int] = field(default_factory=list)  # prompt tokens per document
    n_bytes: int = 0  # text read
    seconds: float = 0.0


def prepare_dataset(
    source: str,
    out_dir: Path | str,
    tokenizer_name: str = "byte",
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    mode: str = "packed",
    workers: int | None = None,
    bpe_json: str | None = None,
    wait_for_lock: bool = False,
) -> DatasetMeta:
    """Tokenize ``source`` into ``out_dir``.

    ``packed``: documents are tokenized in sorted file order and joined (with the
    tokenizer's end-of-text token where it has one) into one stream; ``val_fraction`` of its tokens become the
    validation split: whole documents drawn at random (seeded) and the tail of at most one more (a single text:
    its last ``val_fraction``), see :mod:`~bigbatch.data.split`.

    ``documents``: each document stays a unit (one sequence when training, padded; a document longer than
    the sequence length is split into windows or truncated by the training run's ``long_documents`` policy,
    which needs the sequence length and so is not fixed here); shards store document offsets beside the
    tokens, a ``.mask.npy`` marks the tokens to train on when any document has a
    masked prompt, and ``val_fraction`` of the documents, drawn at random (seeded), are validation.

    ``tokenizer_name`` ``bpe:VOCAB`` trains a byte-level BPE with that vocabulary on the documents first and
    keeps it in ``out_dir/tokenizer.json``; with ``bpe_json`` (a ``tokenizer.json`` document, e.g. a run's own)
    that tokenizer is used and kept instead of training one.

    ``workers``: processes that tokenize; ``None`` picks one per CPU core when the corpus is large enough
    to gain from it and the tokenizer is not ``byte``, 1 tokenizes in this process. The shards are the same
    either way.

    The directory is built under a temporary name and renamed into place, so a
    failed run leaves nothing half-written; an existing non-empty ``out_dir`` is
    never overwritten. One process at a time prepares ``out_dir`` (:func:`preparation_lock`); with
    ``wait_for_lock`` another one waits for it and returns what it prepared.
    """
    _check_settings(val_fraction, shard_tokens, mode, workers)
    out = Path(out_dir)
    _refuse_existing(out)
    require_creatable_dir(out, "dataset directory")
    with preparation_lock(out, wait_for_lock):
        if wait_for_lock and is_prepared_dataset(out):  # the process waited for prepared it
            return DatasetMeta.from_file(out / META_FILE)
        _refuse_existing(out)
        return _prepare(source, out, tokenizer_name, val_fraction, shard_tokens, mode, workers, bpe_json)


def _refuse_existing(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} already exists and is not empty; choose a new --out or remove it first")


def preparation_lock(out: Path, wait: bool) -> FileLock:
    """Held while ``out`` is prepared (``.NAME.lock`` beside it): one process prepares a dataset; another one
    refuses, or with ``wait`` waits and then finds it prepared."""
    out.parent.mkdir(parents=True, exist_ok=True)

    def waiting(holder: Holder | None) -> None:
        log.info("waiting for %s, which is preparing %s", holder.describe() if holder else "another process", out)

    try:
        return acquire(out.parent / f".{out.name}.lock", wait=wait, on_wait=waiting)
    except LockBusy as exc:
        who = exc.holder.describe() if exc.holder else "another process"
        raise DataError(
            f"{out} is being prepared by another process ({who}); wait for it to finish, or choose another --out"
        ) from None


def _prepare(
    source: str,
    out: Path,
    tokenizer_name: str,
    val_fraction: float,
    shard_tokens: int,
    mode: str,
    workers: int | None,
    bpe_json: str | None,
) -> DatasetMeta:
    """:func:`prepare_dataset` once ``out`` is held and known to be new."""
    tokenizer: Tokenizer | None = None
    if is_bpe(tokenizer_name):
        bpe_vocab_size(tokenizer_name)  # a bad name fails before any work
        if bpe_json:
            tokenizer = BPETokenizer.from_str(tokenizer_name, bpe_json)
    else:
        tokenizer = get_tokenizer(tokenizer_name)
    hf = is_hf_source(source)
    files = [] if hf else text_files(resolve_source(source))

    def documents() -> Iterator[Document]:
        return hf_documents(source) if hf else read_documents(files)

    local = _hf_local_files(source) if hf else files
    total_bytes = sum(path.stat().st_size for path in local) if local else None  # unknown for a stream
    started = time.perf_counter()
    # An hf: source (a stream, maybe remote and long) is prepared resumably (bigbatch/data/resumable.py).
    directory = resumable_directory(out, _resume_key(source, tokenizer_name, bpe_json)) if hf else _staged(out)
    with directory as (staging, checkpoint):
        if tokenizer is None:
            if checkpoint and checkpoint.position.tokenizer_ready and (staging / BPE_FILE).is_file():
                tokenizer = BPETokenizer.from_str(tokenizer_name, (staging / BPE_FILE).read_text())
            else:
                tokenizer = _train_bpe(tokenizer_name, documents, source)
        if isinstance(tokenizer, BPETokenizer):
            tokenizer.save(staging / BPE_FILE)
            if checkpoint:
                checkpoint.save(tokenizer_ready=True)
        dtype = token_dtype(tokenizer.vocab_size)
        n_workers = worker_count(workers, tokenizer, total_bytes)
        invalid = InvalidUTF8()
        checked = invalid if tokenizer.name != "byte" else None  # the byte tokenizer keeps any bytes as they are
        stream_path = staging / _STREAM_FILE
        found = _tokenize(documents, tokenizer, dtype, n_workers, checked, stream_path, total_bytes, checkpoint)
        if not found.lengths:
            raise DataError(f"the corpus {source} holds no text; give non-empty text files instead")
        masked = mode == "documents" and any(found.prompt_lengths)
        shard_names, token_counts = _write_shards(
            staging, stream_path, dtype, mode, masked, found, val_fraction, shard_tokens
        )
        stream_path.unlink()
        (staging / LENGTHS_FILE).unlink(missing_ok=True)
        replaced = invalid.replacements if checked is not None else None
        meta = _dataset_meta(
            staging, source, tokenizer, dtype, mode, masked, shard_names, token_counts, found, replaced
        )
        write_meta(staging, meta)
    elapsed = time.perf_counter() - started
    n_bytes = found.n_bytes
    log.info(
        "prepared %s: %s, %.1f MB of text -> %s train + %s val tokens (%s, %s) in %.1fs (%.1f MB/s; "
        "tokenizing %.1f MB/s with %d %s)",
        out,
        plural(len(found.lengths), "document"),
        n_bytes / 1e6,
        f"{meta.tokens['train']:,}",
        f"{meta.tokens['val']:,}",
        tokenizer.name,
        mode,
        elapsed,
        n_bytes / 1e6 / max(elapsed, 1e-9),
        n_bytes / 1e6 / max(found.seconds, 1e-9),
        n_workers,
        "process" if n_workers == 1 else "processes",
    )
    if invalid.replacements:
        log.warning("%s: %s", out, invalid.describe(tokenizer.name))
    return meta


@contextmanager
def _staged(out: Path) -> Iterator[tuple[Path, Checkpoint | None]]:
    with staged_directory(out) as staging:
        yield staging, None


def _hf_local_files(source: str) -> list[Path]:
    from bigbatch.data.hf_source import local_files, parse

    return local_files(parse(source))


def _resume_key(source: str, tokenizer_name: str, bpe_json: str | None) -> str:
    """What an interrupted prepare's partial directory must match to be resumed: the source (with its local
    files' sizes and times) and the tokenizer."""
    stats = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in _hf_local_files(source)]
    payload = json.dumps([source, tokenizer_name, bpe_json or "", stats])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _check_settings(val_fraction: float, shard_tokens: int, mode: str, workers: int | None) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be positive, got {shard_tokens}")
    if mode not in DATA_MODE:
        raise ConfigError(f"unknown data mode {mode!r}; choose one of: {', '.join(DATA_MODE.values)}")
    if workers is not None and workers < 1:
        raise ConfigError(f"workers must be positive, got {workers}")


def _tokenize(
    documents: Callable[[], Iterable[Document]],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    workers: int,
    invalid: InvalidUTF8 | None,
    stream_path: Path,
    total_bytes: int | None,
    checkpoint: Checkpoint | None = None,
) -> _Tokenized:
    """Every document's tokens appended to the file ``stream_path``, with progress; their lengths kept. With a
    ``checkpoint`` the position is saved as it goes, and a saved one is resumed (the documents it holds are
    read past, not tokenized again)."""
    found = _Tokenized()
    started = time.perf_counter()
    progress = CorpusProgress("tokenized", started, total_bytes=total_bytes)
    mode = "wb"
    if checkpoint is not None and checkpoint.position.documents:
        done = checkpoint.position
        found.lengths, found.prompt_lengths = restore_lengths(stream_path.parent, stream_path, done)
        found.n_bytes = done.n_bytes
        if invalid is not None:
            invalid.replacements, invalid.documents = done.utf8_replacements, done.utf8_documents
        documents, mode = skip_done(documents, done.documents), "ab"
    with ExitStack() as stack:
        stack.enter_context(progress)
        stream_file = stack.enter_context(open(stream_path, mode))
        lengths_file = stack.enter_context(open(stream_path.parent / LENGTHS_FILE, mode)) if checkpoint else None
        for ids, prompt_length, size in encoded_documents(documents, tokenizer, dtype, workers, invalid):
            stream_file.write(ids.tobytes())
            found.lengths.append(len(ids))
            found.prompt_lengths.append(prompt_length)
            found.n_bytes += size
            progress.update(len(found.lengths), found.n_bytes)
            if checkpoint is not None and lengths_file is not None:
                write_lengths(lengths_file, len(ids), prompt_length)
                if checkpoint.due():
                    checkpoint.sync(
                        stream_file,
                        lengths_file,
                        documents=len(found.lengths),
                        n_bytes=found.n_bytes,
                        utf8_replacements=invalid.replacements if invalid else 0,
                        utf8_documents=invalid.documents if invalid else 0,
                    )
    found.seconds = time.perf_counter() - started
    return found


def _write_shards(
    staging: Path,
    stream_path: Path,
    dtype: np.dtype,
    mode: str,
    masked: bool,
    found: _Tokenized,
    val_fraction: float,
    shard_tokens: int,
) -> tuple[ShardNames, TokenCounts]:
    """The token stream file split and written as the shards of ``mode``."""
    stream = np.memmap(stream_path, dtype=dtype, mode="r")
    try:
        if mode == "packed":
            return write_packed(staging, stream, packed_splits(found.lengths, val_fraction), shard_tokens)
        splits = document_splits(len(found.lengths), val_fraction)
        prompt_lengths = found.prompt_lengths if masked else None
        return write_documents(staging, stream, found.lengths, prompt_lengths, splits, shard_tokens)
    finally:
        del stream


def _dataset_meta(
    staging: Path,
    source: str,
    tokenizer: Tokenizer,
    dtype: np.dtype,
    mode: str,
    masked: bool,
    shard_names: ShardNames,
    token_counts: TokenCounts,
    found: _Tokenized,
    utf8_replacements: int | None,
) -> DatasetMeta:
    """The ``meta.json`` of the shards written in ``staging``, with their fingerprints and what the notes of
    :func:`prepared_notes` need (``utf8_replacements``: ``None`` for the byte tokenizer, which replaces none)."""
    meta = DatasetMeta(
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        dtype=dtype.name,
        shards=shard_names,
        tokens=token_counts,
        source=source,
        documents=len(found.lengths),
        eot_token=tokenizer.eot_token,
        mode=mode,
        masked=masked,
        fingerprints={
            "tokenizer": tokenizer_fingerprint(tokenizer.name, staging),
            "data": prepared_data_fingerprint(staging, shard_names, mode, masked),
        },
    )
    if utf8_replacements is not None:
        meta.extra["utf8_replacements"] = utf8_replacements
    meta.extra["split"] = {"rule": SPLIT_RULE, "seed": SPLIT_SEED}
    if mode == "documents":
        meta.extra["longest_document"] = max(found.lengths)
        # targets are positions 1.. of a document; a prompt masks the first prompt-length of them
        untrained = sum(1 for n, p in zip(found.lengths, found.prompt_lengths, strict=False) if n - max(p, 1) <= 0)
        meta.extra["documents_without_targets"] = untrained
    return meta


def prepared_notes(meta: DatasetMeta) -> list[str]:
    """What ``bigbatch prepare`` reports beside the token counts: invalid UTF-8 replaced by a text tokenizer, and
    in documents mode what the long-document policy drops (decided when training, where seq_len is known)."""
    notes = []
    replaced = int(meta.extra.get("utf8_replacements", 0) or 0)  # type: ignore[call-overload]
    if "utf8_replacements" in meta.extra:
        notes.append(f"{plural(replaced, 'invalid UTF-8 sequence')} replaced by U+FFFD ({meta.tokenizer} tokenizer)")
    if meta.mode == "documents":
        untrained = int(meta.extra.get("documents_without_targets", 0) or 0)  # type: ignore[call-overload]
        if untrained:
            refused = "; training on them alone is refused" if untrained == meta.documents else ""
            notes.append(
                f"{untrained:,} of {plural(meta.documents, 'document')} {'has' if untrained == 1 else 'have'} no "
                "target to train on (a single token, or "
                f"wholly prompt: an empty completion){refused}"
            )
        longest = int(meta.extra.get("longest_document", 0) or 0)  # type: ignore[call-overload]
        notes.append(
            f"long documents: longest {longest:,} tokens; training splits those longer than seq_len+1 into seq_len "
            "windows (--long-documents split, the default: 0 tokens dropped); --long-documents truncate keeps only "
            "the first seq_len+1 tokens of each (the run header counts what that drops)"
        )
    return notes


def _train_bpe(name: str, documents: Callable[[], Iterable[Document]], source: str) -> Tokenizer:
    log.info("training the %s tokenizer on %s", name, source)
    started = time.perf_counter()
    progress = CorpusProgress(f"{name} training read", started)
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
        name,
        tokenizer.vocab_size,
        seen["bytes"] / 1e6,
        elapsed,
        seen["bytes"] / 1e6 / max(elapsed, 1e-9),
    )
    return tokenizer
