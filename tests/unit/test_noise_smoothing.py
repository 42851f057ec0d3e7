"""How the noise scale is smoothed: after a step change of the true noise scale the estimate is within 10% of the
new value in at most 2W + 1 measurements (W the window), however much |G|^2 changes with it. The closed-form
least-squares problem (tests/support/noise_problem.py) gives the truth on both sides of the change."""

from __future__ import annotations

import noise_problem as problem
import pytest
import torch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.noise.meter import noise_meter_hooks
from bigbatch.noise.scale import DEFAULT_WINDOW, NoiseScale, decay_for_window

B_SMALL, K = 64, 4  # samples per micro-batch and micro-batches per step, as in the closed-form engine tests
BEFORE, AFTER = 30, 30  # measurements before and after the change
REPLICAS = 8

RISE = (problem.truth(delta_sq=1.0), problem.truth(delta_sq=0.1))  # training's case: |G|^2 / 10, B 81 -> 225
TRACE_ONLY = (problem.truth(), problem.truth(sigma=1.0))  # the label noise doubles: B 81 -> 129, |G|^2 the same
FALL = (problem.truth(delta_sq=0.1), problem.truth(delta_sq=1.0))  # B 225 -> 81 as |G|^2 grows tenfold


def expected_stream(noise: NoiseScale, change: tuple[dict[str, float], ...]) -> list[float]:
    """The estimate after each measurement when every measured norm is its expectation,
    ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``: the smoothing alone, without sampling noise. Every step is measured."""
    estimates = []
    for i in range(BEFORE + AFTER):
        truth = change[int(i >= BEFORE)]
        small, big = (truth["g_sq"] + truth["trace"] / b for b in (B_SMALL, K * B_SMALL))
        sample = noise.update(small, big, B_SMALL, K * B_SMALL)
        assert sample is not None
        estimates.append(sample.noise_scale)
        noise.observe(big)  # what the engine does after every applied step
    return estimates


def measurements_to_track(estimates: list[float], want: float, rel: float = 0.1) -> int:
    """Measurements after the change until the estimate is within ``rel`` of ``want`` and stays there."""
    after = estimates[BEFORE:]
    inside = [abs(e - want) <= rel * want for e in after]
    assert inside[-1], f"never settles at {want}: {after}"
    return max((i for i, ok in enumerate(inside) if not ok), default=-1) + 2


def test_a_window_is_a_decay_per_measurement() -> None:
    assert decay_for_window(5) == pytest.approx(0.8)
    assert decay_for_window(1) == 0.0  # the last measurement alone
    assert NoiseScale(every=10).decay == pytest.approx(decay_for_window(DEFAULT_WINDOW))
    with pytest.raises(ValueError):
        decay_for_window(0.5)


@pytest.mark.parametrize("window", [2, 5, 10])
@pytest.mark.parametrize(("change", "windows"), [(RISE, 2), (TRACE_ONLY, 2), (FALL, 3)], ids=["rise", "trace", "fall"])
def test_a_step_change_is_tracked_within_a_few_windows(window: int, change: tuple, windows: int) -> None:
    """Exact arithmetic on expected norms: a rise (up to about 3x) is tracked to 10% within 2W + 1 measurements, a
    fall within 3W + 1. The default window (5) follows training's case, a rise from 81 to 225 as |G|^2 falls
    tenfold, in 10 measurements; an unweighted EMA is held back by the larger |G|^2 before the change (the first
    version, decay 0.9: 38 measurements; at decay 0.8: 18)."""
    estimates = expected_stream(NoiseScale(every=1, decay=decay_for_window(window)), change)
    assert estimates[BEFORE - 1] == pytest.approx(change[0]["noise_scale"], rel=1e-6)  # settled before
    assert measurements_to_track(estimates, change[1]["noise_scale"]) <= windows * window + 1


