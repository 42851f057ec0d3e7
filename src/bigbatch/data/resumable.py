"""A prepare that an interruption does not waste: the staging directory of an ``hf:`` source is
``.OUT.partial`` beside ``OUT``, and every few seconds the tokens written so far, the per-document lengths and
the position in the source (documents done) are made durable there (``progress.json``). Interrupted (Ctrl-C,
SIGTERM, a kill, a lost network), the same command continues from that position: the documents already done
are read past without tokenizing, and the shards come out as an uninterrupted prepare writes them.

A partial directory whose settings differ (another source, tokenizer or files) is started afresh. Another
prepare of the same ``OUT`` that holds the partial directory's lock leaves this one on a private staging
directory (nothing resumable, as for raw text). Any other failure (a bad record, a missing column) removes the
partial directory: running again would meet it again.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from bigbatch.data.writer import staged_directory
from bigbatch.files.atomic import apply_umask, write_text_atomically
from bigbatch.progress import plural

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
LENGTHS_FILE = ".lengths.tmp"  # per document: tokens, prompt tokens (int64 pairs), beside the token stream
CHECKPOINT_SECONDS = 5.0
"""How often the position is made durable (a flush and fsync of the stream: cheap next to tokenizing)."""


def partial_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


@dataclass
class Position:
    """What the partial directory holds, durably."""

    fingerprint: str = ""
    tokenizer_ready: bool = False  # a trained BPE is saved in the directory
    documents: int = 0  # non-empty documents tokenized and written
    stream_bytes: int = 0  # of the token stream file
    n_bytes: int = 0  # text read for them
    utf8_replacements: int = 0
    utf8_documents: int = 0


class Checkpoint:
    """The partial directory's position, saved by :meth:`save` every :data:`CHECKPOINT_SECONDS`."""

    def __init__(self, staging: Path, position: Position) -> None:
        self.staging = staging
        self.position = position
        self.saved_at = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.saved_at >= CHECKPOINT_SECONDS

    def save(self, **changes: Any) -> None:
        for key, value in changes.items():
            setattr(self.position, key, value)
        path = self.staging / PROGRESS_FILE
        write_text_atomically(path, json.dumps(asdict(self.position)))
        self.saved_at = time.monotonic()

    def sync(self, stream: IO[bytes], lengths: IO[bytes], **changes: Any) -> None:
        """Make the stream and lengths written so far durable, then record the position they reach."""
        for handle in (stream, lengths):
            handle.flush()
            os.fsync(handle.fileno())
        self.save(stream_bytes=stream.tell(), **changes)


def _read_position(staging: Path) -> Position | None:
    try:
        return Position(**json.loads((staging / PROGRESS_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


@contextmanager
def resumable_directory(out: Path, fingerprint: str) -> Iterator[tuple[Path, Checkpoint | None]]:
    """Like :func:`~bigbatch.data.writer.staged_directory`, in ``.OUT.partial`` kept on an interruption (see
    the module's note); yields the directory and its :class:`Checkpoint` (``None``: a private staging
    directory, the partial one being busy)."""
    staging = partial_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir(exist_ok=True)
    lock = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another prepare of the same OUT is writing it
        os.close(lock)
        with staged_directory(out) as private:
            yield private, None
        return
    try:
        position = _read_position(staging)
        if position is None or position.fingerprint != fingerprint:
            for child in staging.iterdir():  # other settings, or nothing saved yet: start afresh
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            position = Position(fingerprint=fingerprint)
        elif position.documents:
            log.info(
                "%s: resuming an interrupted prepare after %s (%s)",
                out,
                plural(position.documents, "document"),
                staging,
            )
        apply_umask(staging, directory=True)
        checkpoint = Checkpoint(staging, position)
        try:
            yield staging, checkpoint
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what is saved
            if (staging / PROGRESS_FILE).is_file():
                log.warning(
                    "%s: prepare interrupted; %s %s kept in %s: run the same command to resume",
                    out,
                    plural(checkpoint.position.documents, "document"),
                    "is" if checkpoint.position.documents == 1 else "are",
                    staging,
                )
            else:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        (staging / PROGRESS_FILE).unlink(missing_ok=True)
        if out.exists():
            out.rmdir()  # empty, checked by the caller
        os.replace(staging, out)
    finally:
        os.close(lock)


def skip_done(documents: Callable[[], Iterable[Any]], done: int) -> Callable[[], Iterator[Any]]:
    """``documents`` without the first ``done`` non-empty ones (those a partial directory holds already)."""

    def rest() -> Iterator[Any]:
        left = done
        for doc in documents():
            if left and not doc.empty:
                left -= 1
                continue
            if not left:
                yield doc

    return rest


def restore_lengths(staging: Path, stream_path: Path, position: Position) -> tuple[list[int], list[int]]:
    """Cut the stream and lengths files back to ``position`` (a crash may have written past it) and return
    the per-document token and prompt lengths they hold."""
    lengths_path = staging / LENGTHS_FILE
    for path, size in ((stream_path, position.stream_bytes), (lengths_path, position.documents * 16)):
        with open(path, "ab") as handle:
            handle.truncate(size)
    pairs = np.fromfile(lengths_path, dtype=np.int64).reshape(-1, 2)
    return pairs[:, 0].tolist(), pairs[:, 1].tolist()


def write_lengths(handle: IO[bytes], length: int, prompt_length: int) -> None:
    handle.write(np.array([length, prompt_length], dtype=np.int64).tobytes())
