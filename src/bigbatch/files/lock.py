"""One writer at a time: an advisory lock file that names its holder.

The lock is ``flock`` on a small file holding the holder's host, pid, start time and command. The kernel
releases a ``flock`` when its process dies in any way (SIGKILL, an out-of-memory kill; a power loss clears
it with the machine), so a lock left by a dead run never blocks the next one: the file is still there,
naming the holder that never released it, and the next process takes it over with a warning. On Linux, NFS
emulates ``flock`` with byte-range locks that the server arbitrates, so the lock holds across nodes that
share a run directory.

The lock file never exists without its holder's record, and a record is never rewritten: a process writes
its record into a file of its own beside the lock, locks that file, and only then puts it in place, with
``link`` (which fails when the name is taken) or, over a dead holder's file, ``rename``. (Creating the lock
file empty and writing the record after ``flock`` let a second process find the lock held with no record
yet, and refuse without naming the holder.)

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

SETTLE_SECONDS, SETTLE_TRIES = 0.01, 200
"""How often, and how many times, a busy lock whose file is being replaced is looked at again before its
record is reported as it is."""


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
    own = path.with_name(f".{path.name}.{holder.token}")  # this process's record, locked before it is the lock
    fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # the umask applies
    try:
        os.write(fd, (json.dumps(asdict(holder)) + "\n").encode())
        os.fsync(fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows this file yet: never busy
        return _put_in_place(own, path, fd, holder, wait, on_wait, poll)
    except BaseException:
        os.close(fd)
        raise
    finally:
        own.unlink(missing_ok=True)  # linked as the lock (or renamed into it): the lock's name is what stays


def _put_in_place(
    own: Path,
    path: Path,
    fd: int,
    holder: Holder,
    wait: bool,
    on_wait: Callable[[Holder | None], None] | None,
    poll: float,
) -> FileLock:
    """Make ``own`` (locked by ``fd``) the lock at ``path``: at once when the name is free, over the file of a
    holder that died, or once a live holder ends with ``wait`` (else :class:`LockBusy`)."""
    waiting, settling = False, 0
    while True:
        try:
            os.link(own, path)
            return FileLock(path, fd, holder, None)
        except FileExistsError:
            if _same_file(fd, path):  # NFS: a retried link that had worked the first time
                return FileLock(path, fd, holder, None)
        try:
            found = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # released between our link and our open: the name is free again
        try:
            taken = _take_over(found, own, path, fd, holder)
            if taken is not None:
                return taken
            current = _read(found)
            busy = _same_file(found, path)
        finally:
            os.close(found)  # a dead holder's file taken over above is unnamed now: nothing is lost
        if not busy:
            continue  # released, or replaced by a new holder, since we opened it: look at the name again
        if settling < SETTLE_TRIES and _record_of_the_dead(current):
            settling += 1  # another process holds the dead holder's file for a moment, to take it over
            time.sleep(SETTLE_SECONDS)
            continue
        if not wait:
            raise LockBusy(path, current)
        if not waiting and on_wait is not None:
            on_wait(current)
        waiting = True
        time.sleep(poll)


def _take_over(found: int, own: Path, path: Path, fd: int, holder: Holder) -> FileLock | None:
    """The lock, when the file ``found`` (opened at ``path``) is a dead holder's: ``own`` replaces it while
    ``found`` is locked here, so no other process can take it over too. ``None`` while another holds it."""
    try:
        fcntl.flock(found, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return None
    if not _same_file(found, path):
        return None  # released and removed since we opened it: the caller finds the name free
    stale = _read(found)
    os.rename(own, path)  # one step: the name never leads to no record
    return FileLock(path, fd, holder, stale)


def _record_of_the_dead(record: Holder | None) -> bool:
    """Whether a busy lock's ``record`` cannot be its holder's: none (a version of bigbatch that wrote it after
    locking is about to), or a process of this host that no longer runs (its file is being taken over)."""
    if record is None:
        return True
    if record.host != socket.gethostname():
        return False  # another node's process: this one cannot tell
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


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
