"""The README's Python example runs and trains (loss falls on a learnable stream)."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_in_your_loop.py"


def test_engine_example_runs_its_steps() -> None:
    namespace = runpy.run_path(str(EXAMPLE))
    losses = namespace["main"](steps=3, k=2, micro_batch=2, seq_len=16)
    assert len(losses) == 3
    assert all(4.5 < loss < 6.5 for loss in losses)  # random tokens: about ln(256) = 5.55
