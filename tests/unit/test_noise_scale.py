"""The gradient noise scale: the estimator against a closed form, through the real engine; it never changes training."""

from __future__ import annotations

import copy
import math

import noise_problem as problem
import pytest
import torch
from tiny import random_batch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import GPT
from bigbatch.noise.meter import noise_meter_hooks
from bigbatch.noise.scale import NoiseScale, unavailable_reason, unbiased_estimates
from bigbatch.observe.metrics import format_step
from bigbatch.run.loop.summary import critical_batch_line


@pytest.mark.slow
def test_the_closed_form_matches_many_samples() -> None:
    """tr(Sigma) = (d + 1)|delta|^2 + d sigma^2 and |G|^2 = |delta|^2, checked on 400,000 per-sample gradients."""
    samples = problem.draw(400_000, torch.Generator().manual_seed(0))
    w = problem.make_model().weight.detach()[0]
    per_sample = samples.x * (samples.x @ w - samples.y).unsqueeze(1)
    g = per_sample.mean(0)
    g_sq = float(g.pow(2).sum())
    trace = float(per_sample.pow(2).sum(1).mean()) - g_sq
    want = problem.truth()
    assert g_sq == pytest.approx(want["g_sq"], rel=0.02)
    assert trace == pytest.approx(want["trace"], rel=0.02)


def test_unbiased_estimates_invert_the_expected_norms() -> None:
    """E|G_B|^2 = |G|^2 + tr(Sigma)/B at two sizes gives back |G|^2 and tr(Sigma) exactly."""
    g_sq, trace = 2.5, 300.0
    small, big = g_sq + trace / 64, g_sq + trace / 512
    assert unbiased_estimates(small, big, 64, 512) == pytest.approx((g_sq, trace))
    with pytest.raises(ValueError):
        unbiased_estimates(small, big, 64, 64)


def test_one_micro_batch_is_noisier_than_the_whole_step_in_expectation() -> None:
    """E|G_B|^2 = |G|^2 + tr(Sigma) / B: the engine's |G_small|^2 (B = 64) exceeds its |G_big|^2 (B = 256) on
    average. One draw need not (here about 3% of steps; a training run measured 6.73 < 7.21), so the means of 200
    steps are compared with the closed form (2.27 and 1.32), each within 5 standard errors of its own draws."""
    k, steps = 4, 200
    model = problem.make_model()
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        lambda step: 0.0,
        grad_clip=0.0,
        loss_fn=problem.loss_sum,
        count_fn=problem.count,
        hooks=noise_meter_hooks(NoiseScale(every=1), model),
    )
    generator = torch.Generator().manual_seed(5)
    samples = []
    for _ in range(steps):
        noise = engine.step([problem.draw(problem.MICRO, generator) for _ in range(k)]).noise
        assert noise is not None
        samples.append((noise.small_sq, noise.big_sq))
    want = problem.truth()
    small, big = torch.tensor(samples, dtype=torch.float64).unbind(1)
    for values, b in ((small, problem.MICRO), (big, k * problem.MICRO)):
        standard_error = float(values.std()) / steps**0.5
        assert float(values.mean()) == pytest.approx(want["g_sq"] + want["trace"] / b, abs=5 * standard_error)
    assert float(small.mean()) > float(big.mean())


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_the_engine_measures_the_closed_form_noise_scale(k: int) -> None:
    """At learning rate 0 (the truth stays put), the smoothed estimate is within 10% of tr(Sigma)/|G|^2."""
    # One fixed sample of a noisy estimate: seeded float64 draws from torch's CPU generator (torch is pinned) and
    # float64 arithmetic make it the same on every machine to rounding, far inside the margin. Over other seeds
    # the error is about 3% (at most 7.5% in 24 runs); these seeds give 8.1% (K = 2), 2.1% and 0.1%.
    noise = problem.run_engine(k, steps=1000, seed=10 + k)
    assert noise.last is not None
    assert noise.last.b_small == problem.MICRO and noise.last.b_big == k * problem.MICRO
    want = problem.truth()
    assert noise.last.g_sq == pytest.approx(want["g_sq"], rel=0.1)
    assert noise.last.trace == pytest.approx(want["trace"], rel=0.1)
    assert noise.last.noise_scale == pytest.approx(want["noise_scale"], rel=0.1)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_small_gradient_is_the_first_micro_batch_mean_gradient_in_true_units(precision: str) -> None:
    """|G_small|^2 is that of the first micro-batch's own mean loss, whatever N and the other micro-batches are,
    and whatever the fp16 loss scale (65,536 here: the gradients in .grad carry it until unscaled)."""
    model = problem.make_model()
    generator = torch.Generator().manual_seed(3)
    batches = [problem.draw(n, generator) for n in (5, 11, 7)]  # uneven sizes: N = 23
    reference = copy.deepcopy(model)
    (problem.loss_sum(reference, batches[0]) / 5).backward()
    want_small = float(reference.weight.grad.pow(2).sum())
    noise = NoiseScale(every=1)
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        lambda step: 0.0,
        grad_clip=0.0,
        loss_fn=problem.loss_sum,
        count_fn=problem.count,
        hooks=noise_meter_hooks(noise, model),
        precision=precision,
    )
    assert engine.scaler.is_enabled() == (precision == "fp16")
    record = engine.step(batches)
    assert record.noise is not None
    assert record.noise.small_sq == pytest.approx(want_small, rel=1e-9)
    assert record.noise.big_sq == pytest.approx(record.grad_norm**2, rel=1e-9)
    assert (record.noise.b_small, record.noise.b_big) == (5, 23)


