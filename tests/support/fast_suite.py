"""Keeping ``make test-fast`` an inner loop: at the end of a run that leaves the slow tests out, the tests that took
longer than :data:`FAST_LIMIT_SECONDS` (setup and call together) are listed as candidates for
``@pytest.mark.slow``.

A list, not a failure: a busy machine makes any test slow, and a timed assertion would fail for the machine's sake.
:func:`register` is called by ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest

FAST_LIMIT_SECONDS = 1.0
"""A test that takes longer than this on a quiet 2-core machine belongs to the full suite (``make test``)."""


class FastSuiteWatch:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when in ("setup", "call"):
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        over = sorted(((s, node) for node, s in self.seconds.items() if s > FAST_LIMIT_SECONDS), reverse=True)
        if not over:
            return
        terminalreporter.write_sep("-", f"{len(over)} tests in the fast suite took over {FAST_LIMIT_SECONDS:g} s")
        terminalreporter.write_line("(on a quiet machine, mark them @pytest.mark.slow; on a busy one, ignore this)")
        for seconds, node in over:
            terminalreporter.write_line(f"{seconds:6.2f}s {node}")


def register(config: pytest.Config) -> None:
    """Watch durations when the run leaves the slow tests out (``-m "not slow"``, as ``make test-fast`` does)."""
    if "not slow" in (config.getoption("markexpr", "") or ""):
        config.pluginmanager.register(FastSuiteWatch(), "bigbatch-fast-suite-watch")
