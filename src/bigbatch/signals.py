"""Polite stops: SIGTERM or SIGINT finish the current optimizer step, save, and exit."""

from __future__ import annotations

import signal
import threading
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
