"""Atomic file writes: a file is either the old one or the whole new one, after a crash or a power cut too.

The new content goes to a temporary file beside the target, is flushed and fsynced, and is renamed over the
target; then the directory is fsynced so the rename itself is durable. Checkpoints, their commit markers, the
metrics log when a resume cuts it back, logger state and data-preparation positions are all written this way.

File modes: what bigbatch writes gets the permissions the user's umask gives, as ``open()`` would.
``tempfile.mkstemp`` creates 0600 files and ``mkdtemp`` 0700 directories, whatever the umask; files written that
way and renamed into place (checkpoints, exports, prepared datasets) are set to ``0666 & ~umask`` (directories
``0777 & ~umask``) before the rename (:func:`apply_umask`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigbatch.files.json_text import to_json


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def apply_umask(target: Path | str | int, directory: bool = False) -> None:
    """Give ``target`` (a path, or an open file descriptor) the mode a plain ``open``/``mkdir`` would have."""
    mode = (0o777 if directory else 0o666) & ~current_umask()
    if isinstance(target, int):
        os.fchmod(target, mode)
    else:
        os.chmod(target, mode)


def fsync_dir(folder: Path) -> None:
    """Make the entries of ``folder`` (a rename into it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RecordingWriter:
    """A binary file that remembers the first OS error of a write: ``torch.save`` reports a full disk as a
    RuntimeError ("unexpected pos ...") that hides the cause."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.handle.write(data))
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return int(self.handle.fileno())


def write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """``write(handle)`` into a temporary file beside ``path``, fsync, rename over ``path``, fsync the directory.

    A failed write (a full disk, a quota) raises the :class:`OSError` that caused it, whatever the writer
    wrapped it in, and removes the temporary file; ``path`` and every other file stay as they were."""
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # a missing or read-only folder: name the file asked for, not the temporary one
        raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
    recorder: RecordingWriter | None = None
    try:
        apply_umask(fd)  # mkstemp makes 0600; the file gets the mode the user's umask gives, as open() would
        with os.fdopen(fd, "wb") as handle:
            recorder = RecordingWriter(handle)
            write(recorder)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        Path(tmp_name).unlink(missing_ok=True)
        if recorder is not None and recorder.error is not None and recorder.error is not exc:
            raise recorder.error from exc
        raise
    fsync_dir(path.parent)


def write_text_atomically(path: Path, text: str) -> None:
    """``text`` (UTF-8) as the whole content of ``path``, written by :func:`write_atomically`."""
    data = text.encode("utf-8")
    write_atomically(path, lambda handle: handle.write(data))


def write_json_atomically(path: Path, payload: Any, indent: int | None = 2) -> None:
    """``payload`` as standard JSON (:func:`bigbatch.files.json_text.to_json`: a NaN is ``null``, named in the
    object's ``nonfinite`` field) and a newline, written by :func:`write_text_atomically`: never half a file."""
    write_text_atomically(path, to_json(payload, indent=indent) + "\n")
