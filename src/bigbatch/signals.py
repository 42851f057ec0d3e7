"""Polite stops: SIGTERM or SIGINT finish the current optimizer step, save, and exit; elsewhere SIGTERM unwinds
like Ctrl-C."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class StopRequest:
    """Records the first SIGTERM/SIGINT; a second SIGINT interrupts at once (the usual Ctrl-C twice)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def polite_stop_listening() -> bool:
    """Whether a :class:`StopRequest` (the training loop) is what SIGTERM reaches now; outside the loop SIGTERM
    unwinds (:func:`sigterm_unwinds`) or kills."""
    return isinstance(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), StopRequest)


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
