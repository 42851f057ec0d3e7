"""Progress of a pass over the corpus (tokenizing, or reading it to train a tokenizer)."""

from __future__ import annotations

import logging
import time

from bigbatch.progress import ProgressBar, plural

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 5.0


class CorpusProgress:
    """Logs ``documents, MB of text, MB/s`` every few seconds; or, given ``total_bytes`` and with stderr a
    terminal, draws a progress bar (MB done of the total, MB/s, ETA) instead.

    ``total_bytes`` is the size of the files, so JSON Lines overhead and skipped binary files leave the bar
    short of 100% at the end; it is erased then either way.
    """

    def __init__(self, what: str, started: float, total_bytes: int | None = None) -> None:
        self.what = what
        self.started = started
        self.next_report = started + PROGRESS_SECONDS
        self.bar: ProgressBar | None = None
        if total_bytes:
            bar = ProgressBar(total_bytes, label=f"{what} MB", format_count=lambda n: f"{n / 1e6:.1f}")
            self.bar = bar if bar.enabled else None

    def update(self, documents: int, n_bytes: int) -> None:
        now = time.perf_counter()
        if self.bar is not None:
            rate = n_bytes / 1e6 / max(now - self.started, 1e-9)
            self.bar.update(min(n_bytes, self.bar.total), extra=f"{plural(documents, 'document')} | {rate:.1f} MB/s")
            return
        if now < self.next_report:
            return
        self.next_report = now + PROGRESS_SECONDS
        log.info(
            "%s %s, %.1f MB of text, %.1f MB/s",
            self.what,
            plural(documents, "document"),
            n_bytes / 1e6,
            n_bytes / 1e6 / max(now - self.started, 1e-9),
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> CorpusProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
