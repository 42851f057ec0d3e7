"""What the command line does with its output: log lines to the current stdout, a closed pipe, out of memory."""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import sys
from typing import Any

from bigbatch.parallel.signals import listening_stop_request


class CurrentStdoutHandler(logging.StreamHandler):
    """Log lines to whatever ``sys.stdout`` is when they are written, not the stream it was when logging
    was set up (a redirected or replaced stdout would otherwise receive, or fail on, later lines)."""

    @property
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        """A closed output pipe (``bigbatch train | head``) is not a logging error to report on every line.

        The rest of the output goes nowhere; a run that listens for SIGTERM stops as politely as on SIGTERM
        (the step ends and is saved), anything else ends at once, quietly (see :func:`~bigbatch.cli.app.main`)."""
        if not isinstance(sys.exc_info()[1], BrokenPipeError):
            super().handleError(record)
            return
        silence_stdout()
        stop = listening_stop_request()
        if stop is not None:  # inside the training loop: finish the step, save, stop, as on SIGTERM
            if not stop.signum:  # nobody asked at the console, so nothing is announced there
                stop.request(signal.SIGTERM, announce=False)
            return
        raise BrokenPipeError(errno.EPIPE, "output pipe closed")


def out_of_memory(exc: BaseException) -> str:
    """What ran out, when ``exc`` is an allocation failure (CPU allocator, CUDA, Python); else ``""``."""
    text = str(exc)
    if isinstance(exc, MemoryError):
        return "Python could not allocate memory"
    for pattern in (r"tried to allocate [\d.]+ ?[KMGT]?i?B", r"tried to allocate \d+ bytes"):
        match = re.search(pattern, text)
        if match and ("out of memory" in text.lower() or "can't allocate memory" in text):
            return match.group(0)
    return "the device is out of memory" if "out of memory" in text.lower() else ""


OUT_OF_MEMORY_ADVICE: dict[str, str] = {
    "train": "lower --micro-batch (auto: the largest that fits), --seq-len or a preset's --block-size, or pick a "
    "smaller --model",
    "eval": "lower --micro-batch or --seq-len",
    "critical-batch": "lower --micro-batch",
    "sample": "lower --num-samples",
    "plan": "lower --micro-batch or --seq-len, or pick a smaller --model",
    "memory": "lower --max-micro-batch or --seq-len, or pick a smaller --model",
    "verify": "lower --micro-batch, --k or --seq-len, or pick a smaller --model",
    "prepare": "lower --workers or --shard-tokens",
}
"""What asks for less memory, in each command's own flags (a flag another command has would be refused)."""


def out_of_memory_advice(command: str) -> str:
    """The fix for running out of memory in ``command``; a command with no such flag: more memory."""
    return OUT_OF_MEMORY_ADVICE.get(command, "free memory, or run it on a machine with more")


def silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so later writes (and the flush at exit) neither fail nor complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (a test's StringIO): nothing to silence
        pass
