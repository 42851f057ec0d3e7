"""One writer at a time: an advisory lock file that names its holder.

The lock is ``flock`` on a small file holding the holder's host, pid, start time and command. The kernel
releases a ``flock`` when its process dies in any way (SIGKILL, an out-of-memory kill; a power loss clears
it with the machine), so a lock left by a dead run never blocks the next one: the file is still there,
naming the holder that never released it, and the next process takes it over with a warning. On Linux, NFS
emulates ``flock`` with byte-range locks that the server arbitrates, so the lock holds across nodes that
share a run directory.

A clean release removes the file while still holding it; a process that opened the old file in the meantime
notices (the path no longer leads to the file it locked) and tries again, so two holders can never each hold
a different file under one name.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

POLL_SECONDS = 0.5
"""How often a waiting process tries a busy lock again."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock, as written into its file."""

    host: str
    pid: int
    since: float  # seconds since the epoch
    command: str
    token: str  # unique per acquisition: lets workers recognise the lock their own launcher holds

    def describe(self, now: float | None = None) -> str:
        """``pid 4242 on host gpu1 since 2026-12-01 21:30:05 UTC, 3 min ago: bigbatch train --model nano``"""
        started = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        age = _age((now if now is not None else time.time()) - self.since)
        return f"pid {self.pid} on host {self.host} since {started}, {age} ago: {self.command}"

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder recorded in ``text``, or ``None`` for an empty or unreadable record."""
        try:
            fields = json.loads(text)
            return cls(
                str(fields["host"]),
                int(fields["pid"]),
                float(fields["since"]),
                str(fields["command"]),
                str(fields["token"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def this_process(command: str | None = None) -> Holder:
    """A holder record for the calling process."""
    if command is None:
        command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python"
    if len(command) > 200:
        command = command[:197] + "..."
    return Holder(socket.gethostname(), os.getpid(), time.time(), command, uuid.uuid4().hex)


class LockBusy(Exception):
    """The lock is held by a live process (``holder``, or ``None`` when its record could not be read)."""

    def __init__(self, path: Path, holder: Holder | None) -> None:
        super().__init__(f"{path} is held by {holder.describe() if holder else 'another process'}")
        self.path, self.holder = path, holder


class FileLock:
    """A held lock; :meth:`release` (or leaving the ``with`` block) gives it up and removes its file."""

    def __init__(self, path: Path, fd: int | None, holder: Holder, stale: Holder | None) -> None:
        self.path, self.holder = path, holder
        self.stale = stale  # the record of a holder that died without releasing, taken over here
        self._fd = fd  # None: held on this process's behalf by its launcher (see :func:`inherited`)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                self.path.unlink()
        except OSError:
            pass  # the lock itself goes with the descriptor; a leftover file is taken over as stale
        finally:
            os.close(fd)

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a lock dropped without release (an exception in a library caller)
        if self._fd is not None:
            os.close(self._fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read(fd: int) -> Holder | None:
    data = os.pread(fd, 4096, 0)
    return Holder.parse(data.decode("utf-8", errors="replace")) if data else None


def read_holder(path: Path) -> Holder | None:
    """The record in a lock file (held or left behind), or ``None``."""
    try:
        return Holder.parse(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


def acquire(
    path: Path,
    wait: bool = False,
    on_wait: Callable[[Holder | None], None] | None = None,
    holder: Holder | None = None,
    poll: float = POLL_SECONDS,
) -> FileLock:
    """Take the lock at ``path`` (its folder must exist) for ``holder`` (default: this process).

    A lock held by a live process raises :class:`LockBusy`, or with ``wait`` is tried again every ``poll``
    seconds until it is free (``on_wait`` is called once, with the holder, when the wait begins)."""
    holder = holder or this_process()
    waiting = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # the umask applies, as for open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            current = _read(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            if not wait:
                raise LockBusy(path, current) from None
            if not waiting and on_wait is not None:
                on_wait(current)
            waiting = True
            time.sleep(poll)
            continue
        if not _same_file(fd, path):  # released (and removed) between our open and our lock: open the new one
            os.close(fd)
            continue
        try:
            stale = _read(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(asdict(holder)) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return FileLock(path, fd, holder, stale)


INHERITED_ENV = "BIGBATCH_HELD_LOCK"
"""``PATH TOKEN`` of a lock that a launcher holds for the workers it starts (``bigbatch train --nproc N``)."""


def inherited(path: Path) -> FileLock | None:
    """The lock at ``path`` when this process's launcher holds it on its behalf (the environment names the lock
    and the file still records the launcher's token), else ``None``."""
    entry = os.environ.get(INHERITED_ENV, "")
    named, _, token = entry.rpartition(" ")
    if not named or Path(named).resolve() != path.resolve():
        return None
    holder = read_holder(path)
    if holder is None or holder.token != token:
        return None
    return FileLock(path, None, holder, None)


def environment_for_workers(lock: FileLock) -> dict[str, str]:
    """What the workers of the process holding ``lock`` need to know that they work under it."""
    return {INHERITED_ENV: f"{lock.path.resolve()} {lock.holder.token}"}
