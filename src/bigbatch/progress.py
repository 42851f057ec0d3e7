"""A one-line progress bar with ETA, redrawn with ``\\r`` on a terminal; silent anywhere else.

No dependency: the line is ``step 40/120 [#######.........]  33% | tok/s 17,246 | ETA 1:20``.
It is drawn only when its stream is a TTY (and the caller says so, e.g. rank 0
only), so logs written to files or pipes stay exactly as they were. Anything
else printed to the terminal while the bar is shown should call :meth:`clear`
first; the next :meth:`update` draws the bar again below it. :func:`plural` words the counts such lines print.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 20


def plural(count: int, noun: str, nouns: str = "") -> str:
    """``1 document``, ``0 documents``, ``2,048 documents``: the count (thousands separated) and the noun agreeing
    with it; ``nouns`` for a plural that is not ``noun + "s"``. For every count printed that can be 1."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def format_duration(seconds: float) -> str:
    """``1:05:09``, ``4:07`` or ``0:03``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressBar:
    """Progress of ``total`` units (steps, measurements) on one redrawn line.

    ``enabled=None`` draws when ``stream.isatty()``; ``False`` never draws. The
    ETA comes from the time per unit since the first :meth:`update` (units done
    before it, such as the steps of a resumed run, do not count toward the rate).
    Frames are drawn at most every ``min_interval`` seconds, except the first and
    the last.
    """

    def __init__(
        self,
        total: int,
        label: str = "step",
        stream: TextIO | None = None,
        enabled: bool | None = None,
        min_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        format_count: Callable[[int], str] = str,
    ) -> None:
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.min_interval = min_interval
        self.clock = clock
        self.format_count = format_count  # how ``done`` and ``total`` read, e.g. bytes as MB
        self._start: tuple[float, int] | None = None  # (time, units done) at the first update
        self._last_draw = float("-inf")
        self._width = 0  # characters of the line now on screen; 0 when none
        self._frame = ""

    def render(self, done: int, tokens_per_s: float | None = None, extra: str = "") -> str:
        """The text of one frame (without ``\\r``)."""
        total = self.total
        fraction = min(done / total, 1.0) if total else 1.0
        filled = int(BAR_WIDTH * fraction)
        count = f"{self.format_count(done)}/{self.format_count(total)}"
        parts = [f"{self.label} {count} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:4.0%}"]
        if extra:
            parts.append(extra)
        if tokens_per_s is not None:
            parts.append(f"tok/s {tokens_per_s:,.0f}")
        parts.append(f"ETA {self._eta(done)}")
        return " | ".join(parts)

    def _eta(self, done: int) -> str:
        if done >= self.total:
            return format_duration(0)
        if self._start is None:
            return "--:--"
        started_at, started_done = self._start
        units = done - started_done
        if units <= 0:
            return "--:--"
        per_unit = (self.clock() - started_at) / units
        return format_duration(per_unit * (self.total - done))

    def update(self, done: int, tokens_per_s: float | None = None, extra: str = "") -> None:
        """Show ``done`` of ``total``; a no-op when disabled."""
        if not self.enabled:
            return
        now = self.clock()
        if self._start is None:
            self._start = (now, done)
        elif now - self._last_draw < self.min_interval and done < self.total and self._width:
            return
        self._last_draw = now
        self._frame = self.render(done, tokens_per_s, extra)
        self._draw(self._frame)

    def _draw(self, text: str) -> None:
        pad = " " * max(self._width - len(text), 0)  # overwrite the rest of a longer previous frame
        self.stream.write("\r" + text + pad)
        self.stream.flush()
        self._width = len(text)

    def clear(self) -> None:
        """Erase the bar from the line (before other output); the next :meth:`update` draws it again."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def close(self) -> None:
        """Erase the bar for good."""
        self.clear()
        self.enabled = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