def engine_for(model: torch.nn.Module, noise: NoiseScale) -> AccumulationEngine:
    return AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        lambda step: 0.0,
        grad_clip=0.0,
        loss_fn=problem.loss_sum,
        count_fn=problem.count,
        hooks=noise_meter_hooks(noise, model),
    )


@pytest.mark.slow
def test_through_the_engine_the_smoothed_estimates_track_the_rise() -> None:
    """The rise (|G|^2 / 10; here d = 256, so B 321 -> 897) measured from sampled gradients by the real engine with
    the default window, in REPLICAS independent runs: the smoothed tr(Sigma) and |G|^2, averaged over the runs
    (each is an unbiased average; one run's ratio scatters by about 15%, their mean by about 5%) give the truth
    within 10% before the change, and on average from 3W measurements after it on (each within 15%; the exact
    count without sampling noise is the test above)."""
    dim, before = 256, 3 * DEFAULT_WINDOW
    old, new = (problem.truth(dim=dim, delta_sq=d)["noise_scale"] for d in (1.0, 0.1))
    g_sq: list[list[float]] = []
    trace: list[list[float]] = []
    for seed in range(REPLICAS):
        model = problem.make_model(dim=dim, delta_sq=1.0)
        engine = engine_for(model, NoiseScale(every=1))
        generator = torch.Generator().manual_seed(100 + seed)  # float64 draws: the same on every machine
        samples = []
        for i in range(before + 3 * DEFAULT_WINDOW + 3):
            if i == before:
                problem.set_delta(model, 0.1, dim=dim)  # between two optimizer steps
            record = engine.step([problem.draw(dim, generator, dim=dim) for _ in range(K)])
            assert record.noise is not None
            samples.append(record.noise)
        g_sq.append([s.g_sq for s in samples])
        trace.append([s.trace for s in samples])
    ratio = [sum(t) / sum(g) for t, g in zip(zip(*trace, strict=True), zip(*g_sq, strict=True), strict=True)]
    assert ratio[before - 1] == pytest.approx(old, rel=0.1)
    settled = ratio[before + 3 * DEFAULT_WINDOW - 1 :]
    assert sum(settled) / len(settled) == pytest.approx(new, rel=0.1), [round(r) for r in ratio]
    assert all(abs(r - new) <= 0.15 * new for r in settled), [round(r) for r in ratio]


def test_every_applied_step_sets_the_weight_of_the_next_measurement() -> None:
    """Measured at steps 1 and 3: the weight of step 3's measurement is 1 / |G_big|^2 of step 2 (not measured)."""
    model = problem.make_model()
    noise = NoiseScale(every=3)
    engine = engine_for(model, noise)
    generator = torch.Generator().manual_seed(1)
    records = [engine.step([problem.draw(64, generator) for _ in range(2)]) for _ in range(3)]
    assert [r.noise is not None for r in records] == [True, False, True]
    assert noise.scale == pytest.approx(records[2].grad_norm ** 2)  # observed after step 3: weighs the next one
    restored = NoiseScale(every=3)
    restored.load_state_dict(noise.state_dict())
    assert restored.state_dict() == noise.state_dict()


def test_a_state_saved_before_the_weights_loads_as_plain_bias_correction() -> None:
    old = {"measurements": 2, "g_sq": 0.4, "trace": 12.0, "last": None}  # a checkpoint of the first version
    noise = NoiseScale(every=1, decay=0.5)
    noise.load_state_dict(old)
    sample = noise.update(5.0, 3.0, 10, 20)  # |G|^2 1, tr 40; weight 1/3 (its own: no step observed since)
    assert sample is not None
    weights = 0.5 * (1 - 0.25) + 0.5 / 3
    assert sample.g_sq == pytest.approx((0.5 * 0.4 + 0.5 / 3 * 1) / weights)
    assert sample.trace == pytest.approx((0.5 * 12.0 + 0.5 / 3 * 40) / weights)
