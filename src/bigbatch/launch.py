"""``python -m bigbatch.launch TORCHRUN_ARGS``: torchrun's elastic agent, reporting a failure in one line.

``bigbatch train --nproc N`` runs this instead of ``torch.distributed.run``. The
workers write a user error into the directory named by :data:`ERROR_DIR_ENV`
instead of printing it; a worker whose peer recorded one leaves quietly (its
broken collective is a consequence, not a cause). The agent's own log lines and
its ChildFailedError report are kept back: the user sees the first user error
once and exit code 2, or one line naming the rank that failed and its exit code.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ERROR_DIR_ENV = "BIGBATCH_ERROR_DIR"
EXIT_USER_ERROR = 2
# A worker that stopped as asked: SIGINT/SIGTERM (saved), or its output pipe closed. The agent kills the
# others with a signal (a negative exit code) once one has exited.
QUIET_CODES = {128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGPIPE}


def record_user_error(message: str) -> bool:
    """Under this launcher, leave ``message`` for it to print once; ``False`` when there is no launcher."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    rank = int(os.environ.get("RANK", "0"))
    try:
        (Path(folder) / f"rank_{rank:05d}").write_text(message)
    except OSError:
        return False
    return True


def record_quiet_exit(code: int) -> None:
    """Under this launcher, note that this worker ends on purpose and quietly (its output pipe closed)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        try:
            (Path(folder) / f"quiet_{int(os.environ.get('RANK', '0')):05d}").write_text(str(code))
        except OSError:
            pass


def peer_exit_code() -> int | None:
    """When another worker of this launch has ended with a recorded reason (a user error, or quietly), the
    exit code this worker should end with instead of reporting its broken collective; else ``None``."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return None
    if any(Path(folder).glob("rank_*")):
        return EXIT_USER_ERROR
    quiet = sorted(Path(folder).glob("quiet_*"))
    return int(quiet[0].read_text() or 1) if quiet else None


def _first_user_error(folder: Path) -> str | None:
    files = sorted(folder.glob("rank_*"))
    return files[0].read_text().strip() if files else None


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)  # the agent's banners, warnings, failure log
    folder = Path(tempfile.mkdtemp(prefix="bigbatch-errors-"))
    os.environ[ERROR_DIR_ENV] = str(folder)
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
        return 0
    except ChildFailedError as exc:
        message = _first_user_error(folder)
        if message is not None:
            print(f"bigbatch: error: {message}", file=sys.stderr)
            return EXIT_USER_ERROR
        rank, failure = exc.get_first_failure()
        others = {f.exitcode for f in exc.failures.values()} - {failure.exitcode}
        if failure.exitcode in QUIET_CODES and all(c in QUIET_CODES or c < 0 for c in others):
            return failure.exitcode  # stopped by a signal or a closed pipe, as asked: nothing to add
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"bigbatch: error: worker rank {rank} failed ({how}); its own output above says why", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:  # the launcher itself was told to stop; the agent stopped the workers
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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


def relaunch_under_torchrun(nproc: int, subcommand: str, argv: Sequence[str]) -> int:
    """Run ``bigbatch SUBCOMMAND ARGV`` (less ``--nproc``) in ``nproc`` workers and return the exit code.

    The workers run under ``python -m bigbatch.launch --standalone --nproc-per-node N`` (this module's
    :func:`main`: a worker's failure becomes one line) and die with this process (see :mod:`bigbatch.lifeline`)."""
    from bigbatch.lifeline import run_supervised

    command = [
        sys.executable, "-m", "bigbatch.launch", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "bigbatch", subcommand, *strip_nproc(argv),
    ]  # fmt: skip
    return run_supervised(command)


if __name__ == "__main__":
    sys.exit(main())
