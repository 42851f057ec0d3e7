"""The observers of a build: what attaches to the engine's step as hooks (the gradient noise scale's meter,
and fault injection for the reliability tests), and the device's peak FLOPs for MFU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from bigbatch.engine.hooks import StepHook
from bigbatch.noise.meter import NoiseMeter
from bigbatch.noise.probe import small_grad_probe
from bigbatch.noise.scale import NoiseScale, decay_for_window
from bigbatch.observe.metrics import device_peak_flops
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.run.build.sizing_phase import noise_unmeasurable
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.faults import FaultInjection, faults_from_env
from bigbatch.sizing.plan import BatchPlan


@dataclass(frozen=True)
class Observers:
    """The engine's step hooks (the noise meter first), the noise meter itself for those that read its
    estimate, and the device's peak FLOPs for MFU (``None``: unknown)."""

    hooks: list[StepHook]
    noise: NoiseMeter | None
    peak_flops: float | None


def build_observers(
    config: TrainConfig,
    plan: BatchPlan,
    wrapped: nn.Module,
    parallel: str,
    dist: DistContext,
    device: torch.device,
    say: Say,
) -> Observers:
    """``wrapped`` is the model as DDP or FSDP2 wrapped it (where the noise meter's probe reads gradients)."""
    hooks: list[StepHook] = []
    noise = noise_meter(config, plan, wrapped, parallel, say)
    if noise is not None:
        hooks.append(noise)
    hooks.extend(FaultInjection(fault, dist.rank, wrapped) for fault in faults_from_env())
    peak_flops = config.run.peak_flops or (
        device_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    )
    return Observers(hooks, noise, peak_flops)


def noise_meter(config: TrainConfig, plan: BatchPlan, wrapped: nn.Module, parallel: str, say: Say) -> NoiseMeter | None:
    """The noise-scale meter (``--noise-scale-every``), or ``None``: off, or (said once) not measurable."""
    if not config.run.noise_scale_every:
        return None
    reason = noise_unmeasurable(config, plan)
    if reason:
        say("the gradient noise scale is not measured in this run: %s", reason)
        return None
    scale = NoiseScale(config.run.noise_scale_every, decay_for_window(config.run.noise_scale_window))
    probe = small_grad_probe(
        wrapped, parallel, config.run.sync_every_micro_step, first_reduced_possible=plan.accumulation_steps == 1
    )
    return NoiseMeter(scale, probe)
