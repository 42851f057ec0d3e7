"""Step records: the console line and a JSONL file."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from bigbatch.accumulate import StepRecord


def format_step(record: StepRecord, show_k: bool = False) -> str:
    """``step 12 | loss 2.413 | norm 0.84 | lr 6.0e-04 | dt 812 ms | tok/s 20,171``

    ``tok/s`` counts valid target tokens. With ``show_k`` (K varies from step to
    step) the line also gives K and the step's valid tokens.
    """
    line = (
        f"step {record.step} | loss {record.loss:.4f} | norm {record.grad_norm:.2f} | lr {record.lr:.1e} | "
        f"dt {record.dt * 1000:.0f} ms | tok/s {record.tokens_per_s:,.0f}"
    )
    if show_k:
        line += f" | K {record.micro_batches} | tokens {record.tokens:,}"
    if record.skipped:
        line += " | SKIPPED (non-finite gradient)"
    return line


class JsonlLog:
    """Appends one JSON object per line; flushed after each so a crash loses at most the current record."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, kind: str, **values: Any) -> None:
        self._handle.write(json.dumps({"kind": kind, **values}) + "\n")
        self._handle.flush()

    def write_step(self, record: StepRecord) -> None:
        self.write("step", **asdict(record), tokens_per_s=record.tokens_per_s)

    def close(self) -> None:
        self._handle.close()
