"""Step records: the console line and a JSONL file."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from bigbatch.accumulate import StepRecord

PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}
"""Dense bf16 peak FLOP/s per device (tensor cores, no sparsity), matched against the CUDA device name."""


def device_peak_flops(device_name: str) -> float | None:
    """The table's peak for a device name such as ``NVIDIA H200``; ``None`` when unknown (CPUs included)."""
    for key, flops in PEAK_FLOPS.items():
        if key in device_name.upper():
            return flops
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_device: float, world_size: int = 1) -> float:
    """Model FLOPs utilization: achieved training FLOP/s over the peak of all devices."""
    return flops_per_token * tokens_per_s / (peak_flops_per_device * world_size)


def format_step(record: StepRecord, show_k: bool = False, mfu_value: float | None = None) -> str:
    """``step 12 | loss 2.413 | norm 0.84 | lr 6.0e-04 | dt 812 ms | tok/s 20,171``

    ``tok/s`` counts valid target tokens. With ``show_k`` (K varies from step to
    step) the line also gives K and the step's valid tokens.
    """
    line = (
        f"step {record.step} | loss {record.loss:.4f} | norm {record.grad_norm:.2f} | lr {record.lr:.1e} | "
        f"dt {record.dt * 1000:.0f} ms | tok/s {record.tokens_per_s:,.0f}"
    )
    if mfu_value is not None:
        line += f" | mfu {mfu_value:.1%}"
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
