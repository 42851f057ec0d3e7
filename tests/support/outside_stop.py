"""A SIGTERM from outside the test run (a CI time limit, ``timeout``, a job being cancelled) ends the run with one
clear line, instead of surfacing as an unrelated failed assertion.

Why it needs care: a trainer running inside pytest installs its own SIGTERM handler (a polite stop: finish the
step, save, return), so an outside SIGTERM makes that test's run stop early and fail somewhere else, on an
assertion about steps or files. Python writes the number of every signal it handles to the wakeup file
descriptor, whoever's handler then runs, so the guard counts them there. A process sends itself a signal only
through ``os.kill``, ``os.killpg`` or ``signal.raise_signal`` (a test on purpose, or bigbatch's own fault
injection, ``BIGBATCH_FAULT=sigterm:...``), so the guard wraps those and counts the SIGTERMs they aim at this
process: after each test, SIGTERMs beyond those came from outside, the test is reported as stopped from
outside, and the session stops. Outside any handler of the code under test, the guard's own handler ends the
session at once.

The hooks below are imported by ``tests/conftest.py`` (a plugin: ``pytest -p outside_stop`` loads them in a run
of its own, as the guard's test does).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

OUTSIDE_SIGTERM = (
    "SIGTERM from outside the test run (a time limit or a cancelled job?): the run stopped here, and this "
    "test's outcome is not a verdict on the code"
)


class OutsideStopGuard:
    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._own_sent = 0  # SIGTERMs this process sent itself since the last count
        self._originals: dict[tuple[Any, str], Callable[..., None]] = {}

    def install(self) -> None:
        """Point Python's signal wakeup descriptor at the guard, handle SIGTERM, and count the SIGTERMs this
        process sends itself."""
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        me = os.getpid()
        self._wrap(os, "kill", lambda pid, sig: pid in (me, 0, -os.getpgid(me)) and sig == signal.SIGTERM)
        self._wrap(os, "killpg", lambda pgid, sig: pgid in (0, os.getpgid(me)) and sig == signal.SIGTERM)
        self._wrap(signal, "raise_signal", lambda sig: sig == signal.SIGTERM)

    def _wrap(self, module: Any, name: str, aims_at_me: Callable[..., bool]) -> None:
        original = getattr(module, name)
        self._originals[(module, name)] = original

        def counted(*args: Any) -> None:
            if aims_at_me(*args):
                self._own_sent += 1
            original(*args)

        setattr(module, name, counted)

    def rearm(self) -> None:
        """Take the wakeup descriptor back, in case the code under test pointed it elsewhere."""
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def outside_sigterms(self) -> int:
        """SIGTERMs received since the last call that this process did not send itself; resets its own count."""
        received = 0
        while True:
            try:
                chunk = os.read(self._read_fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            received += chunk.count(signal.SIGTERM)
        outside, self._own_sent = max(0, received - self._own_sent), 0
        return outside

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._own_sent:
            return  # this process's own signal with nothing of the code under test listening: counted after the test
        pytest.exit(OUTSIDE_SIGTERM, returncode=128 + signal.SIGTERM)

    def close(self) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        signal.set_wakeup_fd(-1)
        os.close(self._read_fd)
        os.close(self._write_fd)


_GUARD = pytest.StashKey[OutsideStopGuard]()


def pytest_configure(config: pytest.Config) -> None:
    guard = OutsideStopGuard()
    guard.install()
    config.stash[_GUARD] = guard


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GUARD in config.stash:
        config.stash[_GUARD].close()


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.config.stash[_GUARD].rearm()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A test during which SIGTERM came from outside is reported as stopped, not as whatever it then asserted, and
    the session ends after it."""
    report: pytest.TestReport = yield
    if item.config.stash[_GUARD].outside_sigterms():
        report.outcome = "failed"
        report.longrepr = OUTSIDE_SIGTERM
        item.session.shouldstop = OUTSIDE_SIGTERM
    return report
