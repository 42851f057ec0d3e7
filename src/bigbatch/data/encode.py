"""Documents tokenized piece by piece, in this process or in a pool of worker processes, results in order."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from bigbatch.data.corpus import Document
from bigbatch.data.text import InvalidUTF8, split_text
from bigbatch.data.tokenizers import BPETokenizer, Tokenizer, get_tokenizer
from bigbatch.errors import DataError

TASK_BYTES = 1 << 18  # text per worker task
PARALLEL_MIN_BYTES = 1_000_000 if sys.platform.startswith("linux") else 16_000_000
"""Below this much text (estimated from the file sizes) a worker pool costs more than it saves."""
MAX_WORKERS = 32


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def worker_count(workers: int | None, tokenizer: Tokenizer, total_bytes: int | None) -> int:
    """``total_bytes``: the size of the corpus files; ``None`` for a stream of unknown size (taken as large)."""
    if workers is not None:
        return workers
    if tokenizer.name == "byte":
        return 1  # a vectorized copy: faster than shipping the text to another process
    if total_bytes is not None and total_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(_cpu_count(), MAX_WORKERS))


Piece = tuple[bytes, bool]
"""Text to encode, and whether it continues a text (a document's later piece, a completion after its prompt)."""


def _encode_piece(tokenizer: Tokenizer, piece: Piece, dtype: np.dtype) -> np.ndarray:
    data, continues = piece
    encode_continuation = getattr(tokenizer, "encode_continuation", None) if continues else None
    if encode_continuation is not None:  # a SentencePiece-style pipeline: no "▁" prefix inside a text
        return np.asarray(encode_continuation(data), dtype=dtype)
    encode_array = getattr(tokenizer, "encode_array", None)
    if encode_array is not None:
        return encode_array(data, dtype)
    return np.asarray(tokenizer.encode(data), dtype=dtype)


def encoded_documents(
    documents: Callable[[], Iterable[Document]],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    workers: int,
    invalid: InvalidUTF8 | None = None,
) -> Iterator[tuple[np.ndarray, int, int]]:
    """``(token ids, prompt length in tokens, bytes of text)`` per non-empty document, in corpus order; the ids
    end with the end-of-text token where the tokenizer has one. ``invalid`` counts invalid UTF-8."""
    plans: deque[tuple[int, int, int]] = deque()  # per document: prompt pieces, all pieces, bytes

    def pieces() -> Iterator[Piece]:
        for doc in documents():
            if doc.conversation is not None:
                raise DataError(
                    f"{doc.name} is a conversation among text rows, or one without a chat template: conversations "
                    "need --mode documents and the model's tokenizer with its chat template (--tokenizer file:DIR), "
                    "and every row as 'messages'"
                )
            if doc.answers is not None:
                raise DataError(
                    f"{doc.name} is a row of {doc.answers.kind} among text rows: rows of answers are prepared in "
                    "documents mode, each source in one shape; prepare them apart (--mode documents or auto)"
                )
            prompt = split_text(doc.prompt) if doc.prompt else []
            data = split_text(doc.data) if doc.data else []
            if invalid is not None:  # piece by piece (cut between ASCII characters): memory stays flat
                invalid.check(doc.name, prompt + data)
            if not prompt and not data:
                continue
            plans.append((len(prompt), len(prompt) + len(data), len(doc.data) + len(doc.prompt)))
            for i, piece in enumerate(prompt + data):
                yield piece, i > 0

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


# ---------------------------------------------------------------------------------------- the worker pool

_WORKER_TOKENIZER: Any = None  # set once in each worker process by _init_worker


def _init_worker(name: str, tokenizer_json: str | None) -> None:
    global _WORKER_TOKENIZER
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool is ended by the parent, which handles signals
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_TOKENIZER = BPETokenizer.from_str(name, tokenizer_json) if tokenizer_json else get_tokenizer(name)


def _encode_task(pieces: list[Piece], dtype: str) -> list[np.ndarray]:
    return [_encode_piece(_WORKER_TOKENIZER, piece, np.dtype(dtype)) for piece in pieces]


def _tasks(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    task: list[Piece] = []
    size = 0
    for piece in pieces:
        task.append(piece)
        size += len(piece[0])
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
    pieces: Iterable[Piece], tokenizer: Tokenizer, dtype: np.dtype, workers: int
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
