"""The gradient noise scale as a step hook: reads the first micro-batch's own gradient on the steps that measure,
and the step's pre-clip norm, and folds the two into :class:`~bigbatch.noise.scale.NoiseScale`.

It only reads gradients: a run's trajectory is the same with the meter or without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from bigbatch.engine.hooks import StepHook, StepOutcome
from bigbatch.noise.probe import GradReadProbe, SmallGradProbe
from bigbatch.noise.scale import NoiseSample, NoiseScale

if TYPE_CHECKING:
    from bigbatch.engine.accumulate import AccumulationEngine


class NoiseMeter(StepHook):
    """Measures the noise scale every ``scale.every`` steps; its samples go into the step records as ``noise``.

    ``probe`` says where the first micro-batch's own gradient can be read (see :mod:`bigbatch.noise.probe`);
    the caller checks beforehand that the run can measure at all (:func:`~bigbatch.noise.scale.unavailable_reason`).
    """

    name = "noise_scale"  # its key in the engine's state and in checkpoints: another name would miss saved states

    def __init__(self, scale: NoiseScale, probe: SmallGradProbe) -> None:
        self.scale = scale
        self.probe = probe
        self._measuring = False
        self._small: tuple[torch.Tensor, int, float] | None = None  # first micro-batch: raw |g|^2, tokens, loss scale

    @property
    def estimate(self) -> float | None:
        """The smoothed noise scale in tokens, or ``None`` before the first measurement."""
        return self.scale.estimate

    def before_step(self, engine: AccumulationEngine, step: int, k: int) -> None:
        self._measuring = self.probe.can_measure(k) and self.scale.due(step)
        self._small = None
        if self._measuring:
            self.probe.arm(k)

    def after_backward(self, engine: AccumulationEngine, index: int, micro_batch: Any) -> None:
        if self._measuring and index == 0:  # this micro-batch's own gradient, before any cross-rank reduction
            loss_scale = float(engine.scaler.get_scale()) if engine.scaler.is_enabled() else 1.0
            self._small = (self.probe.take(), engine.primary_units(micro_batch), loss_scale)

    def after_step(self, engine: AccumulationEngine, outcome: StepOutcome) -> NoiseSample | None:
        if outcome.skipped:
            self._small = None
            return None
        sample = self._measure(engine, outcome.grad_norm, outcome.n_valid)
        self.scale.observe(outcome.grad_norm**2)  # weighs the next measurement (see noise/scale.py)
        return sample

    def _measure(self, engine: AccumulationEngine, grad_norm: float, n_valid: int) -> NoiseSample | None:
        """Fold this step's two squared norms into the noise scale (steps that read a small gradient only).

        The first micro-batch's raw gradient is ``loss_scale * world_size / N`` times that of its loss *sum*;
        its own mean-loss gradient is the raw one times ``N / (world_size * loss_scale * n_0)``. Ranks average
        ``|G_small|^2`` and ``1 / n_0`` (one small all-reduce); ``|G_big|^2`` is the pre-clip norm squared.
        """
        if self._small is None:
            return None
        raw_sq, n_small, loss_scale = self._small
        self._small = None
        dist, device = engine.dist, engine.device
        # A first micro-batch without valid targets (all masked or padding) has no mean-loss gradient: every rank
        # still takes part in the one all-reduce (a rank that left it would hang the others) and all skip together.
        empty = n_small == 0
        factor = 0.0 if empty else n_valid / (dist.world_size * loss_scale * n_small)
        values = torch.stack(
            [
                raw_sq.to(device, torch.float64) * factor**2,
                torch.tensor(0.0 if empty else 1.0 / n_small, dtype=torch.float64, device=device),
                torch.tensor(float(empty), dtype=torch.float64, device=device),
            ]
        )
        small_sq, inv_b_small, empty_ranks = dist.all_reduce_sum(values).tolist()
        if empty_ranks:
            return None
        small_sq, b_small = small_sq / dist.world_size, dist.world_size / inv_b_small
        if not b_small < n_valid:  # the other micro-batches held no valid target: one batch size, nothing to compare
            return None
        return self.scale.update(small_sq, grad_norm**2, b_small, n_valid)

    def state_dict(self) -> dict[str, Any]:
        return self.scale.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scale.load_state_dict(state)


def noise_meter_hooks(
    scale: NoiseScale | None, model: nn.Module, probe: SmallGradProbe | None = None
) -> list[StepHook]:
    """The engine's hooks for measuring with ``scale`` (none without one); the probe reads ``.grad`` after the
    first backward unless another is given (DDP and FSDP2 with one micro-batch per rank: see
    :func:`~bigbatch.noise.probe.small_grad_probe`)."""
    if scale is None:
        return []
    return [NoiseMeter(scale, probe or GradReadProbe(model))]
