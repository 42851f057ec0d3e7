"""The gradient noise scale, measured from the accumulation itself.

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training" (2018), appendix A: with
``|G_small|^2`` the squared norm of a gradient averaged over ``B_small`` samples and ``|G_big|^2`` that over
``B_big`` samples of the same distribution, ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``, so

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

are unbiased. Each is smoothed over the recent measurements (not their ratio, which would be biased) and the
simple noise scale ``B_simple = tr(Sigma) / |G|^2`` is in the same unit as B: here, valid target tokens.

Smoothing. One measurement is noisy (with ``B_small`` near the noise scale its tr(Sigma) scatters by tens of
percent), so ``|G|^2`` and ``tr(Sigma)`` are averaged over a window of measurements. The ratio of two plain moving
averages is an average of the single estimates weighted by their ``|G|^2``, and ``|G|^2`` falls by one to two
orders of magnitude early in training (and jumps at a loss spike): the first measurements then outweigh all later
ones for many windows (on the nano demo a plain EMA at decay 0.9 reported 917 tokens at step 70, while the steps
around it measure 4,600 to 6,800). So measurement ``i`` is weighted by ``w_i = 1 / |G_B|^2`` of the optimizer step
just before it (measured or not; the first measurement, with none before it, uses its own). ``w_i`` is fixed
before measurement ``i`` is drawn, so ``E[w_i g_i] = w_i |G_i|^2``: the weighted sums stay unbiased, and every
measurement counts about equally (``w_i |G_i|^2 ~ 1 / (1 + B_simple / B_big)``). With ``W`` the window in
measurements (``--noise-scale-window``, default 5) and decay ``beta = 1 - 1/W`` per measurement:

    |G|^2     ~ sum_i beta^(n-i) w_i g_i     / sum_i beta^(n-i) w_i
    tr(Sigma) ~ sum_i beta^(n-i) w_i trace_i / sum_i beta^(n-i) w_i

(dividing by the weights' own average is Adam's bias correction when every ``w_i`` is 1). After a step change of
the true noise scale the estimate is within 10% of the new value in at most ``2W + 1`` measurements for a rise of
up to about 3x (training's case: the default window takes 10 for 81 -> 225 while ``|G|^2`` falls tenfold, where a
plain EMA at decay 0.9 takes 38), and ``3W + 1`` for a fall (tests/unit/test_noise_smoothing.py); in general about
``W ln(10 |1 - B_old / B_new|) + 1``. Measured every N steps, the window spans about ``W x N`` steps.

In the engine, ``B_small`` is one micro-batch (this rank's first of the step, its gradient read after the first
backward, before any cross-rank sync) and ``B_big`` the whole global step (the synced gradient before clipping,
unscaled). Under DDP each rank's small norm is averaged over ranks; then ``B_small`` is the harmonic mean of the
ranks' first micro-batch sizes, which keeps the estimate unbiased when their sizes differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def unbiased_estimates(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """``(|G|^2, tr(Sigma))`` from one pair of squared norms at two batch sizes (``b_small < b_big``)."""
    if not b_small < b_big:
        raise ValueError(f"the noise scale needs b_small < b_big, got {b_small} and {b_big}")
    g_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g_sq, trace


def unavailable_reason(k: int, world_size: int) -> str | None:
    """Why this run cannot measure the noise scale, or ``None`` when it can.

    It needs two batch sizes: one micro-batch and the global step. Only K = 1 in one process has a single one.
    With several processes the small gradient is each rank's own micro-batch gradient, read after the first
    backward while the sync is deferred (K >= 2) or, under DDP and FSDP2, just before its reduction when the first
    micro-batch syncs (K = 1 per rank, ``--sync-every-micro-step``): see :mod:`bigbatch.noise.probe`.
    """
    if k < 2 and world_size == 1:
        return "it needs two batch sizes, and with K = 1 in one process the micro-batch is the whole step"
    return None


def grad_sq_norm(parameters: Any) -> torch.Tensor:
    """The squared global 2-norm of the parameters' gradients, as a float64 tensor on their device (no sync)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0).double().pow(2)


