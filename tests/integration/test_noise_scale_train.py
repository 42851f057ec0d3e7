"""``bigbatch train`` measures the gradient noise scale: metrics.jsonl, the step line at eval time, the summary."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers import corpus_bytes, run_main

from bigbatch.noise.scale import NoiseScale

pytestmark = pytest.mark.usefixtures("isolated")


def noise_text(estimate: float) -> str:
    """What the step line says of a smoothed estimate: the number in tokens, or plainly that there is none yet."""
    return f"noise scale {estimate:,.0f} tok" if estimate > 0 else "no noise-scale estimate yet"


def critical_batch(estimate: float, measurements: int) -> str:
    """The start of the end-of-run line on the critical batch, for the run's last smoothed estimate."""
    if estimate > 0:
        return f"measured critical batch about {estimate:,.0f} tokens; "
    return (
        f"critical batch: no estimate yet (the smoothed noise scale is not positive after {measurements} measurements: "
    )


def train(tmp_path: Path, tokens_per_step: int, *extra: str) -> tuple[str, list[dict]]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(corpus_bytes(30_000))
    run_dir = tmp_path / "run"
    code, out, err = run_main(
        [
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
            str(tokens_per_step),
            "--eval-every",
            "2",
            "--eval-batches",
            "1",
            "--sample-tokens",
            "0",
            "--max-steps",
            "4",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(run_dir),
            *extra,
        ]
    )
    assert code == 0, out + err
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    return out, steps


def test_a_run_logs_and_summarises_the_noise_scale(tmp_path: Path) -> None:
    out, steps = train(tmp_path, 512, "--noise-scale-every", "2")  # K = 4
    measured = [r["step"] for r in steps if "noise_scale" in r]
    assert measured == [1, 2, 4]
    # What holds for every draw. (|G_small|^2 > |G_big|^2 holds only in expectation: one micro-batch of 128 tokens
    # can land nearer the mean gradient than the step of 512, and on a fresh clone it did, 6.73 < 7.21;
    # tests/unit/test_noise_scale.py checks the ordering over many draws.)
    replay = NoiseScale(every=2)  # the run's window is the default: the record must be this arithmetic, replayed
    for r in steps:
        if "noise_scale" in r:
            small, big = r["noise_small_sq"], r["noise_big_sq"]
            assert r["noise_b_small"] == 128 and r["noise_b_big"] == 512
            assert big == pytest.approx(r["grad_norm"] ** 2, rel=1e-5)
            assert 0 < small < math.inf and 0 < big < math.inf
            sample = replay.update(small, big, 128, 512)
            assert sample is not None
            assert (r["noise_g_sq"], r["noise_trace"]) == pytest.approx((sample.g_sq, sample.trace), rel=1e-12)
            if r["step"] == 1:  # the first measurement is one unsmoothed pair: the formula of noise/scale.py
                assert r["noise_g_sq"] == pytest.approx((512 * big - 128 * small) / (512 - 128), rel=1e-12)
                assert r["noise_trace"] == pytest.approx((small - big) / (1 / 128 - 1 / 512), rel=1e-12)
            if r["noise_g_sq"] > 0:
                assert r["noise_scale"] == pytest.approx(r["noise_trace"] / r["noise_g_sq"], rel=1e-12)
        replay.observe(r["grad_norm"] ** 2)  # every step's norm weighs the next measurement
    assert "noise" not in json.dumps([r for r in steps if r["step"] == 3])
    # the step line carries it at eval time only
    by_step = {r["step"]: r for r in steps}
    for n in (2, 4):  # the estimate after that step's measurement, as its record holds it
        assert re.search(rf"^step {n} \|.*\| {re.escape(noise_text(by_step[n]['noise_scale']))}$", out, re.M), out
    assert not re.search(r"^step [13] \|.*noise", out, re.MULTILINE), out
    assert "n/a" not in out
    start = critical_batch(by_step[4]["noise_scale"], 3)  # after the measurements of steps 1, 2 and 4
    assert re.search(rf"^{re.escape(start)}.*this run used 512 tokens per step$", out, re.MULTILINE), out


def test_k_1_in_one_process_says_so_once_and_stays_off(tmp_path: Path) -> None:
    out, steps = train(tmp_path, 128)  # K = 1, the default --noise-scale-every
    assert out.count("the gradient noise scale is not measured in this run") == 1
    assert "K = 1" in out
    assert not any("noise_scale" in r for r in steps)
    assert "| noise scale" not in out and "critical batch" not in out


def test_noise_scale_every_0_turns_it_off(tmp_path: Path) -> None:
    out, steps = train(tmp_path, 256, "--noise-scale-every", "0")
    assert not any("noise_scale" in r for r in steps)
    assert "| noise scale" not in out and "critical batch" not in out


def test_a_token_budget_run_in_one_process_measures_its_steps_of_two_micro_batches_or_more(tmp_path: Path) -> None:
    """The budget's plan has K = 1 as its unit, but its steps hold several micro-batches: those are measured."""
    out, steps = train(tmp_path, 512, "--token-budget", "512", "--noise-scale-every", "1")
    assert "the gradient noise scale is not measured" not in out
    measured = [r for r in steps if "noise_scale" in r]
    assert measured and all(r["micro_batches"] >= 2 for r in measured)
    assert all(r["noise_b_big"] == r["tokens"] for r in measured)


def test_a_ramped_run_compares_the_noise_scale_with_the_size_it_ended_at(tmp_path: Path) -> None:
    out, steps = train(tmp_path, 512, "--batch-ramp", "256:1024", "--noise-scale-every", "1")
    sizes = [r["tokens"] for r in steps]
    assert sizes[0] == 256 and sizes[-1] > sizes[0]  # the ramp grew the steps
    measured = [r for r in steps if "noise_scale" in r]
    start = critical_batch(measured[-1]["noise_scale"], len(measured))
    assert re.search(rf"^{re.escape(start)}.*this run ended at {sizes[-1]:,} tokens per step$", out, re.M), out
