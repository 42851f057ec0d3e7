"""The noise-scale estimate at world size 2 (gloo, DDP): each rank's unsynced micro-batch norm, averaged over ranks."""

from __future__ import annotations

import json
from pathlib import Path

import noise_problem as problem
import pytest
from launch import SUPPORT, torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("k", [2, 4])
def test_two_ranks_measure_the_closed_form_noise_scale(tmp_path: Path, k: int) -> None:
    out = tmp_path / "noise.json"
    torchrun(str(SUPPORT / "noise_problem.py"), str(k), "1000", str(out))
    measured = json.loads(out.read_text())
    assert measured["b_small"] == problem.MICRO and measured["b_big"] == 2 * k * problem.MICRO
    want = problem.truth()
    assert measured["g_sq"] == pytest.approx(want["g_sq"], rel=0.1)
    assert measured["trace"] == pytest.approx(want["trace"], rel=0.1)
    assert measured["noise_scale"] == pytest.approx(want["noise_scale"], rel=0.1)
