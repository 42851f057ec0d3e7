"""The suite's guard against a SIGTERM from outside (support/outside_stop.py), in pytest runs of its own: the run
ends with the guard's one line, not with an unrelated failed assertion, and a test's own SIGTERM is no alarm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import support_pythonpath
from outside_stop import OUTSIDE_SIGTERM

pytestmark = pytest.mark.slow  # three pytest runs of their own

CHILD_TESTS = """
import os
import signal
import subprocess
import time

from bigbatch.parallel.signals import StopRequest


def from_outside():
    # a time limit's SIGTERM: sent by another process
    subprocess.run(["kill", "-TERM", str(os.getpid())], check=True)
    time.sleep(0.5)  # the handler runs in the main thread at its next bytecode


def test_a_listener_absorbs_it():
    with StopRequest() as stop:  # what a trainer inside pytest installs: a polite stop
        from_outside()
    assert stop.signum == 0, "an unrelated assertion the stop makes fail"


def test_nothing_listens():
    from_outside()
    assert False, "an unrelated assertion after the signal"


def test_its_own_signal():
    with StopRequest() as stop:  # as a test, or bigbatch's fault injection, stops the code under test
        os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == signal.SIGTERM


def test_its_own_signal_with_nothing_listening():
    signal.raise_signal(signal.SIGTERM)  # only the guard's handler: no alarm either


def test_after():
    pass
"""


def run_child(tmp_path: Path, *selection: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_child.py").write_text(CHILD_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": support_pythonpath()}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "outside_stop", "-p", "no:cacheprovider", "test_child.py"]
    return subprocess.run([*command, *selection], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("first", ["test_a_listener_absorbs_it", "test_nothing_listens"])
def test_an_outside_sigterm_ends_the_run_with_the_guards_line(tmp_path: Path, first: str) -> None:
    done = run_child(tmp_path, "-k", f"{first} or test_after")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert OUTSIDE_SIGTERM in out, out
    assert "unrelated assertion" not in out, out  # the stop, not what the test then asserted
    assert "1 passed" not in out  # test_after never ran: the session stopped


def test_a_tests_own_sigterm_is_no_alarm(tmp_path: Path) -> None:
    done = run_child(tmp_path, "-k", "test_its_own_signal or test_after")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout and OUTSIDE_SIGTERM not in done.stdout
