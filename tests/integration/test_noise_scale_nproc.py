"""``bigbatch train --nproc 2`` measures the noise scale with K = 1 per rank under DDP and FSDP2 (the build wires
the probe that reads each rank's micro-batch gradient before its reduction)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import corpus_bytes

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_k_1_per_rank_measures_it(tmp_path: Path, parallel: str) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(corpus_bytes(30_000))
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "bigbatch",
        "train",
        "--data",
        str(corpus),
        "--model",
        "pico",
        "--seq-len",
        "32",
        "--micro-batch",
        "4",
        "--total-batch-tokens",
        "256",
        "--max-steps",
        "3",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--noise-scale-every",
        "1",
        "--nproc",
        "2",
        "--parallel",
        parallel,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(run_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "x K 1 x world 2" in done.stdout, done.stdout
    assert "not measured" not in done.stdout + done.stderr
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert [r["step"] for r in steps if "noise_scale" in r] == [1, 2, 3]
    for r in steps:
        assert r["noise_b_small"] == 128 and r["noise_b_big"] == 256  # one rank's micro-batch, the global step
        assert r["noise_big_sq"] == pytest.approx(r["grad_norm"] ** 2, rel=1e-5)
        # Holds on every draw, not only in expectation: with K = 1 and equal micro-batches G_big = (g_0 + g_1) / 2,
        # and |G_small|^2, the ranks' mean of |g_r|^2, exceeds |G_big|^2 by |g_0 - g_1|^2 / 4 (parallelogram law).
        assert r["noise_small_sq"] > r["noise_big_sq"] > 0
    estimate = steps[-1]["noise_scale"]  # the run's last smoothed estimate, as the end-of-run line words it
    if estimate > 0:
        assert f"measured critical batch about {estimate:,.0f} tokens; this run used 256 tokens per step" in done.stdout
    else:
        assert "critical batch: no estimate yet (the smoothed noise scale is not positive after 3 measurements" in (
            done.stdout
        )