@dataclass(frozen=True)
class NoiseSample:
    """One measured step: the raw squared norms and batch sizes, and the smoothed estimates after it."""

    small_sq: float  # |G_small|^2 of one micro-batch's mean-loss gradient (averaged over ranks)
    big_sq: float  # |G_big|^2 of the global step's gradient
    b_small: float  # tokens behind G_small (harmonic mean over ranks)
    b_big: int  # tokens behind G_big
    g_sq: float  # smoothed |G|^2
    trace: float  # smoothed tr(Sigma)

    @property
    def noise_scale(self) -> float:
        """``B_simple = tr(Sigma) / |G|^2`` in tokens; NaN while the smoothed ``|G|^2`` is not positive."""
        return self.trace / self.g_sq if self.g_sq > 0 else math.nan

    def as_dict(self) -> dict[str, float]:
        return {
            "noise_small_sq": self.small_sq,
            "noise_big_sq": self.big_sq,
            "noise_b_small": self.b_small,
            "noise_b_big": float(self.b_big),
            "noise_g_sq": self.g_sq,
            "noise_trace": self.trace,
            "noise_scale": self.noise_scale,
        }


DEFAULT_WINDOW = 5
"""Measurements in the smoothing window (``--noise-scale-window``): decay ``1 - 1 / window`` per measurement."""


def decay_for_window(window: float) -> float:
    """The EMA decay per measurement of a window of ``window`` measurements (``1 - 1 / window``; 1: no memory)."""
    if not window >= 1:
        raise ValueError(f"the window must be at least 1 measurement, got {window}")
    return 1.0 - 1.0 / window


class NoiseScale:
    """Weighted exponential moving averages of the unbiased ``|G|^2`` and ``tr(Sigma)`` (see the module notes),
    normalized by the moving average of the weights: the generalised Adam bias correction, so that the first
    measurements are not pulled toward zero. Measured at step 1 and every ``every`` steps."""

    def __init__(self, every: int, decay: float = decay_for_window(DEFAULT_WINDOW)) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.every = every
        self.decay = decay
        self.measurements = 0
        self._g_sq = 0.0  # EMA of weight x |G|^2 estimate
        self._trace = 0.0  # EMA of weight x tr(Sigma) estimate
        self._weight = 0.0  # EMA of the weights
        self.scale: float | None = None  # |G_big|^2 of the last applied step (observe), weighs the next measurement
        self.last: NoiseSample | None = None

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is measured."""
        return step == 1 or step % self.every == 0

    def observe(self, big_sq: float) -> None:
        """Record an applied step's squared gradient norm (every step, measured or not): its inverse weighs the
        next measurement. A non-finite or non-positive one is ignored."""
        if math.isfinite(big_sq) and big_sq > 0:
            self.scale = big_sq

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: int) -> NoiseSample | None:
        """Fold in one measurement; ``None`` (and no change) when a norm is not finite or the sizes coincide.

        Its weight is ``1 / scale``, the squared norm of the step observed before it (known before this
        measurement, so the weighted sums stay unbiased); the first measurement, with none before it, uses its own.
        """
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)) or not b_small < b_big:
            return None
        g_sq, trace = unbiased_estimates(small_sq, big_sq, b_small, b_big)
        scale = self.scale if self.scale is not None else big_sq
        weight = 1.0 / scale if math.isfinite(scale) and scale > 0 else 1.0
        self.measurements += 1
        self._g_sq = self.decay * self._g_sq + (1.0 - self.decay) * weight * g_sq
        self._trace = self.decay * self._trace + (1.0 - self.decay) * weight * trace
        self._weight = self.decay * self._weight + (1.0 - self.decay) * weight
        self.last = NoiseSample(small_sq, big_sq, b_small, b_big, self._g_sq / self._weight, self._trace / self._weight)
        return self.last

    @property
    def estimate(self) -> float | None:
        """The smoothed noise scale in tokens, or ``None`` before the first measurement."""
        return self.last.noise_scale if self.last is not None else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "measurements": self.measurements,
            "g_sq": self._g_sq,
            "trace": self._trace,
            "weight": self._weight,
            "scale": self.scale,
            "last": None if self.last is None else self.last.__dict__.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.measurements = int(state.get("measurements", 0))
        self._g_sq = float(state.get("g_sq", 0.0))
        self._trace = float(state.get("trace", 0.0))
        # a state saved before the weights: every weight was 1, so their EMA is Adam's bias correction
        self._weight = float(state.get("weight", 1.0 - self.decay**self.measurements))
        scale = state.get("scale")
        self.scale = float(scale) if scale is not None else None
        last = state.get("last")
        self.last = NoiseSample(**last) if last else None
