"""``bigbatch train --nproc N``: the workers under torchrun's elastic agent (:mod:`bigbatch.cli.launcher`),
and how a worker tells that launcher about a user error.

The workers write a user error into the directory named by :data:`ERROR_DIR_ENV`
instead of printing it; a worker whose peer recorded one leaves quietly (its
broken collective is a consequence, not a cause). The agent's own log lines and
its ChildFailedError report are kept back: the user sees the first user error
once and exit code 2, or one line naming the rank that failed and its exit code.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path

from bigbatch.errors import EXIT_USER_ERROR
from bigbatch.progress import plural

ERROR_DIR_ENV = "BIGBATCH_ERROR_DIR"
THREADS_ENV = "OMP_NUM_THREADS"
THREADS_SET_ENV = "BIGBATCH_SET_OMP_NUM_THREADS"
"""Set (to the thread count) in the workers when bigbatch's launcher chose ``OMP_NUM_THREADS`` for them."""
WORKER_THREADS = 1
"""What torchrun gives each of several processes on a node: the same threads, so ``--nproc N`` computes the same
bits as ``torchrun --nproc-per-node N``, and N processes do not oversubscribe the cores."""
# A worker that stopped as asked: SIGINT/SIGTERM (saved), or its output pipe closed. The agent kills the
# others with a signal (a negative exit code) once one has exited.
QUIET_CODES = {128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGPIPE}


def attempt_folder() -> Path | None:
    """Where the workers of this start (torchrun's restart count) record why they end; ``None``: no launcher.
    Each restart has its own, so that a new group never reads the reasons of the one before it."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return None
    return Path(folder) / f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') or '0'}"


def record_user_error(message: str) -> bool:
    """Under this launcher, leave ``message`` for it to print once; ``False`` when there is no launcher."""
    folder = attempt_folder()
    if folder is None:
        return False
    rank = int(os.environ.get("RANK", "0"))
    try:
        folder.mkdir(exist_ok=True)
        (folder / f"rank_{rank:05d}").write_text(message)
    except OSError:
        return False
    return True


def record_quiet_exit(code: int) -> None:
    """Under this launcher, note that this worker ends on purpose and quietly (its output pipe closed)."""
    folder = attempt_folder()
    if folder is not None:
        try:
            folder.mkdir(exist_ok=True)
            (folder / f"quiet_{int(os.environ.get('RANK', '0')):05d}").write_text(str(code))
        except OSError:
            pass


def peer_exit_code() -> int | None:
    """When another worker of this start has ended with a recorded reason (a user error, or quietly), the
    exit code this worker should end with instead of reporting its broken collective; else ``None``."""
    folder = attempt_folder()
    if folder is None or not folder.is_dir():
        return None
    if any(folder.glob("rank_*")):
        return EXIT_USER_ERROR
    quiet = sorted(folder.glob("quiet_*"))
    return int(quiet[0].read_text() or 1) if quiet else None


def set_worker_threads(environ: MutableMapping[str, str]) -> None:
    """Give the workers ``OMP_NUM_THREADS`` before torchrun's agent starts, unless the user set it: torchrun sets it
    too when it is missing, in a four-line banner on every run; the run's header says it in one line instead
    (:func:`worker_threads_note`)."""
    if THREADS_ENV in environ:
        return
    environ[THREADS_ENV] = str(WORKER_THREADS)
    environ[THREADS_SET_ENV] = str(WORKER_THREADS)


def worker_threads_note() -> str | None:
    """In a worker of ``--nproc N``: the header's words for the threads bigbatch chose, or ``None`` when it chose
    none (the user's ``OMP_NUM_THREADS``, a single process, or torchrun run directly)."""
    chosen = os.environ.get(THREADS_SET_ENV)
    if not chosen or os.environ.get(THREADS_ENV) != chosen:
        return None
    return (
        f"{plural(int(chosen), 'CPU thread')} per process (OMP_NUM_THREADS={chosen}, as torchrun sets it for several "
        "processes; set OMP_NUM_THREADS to change it)"
    )


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """The command line without ``--nproc N`` / ``--nproc=N``, for the workers."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch_under_torchrun(nproc: int, subcommand: str, argv: Sequence[str], max_restarts: int = 0) -> int:
    """Run ``bigbatch SUBCOMMAND ARGV`` (less ``--nproc``) in ``nproc`` workers and return the exit code.

    The workers run under ``python -m bigbatch.cli.launcher --standalone --nproc-per-node N`` (a worker's
    failure becomes one line) and die with this process (see :mod:`bigbatch.parallel.lifeline`). With
    ``max_restarts``, the agent restarts every worker up to that many times when one fails."""
    from bigbatch.parallel.lifeline import run_supervised

    command = [
        sys.executable,
        "-m",
        "bigbatch.cli.launcher",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "bigbatch",
        subcommand,
        *strip_nproc(argv),
    ]
    return run_supervised(command)
