"""One writer per run directory: ``RUN_DIR/.bigbatch-lock``, held from the moment a run is chosen until it ends.

Two runs of one command at once (a requeued job while the old one still runs, two terminals) would both append
to the metrics log and save checkpoints; the second one instead refuses in one line that names the holder, or,
with ``--wait-for-lock``, waits for it and then continues its run. Under ``bigbatch train --nproc N`` the
launcher holds the lock for the whole job and its workers recognise it (:func:`bigbatch.files.lock.inherited`);
under a plain ``torchrun`` rank 0 holds it. A lock whose holder died is taken over with a warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bigbatch.errors import ConfigError
from bigbatch.files.lock import FileLock, Holder, LockBusy, acquire, environment_for_workers, inherited
from bigbatch.files.outputs import RUN_LOCK

Say = Callable[..., None]


class RunDirInUse(ConfigError):
    """Another live process trains in the run directory."""


class RunDirLock:
    """The held lock of one run directory; :meth:`release` also removes the directories this lock created
    (the run directory and any missing parents, such as ``runs/``) that nothing wrote into: a run refused after
    choosing its directory leaves the tree as it found it."""

    def __init__(self, run_dir: Path, lock: FileLock, created: list[Path] | None = None) -> None:
        self.run_dir, self.lock, self.created = run_dir, lock, list(created or [])

    def release(self) -> None:
        self.lock.release()
        remove_empty(self.created)
        self.created = []


def remove_empty(directories: list[Path]) -> None:
    """Remove ``directories`` (innermost first) while each is empty."""
    for directory in directories:
        try:
            directory.rmdir()  # only when empty
        except OSError:
            break  # written into meanwhile, or gone: leave it and its parents as they are


def missing_directories(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first."""
    missing = []
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    return missing


def lock_run_dir(run_dir: Path, wait: bool, say: Say) -> RunDirLock:
    """Hold ``run_dir`` for this process (creating it with bigbatch's marker); :class:`RunDirInUse` when a live
    process holds it, unless ``wait``."""
    held = inherited(run_dir / RUN_LOCK)
    if held is not None:
        return RunDirLock(run_dir, held)
    created = missing_directories(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)  # its marker comes when the run starts writing (run_dir_files.py)
    try:
        lock = hold_directory(run_dir, "run directory", wait, say)
    except BaseException:
        remove_empty(created)
        raise
    return RunDirLock(run_dir, lock, created)


def hold_directory(
    directory: Path, what: str, wait: bool, say: Say, wait_flag: str | None = "--wait-for-lock"
) -> FileLock:
    """Hold an existing output ``directory`` (``what`` names it in messages) through its ``.bigbatch-lock``;
    ``wait_flag``: the calling command's flag that waits (``None``: it has none, and the refusal names none)."""

    def waiting(holder: Holder | None) -> None:
        say(
            "%s %s is in use by %s; waiting for it to end (--wait-for-lock)",
            what,
            directory,
            holder.describe() if holder else "another process",
        )

    try:
        lock = acquire(directory / RUN_LOCK, wait=wait, on_wait=waiting)
    except LockBusy as exc:
        who = exc.holder.describe() if exc.holder else "another process"
        waits = f", or pass {wait_flag} to go on once it ends" if wait_flag else ""
        raise RunDirInUse(
            f"{what} {directory} is in use by another bigbatch process ({who}); nothing was written: wait for it "
            f"to end or stop it{waits}"
        ) from None
    if lock.stale is not None:
        say(
            "%s %s: took over the lock of a process that ended without releasing it (%s)",
            what,
            directory,
            lock.stale.describe(),
            level=logging.WARNING,
        )
    return lock


@contextmanager
def held_for_workers(run_dir: Path, wait: bool, say: Say) -> Iterator[None]:
    """``bigbatch train --nproc N``: the launcher holds ``run_dir`` while the workers it starts inside the block
    run; they recognise the lock through their environment, and another job's workers are refused."""
    lock = lock_run_dir(run_dir, wait, say)
    saved = {name: os.environ.get(name) for name in environment_for_workers(lock.lock)}
    os.environ.update(environment_for_workers(lock.lock))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        lock.release()
