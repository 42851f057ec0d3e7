"""Polite stops: SIGTERM or SIGINT finish the current optimizer step, save, and exit; elsewhere SIGTERM unwinds
like Ctrl-C."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

REPEAT_GRACE_SECONDS = 1.0
"""A second Ctrl-C this soon after the first is the same press (a double tap), not a request to abort."""


class StopRequest:
    """Records the first SIGTERM/SIGINT and calls ``announce(signum)`` at once (so the user sees that the stop is
    under way); a second SIGINT, at least :data:`REPEAT_GRACE_SECONDS` later, interrupts at once (the usual
    Ctrl-C twice: abort without saving)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(
        self, announce: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.signum = 0
        self._announce, self._clock = announce, clock
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            if signum == signal.SIGINT and self._clock() - self._first_at >= REPEAT_GRACE_SECONDS:
                raise KeyboardInterrupt
            return  # already stopping
        self.request(signum, announce=True)

    def request(self, signum: int, announce: bool) -> None:
        """Stop at the end of this step as on ``signum``; ``announce``: tell the user at once."""
        self.signum, self._first_at = signum, self._clock()
        if announce and self._announce is not None:
            self._announce(signum)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def listening_stop_request() -> StopRequest | None:
    """The :class:`StopRequest` (the training loop) that SIGTERM reaches now, or ``None``: outside the loop SIGTERM
    unwinds (:func:`sigterm_unwinds`) or kills."""
    handler = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return handler if isinstance(handler, StopRequest) else None


class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop (prepare, eval, sample, memory sweeps, start-up): it unwinds the stack
    as Ctrl-C does, so clean-ups run (a half-prepared dataset is removed), and the CLI exits 143."""


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread (instead of killing the
    process on the spot); the training loop's :class:`StopRequest` takes over inside it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
