"""``python -m bigbatch.cli.launcher TORCHRUN_ARGS``: torchrun's elastic agent, reporting a failure in one line.

``bigbatch train --nproc N`` (and ``verify --nproc N``) run this instead of ``torch.distributed.run`` (see
:func:`bigbatch.parallel.launch.relaunch_under_torchrun`). The agent's own log lines and its ChildFailedError
report are kept back, and so is its banner about ``OMP_NUM_THREADS`` (set here first; the run's header says it
in one line): the user sees the first user error a worker recorded
(:func:`bigbatch.parallel.launch.record_user_error`) once with exit code 2, or one line naming the rank that
failed and its exit code.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bigbatch.errors import EXIT_USER_ERROR
from bigbatch.parallel.launch import ERROR_DIR_ENV, QUIET_CODES, set_worker_threads


def _first_user_error(folder: Path) -> str | None:
    """The first rank's user error of the last start that recorded one (see
    :func:`bigbatch.parallel.launch.attempt_folder`)."""
    attempts = sorted(folder.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    for attempt in reversed(attempts):
        files = sorted(attempt.glob("rank_*"))
        if files:
            return files[0].read_text().strip()
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)  # the agent's banners, warnings, failure log
    folder = Path(tempfile.mkdtemp(prefix="bigbatch-errors-"))
    os.environ[ERROR_DIR_ENV] = str(folder)
    set_worker_threads(os.environ)  # before torchrun reads it: no banner of its own
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


if __name__ == "__main__":
    sys.exit(main())
