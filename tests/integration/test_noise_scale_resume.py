"""The smoothed noise scale is part of the run's state: stopped and resumed, a run logs the same noise_* values,
bit for bit, as one that never stopped (the weighted averages and the weight of the next measurement included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import corpus_bytes

pytestmark = pytest.mark.slow


def test_a_resumed_run_measures_the_same_noise_scale(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(corpus_bytes(30_000))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(out: Path, fault: str | None = None) -> subprocess.CompletedProcess:
        env.pop("BIGBATCH_FAULT", None)
        if fault:
            env["BIGBATCH_FAULT"] = fault
        argv = [
            "train",
            "--data",
            str(corpus),
            "--model",
            "pico",
            "--micro-batch",
            "2",
            "--seq-len",
            "32",
            "--total-batch-tokens",
            "256",
            "--max-steps",
            "6",
            "--eval-every",
            "0",
            "--sample-tokens",
            "0",
            "--noise-scale-every",
            "2",
            "--noise-scale-window",
            "3",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(out),
        ]
        return subprocess.run(
            [sys.executable, "-m", "bigbatch", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def noise(out: Path) -> dict[int, dict]:
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {
            r["step"]: {k: v for k, v in r.items() if k.startswith("noise_")}
            for r in records
            if r["kind"] == "step" and "noise_scale" in r
        }

    whole = train(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = train(tmp_path / "resumed", "sigterm:step=3")  # stops after step 3: step 4 is measured after resume
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    again = train(tmp_path / "resumed")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout
    assert sorted(noise(tmp_path / "whole")) == [1, 2, 4, 6]
    assert noise(tmp_path / "resumed") == noise(tmp_path / "whole")  # exact floats