def test_measuring_never_changes_the_trajectory(tiny_model: GPT) -> None:
    """Parameters are bitwise identical after AdamW steps with the measurement on (every step) and off."""
    runs = []
    for noise in (None, NoiseScale(every=1)):
        model = copy.deepcopy(tiny_model)
        engine = AccumulationEngine(
            model,
            build_adamw(model, 1e-3),
            constant_schedule(1e-3),
            grad_clip=1.0,
            hooks=noise_meter_hooks(noise, model),
        )
        for step in range(4):
            x, y = random_batch(6, 16, seed=step)
            record = engine.step([MicroBatch(a, b) for a, b in zip(x.chunk(3), y.chunk(3), strict=True)])
            assert (record.noise is not None) == (noise is not None)
        runs.append(model.state_dict())
    for name, tensor in runs[0].items():
        assert torch.equal(tensor, runs[1][name]), name


def test_it_is_measured_at_step_1_and_every_n() -> None:
    noise = NoiseScale(every=10)
    assert [s for s in range(1, 31) if noise.due(s)] == [1, 10, 20, 30]


def test_the_ema_smooths_each_estimate_not_their_ratio() -> None:
    noise = NoiseScale(every=1, decay=0.5)
    first = noise.update(small_sq=3.0, big_sq=1.5, b_small=10, b_big=20)  # |G|^2 0, tr 30
    assert first is not None and first.g_sq == pytest.approx(0.0) and math.isnan(first.noise_scale)
    noise.observe(6.0)  # the step before the next measurement: its weight is 1/6 (the first one's, its own 1/1.5)
    second = noise.update(small_sq=5.0, big_sq=3.0, b_small=10, b_big=20)  # |G|^2 1, tr 40
    assert second is not None
    # weighted EMAs, normalized by the EMA of the weights (Adam's bias correction when every weight is 1)
    w1, w2 = 1 / 1.5, 1 / 6.0
    weights = 0.25 * w1 + 0.5 * w2
    assert second.g_sq == pytest.approx((0.25 * w1 * 0 + 0.5 * w2 * 1) / weights)
    assert second.trace == pytest.approx((0.25 * w1 * 30 + 0.5 * w2 * 40) / weights)
    assert noise.estimate == pytest.approx(second.trace / second.g_sq)
    assert noise.update(float("inf"), 1.0, 10, 20) is None and noise.last is second  # a bad step is left out
    restored = NoiseScale(every=1, decay=0.5)
    restored.load_state_dict(noise.state_dict())
    assert restored.last == second and restored.update(5.0, 3.0, 10, 20) == noise.update(5.0, 3.0, 10, 20)


