"""Polite stops: SIGTERM or SIGINT finish the current optimizer step, save, and exit; elsewhere SIGTERM unwinds
like Ctrl-C."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

REPEAT_GRACE_SECONDS = 1.0
"""A second Ctrl-C this soon after the first is the same press (a double tap), not a request to abort."""


class SignalWatcher:
    """Python's wakeup descriptor, taken over for a thread to read: each signal's number, the moment it arrives.

    Python runs a signal's handler in the main thread only, and only once that thread is back in the interpreter:
    during a long torch operation (a forward or backward of seconds on a loaded machine) the handler waits for it,
    and so would anything it prints. The C-level handler, though, writes each signal's number at once to the
    descriptor given to :func:`signal.set_wakeup_fd`: a thread blocked on that pipe wakes at once and runs
    while the main thread is busy (torch releases the interpreter lock inside its operations). The descriptor is
    one per process, so what is read is passed on to whoever held it before (asyncio, the test suite's guard)."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)  # set_wakeup_fd needs it; a read ends when the pipe is empty
        self._lock = threading.Lock()  # the thread and the main thread's handler both read the pipe
        self._previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)  # main thread only

    def wait(self) -> None:
        """Block until something was written (a signal, or :meth:`poke`)."""
        select.select([self._read_fd], [], [])

    def poke(self) -> None:
        """Wake :meth:`wait` (0 is no signal's number)."""
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:
            pass  # a full pipe wakes it anyway

    def take(self, record: Callable[[int], None]) -> None:
        """Call ``record`` with each signal's number written so far, in order, and each once whoever reads it."""
        with self._lock:
            data = b""
            while True:
                try:
                    chunk = os.read(self._read_fd, 512)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                data += chunk
            signals = data.replace(b"\0", b"")  # without the pokes
            if signals and self._previous >= 0:
                try:
                    os.write(self._previous, signals)
                except OSError:
                    pass  # a full or closed descriptor: its owner would have lost these bytes without us
            for signum in signals:
                record(signum)

    def close(self) -> None:
        """Give the wakeup descriptor back (main thread); what arrived before can still be taken."""
        signal.set_wakeup_fd(self._previous, warn_on_full_buffer=False)

    def release(self) -> None:
        """Close the pipe, once nothing waits on it any more."""
        os.close(self._read_fd)
        os.close(self._write_fd)


class StopRequest:
    """Records the first SIGTERM/SIGINT and calls ``announce(signum)`` at once (so the user sees that the stop is
    under way: from a thread of its own, while the main thread may be busy in a step for seconds); a second
    SIGINT, at least :data:`REPEAT_GRACE_SECONDS` later, interrupts the main thread (the usual Ctrl-C twice:
    abort without saving).

    Each signal is counted once, from the :class:`SignalWatcher`'s pipe, by the thread or by Python's handler,
    whichever reads it first, and timed when read: the thread reads it at once, so a first press whose handler
    runs seconds late (after a long operation) is not mistaken for a second one."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(
        self, announce: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.signum = 0
        self._announce, self._clock = announce, clock
        self._first_at = 0.0
        self._due = 0  # the first signal, recorded and not announced yet
        self._abort = False  # a second SIGINT came: the main thread's handler raises KeyboardInterrupt
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._watcher: SignalWatcher | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Python's handler, in the main thread, when it gets there (once for one signal or several)."""
        if self._watcher is not None:
            self._watcher.take(self._received)
            self._watcher.poke()  # the thread announces: a handler may run inside a write to the same console
        else:  # not listening from a thread (a test calling it directly)
            self._received(signum)
            self._announce_due()
        with self._lock:
            abort, self._abort = self._abort, False
        if abort:
            raise KeyboardInterrupt

    def _received(self, signum: int) -> None:
        """One signal, read now: the first SIGINT/SIGTERM stops after the step, a SIGINT past the grace aborts."""
        if signum not in self.SIGNALS:
            return  # another signal with a Python handler (SIGCHLD, say) also writes its number
        with self._lock:
            now = self._clock()
            if not self.signum:
                self.signum, self._first_at, self._due = signum, now, signum
            elif signum == signal.SIGINT and now - self._first_at >= REPEAT_GRACE_SECONDS:
                self._abort = True

    def _announce_due(self) -> None:
        with self._lock:
            due, self._due = self._due, 0
        if due and self._announce is not None:
            try:
                self._announce(due)
            except OSError:
                pass  # the console is gone (a closed pipe): there is no one to tell, and the stop goes on

    def _listen(self) -> None:
        assert self._watcher is not None
        while True:
            self._watcher.wait()
            self._watcher.take(self._received)
            self._announce_due()
            if self._closing:
                return

    def request(self, signum: int, announce: bool) -> None:
        """Stop at the end of this step as on ``signum``; ``announce``: tell the user at once."""
        with self._lock:
            if self.signum:
                return
            self.signum, self._first_at = signum, self._clock()
        if announce and self._announce is not None:
            self._announce(signum)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._watcher = SignalWatcher()
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._thread = threading.Thread(target=self._listen, name="bigbatch-stop-signals", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._watcher is not None and self._thread is not None:
            self._watcher.close()
            self._closing = True
            self._watcher.poke()
            self._thread.join(timeout=5.0)
            self._watcher.take(self._received)  # what came after the thread's last look is passed on
            if not self._thread.is_alive():  # else it is stuck writing to a console nobody reads: keep its pipe
                self._watcher.release()
            self._watcher = self._thread = None


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
