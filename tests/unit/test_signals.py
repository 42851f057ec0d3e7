"""Which handler SIGTERM reaches decides what a closed output pipe does: stop politely only inside the loop; the
first Ctrl-C is announced at once even while the main thread is busy."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from bigbatch.parallel.signals import StopRequest, listening_stop_request, sigterm_unwinds


def test_only_the_training_loop_listens_for_a_polite_stop() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert listening_stop_request() is None
    with sigterm_unwinds():  # what the CLI installs around every command: SIGTERM unwinds, it does not stop politely
        assert callable(signal.getsignal(signal.SIGTERM)) and listening_stop_request() is None
        with StopRequest() as stop:
            assert listening_stop_request() is stop
        assert listening_stop_request() is None
    assert signal.getsignal(signal.SIGTERM) == before


def busy_in_one_operation(seconds: float) -> None:
    """The main thread inside one long operation that lets no Python handler run until it returns (a forward or
    backward of seconds): SIGINT is blocked here, so the kernel hands it to another thread, and the handler runs
    only once this returns."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        time.sleep(seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_the_first_ctrl_c_is_announced_while_the_main_thread_is_busy_and_not_taken_for_a_second() -> None:
    """The announcement comes from a thread woken by the signal, not from the handler, which waits for the main
    thread; the handler that runs seconds later counts the same press, not a second one (which would abort)."""
    announced: list[tuple[int, float]] = []
    with StopRequest(lambda signum: announced.append((signum, time.monotonic()))) as stop:
        sent = time.monotonic()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGINT)).start()  # a double tap: the same press
        busy_in_one_operation(3.0)
        returned = time.monotonic()
        time.sleep(0.1)  # the main thread's handler runs now: no KeyboardInterrupt
        assert stop.signum == signal.SIGINT
        assert len(announced) == 1 and announced[0][0] == signal.SIGINT
        assert announced[0][1] < returned, "announced only once the main thread was back"
        assert announced[0][1] - sent < 2.5  # 0.2 s plus a wake-up, on however loaded a machine
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a real second press, seconds later: abort
            time.sleep(1.0)
    assert len(announced) == 1


def test_signals_are_passed_on_to_the_previous_wakeup_descriptor() -> None:
    """Python's wakeup descriptor is one per process: what the watcher reads still reaches its earlier owner (the
    suite's guard counts SIGTERMs there) and is given back to it after the loop."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        with StopRequest() as stop:
            watcher = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(watcher, warn_on_full_buffer=False)
            assert watcher not in (-1, write_fd)  # the watcher's, while inside
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        assert stop.signum == signal.SIGTERM
        assert signal.SIGTERM in os.read(read_fd, 64)
    finally:
        assert signal.set_wakeup_fd(previous, warn_on_full_buffer=False) == write_fd
        os.close(read_fd)
        os.close(write_fd)