def test_k_1_needs_a_second_batch_size() -> None:
    assert "K = 1" in (unavailable_reason(1, 1) or "")
    assert unavailable_reason(2, 1) is None
    # several ranks: each one's micro-batch is a batch size of its own, read before the reduction (noise/probe.py),
    # under DDP or FSDP2 and with or without --sync-every-micro-step
    for k in (1, 2, 4):
        assert unavailable_reason(k, 2) is None
    # and an engine given no meter, or a one-micro-batch step, reports nothing
    model = problem.make_model()
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        lambda step: 0.0,
        grad_clip=0.0,
        loss_fn=problem.loss_sum,
        count_fn=problem.count,
        hooks=noise_meter_hooks(NoiseScale(every=1), model),
    )
    assert engine.step([problem.draw(8, torch.Generator().manual_seed(0))]).noise is None


def test_the_step_line_shows_the_noise_scale() -> None:
    noise = problem.run_engine(2, steps=3, seed=0)
    assert noise.last is not None
    model = problem.make_model()
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        lambda step: 0.0,
        grad_clip=0.0,
        loss_fn=problem.loss_sum,
        count_fn=problem.count,
    )
    record = engine.step([problem.draw(8, torch.Generator().manual_seed(0))] * 2)
    assert format_step(record, noise_scale=12345.4).endswith("| noise scale 12,345 tok")
    # no estimate yet (a non-positive or NaN smoothed value): said plainly, with no number and no unit
    for unusable in (-3.0, 0.0, math.nan):
        line = format_step(record, noise_scale=unusable)
        assert line.endswith(" | tok/s " + f"{record.tokens_per_s:,.0f}" + " | no noise-scale estimate yet"), line
        assert "n/a" not in line and " tok |" not in line
    assert "noise" not in format_step(record)


def test_the_end_of_run_line_on_the_critical_batch() -> None:
    assert critical_batch_line(9061.3, 13, "used", 16384) == (
        "measured critical batch about 9,061 tokens; this run used 16,384 tokens per step"
    )
    for unusable, count in ((-40.0, 1), (math.nan, 3)):  # no estimate yet: said plainly, no "n/a", no unit
        assert critical_batch_line(unusable, count, "ended at", 512) == (
            "critical batch: no estimate yet (the smoothed noise scale is not positive after "
            f"{count} measurement{'s' if count > 1 else ''}: the gradient noise still drowns the signal; train "
            "longer); this run ended at 512 tokens per step"
        )


def test_a_first_micro_batch_without_valid_targets_skips_the_measurement(tiny_model: GPT) -> None:
    """Its mean-loss gradient does not exist (0 / 0): the step trains as always and measures nothing, and the next
    step with a valid first micro-batch measures again (under DDP every rank skips together, see test_fuzz)."""
    model = copy.deepcopy(tiny_model)
    engine = AccumulationEngine(
        model,
        build_adamw(model, 1e-3),
        constant_schedule(1e-3),
        grad_clip=1.0,
        hooks=noise_meter_hooks(NoiseScale(every=1), model),
    )
    x, y = random_batch(6, 16, seed=0)
    masked = torch.full_like(y[:2], -100)
    record = engine.step([MicroBatch(x[:2], masked), MicroBatch(x[2:4], y[2:4]), MicroBatch(x[4:], y[4:])])
    assert record.noise is None and math.isfinite(record.loss) and not record.skipped
    # the other way round: every valid target in the first micro-batch, so both batch sizes are the same
    record = engine.step([MicroBatch(x[:2], y[:2]), MicroBatch(x[2:4], masked), MicroBatch(x[4:], masked)])
    assert record.noise is None and math.isfinite(record.loss) and not record.skipped
    record = engine.step([MicroBatch(a, b) for a, b in zip(x.chunk(3), y.chunk(3), strict=True)])
    assert record.noise is not None
