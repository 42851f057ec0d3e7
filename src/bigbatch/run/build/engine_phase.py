"""The engine phase of a build: the model wrapped for its processes (DDP or FSDP2) and compiled, the optimizer and
its learning-rate schedule; :func:`~bigbatch.run.build.build_run` hands them and the step hooks to the engine."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn as nn

from bigbatch.engine.bad_steps import BadStepSettings
from bigbatch.engine.batch_change import BatchChangeRule, BatchFollower, OptimSettings
from bigbatch.engine.muon import LORA_REFUSAL, MuonSettings, build_muon
from bigbatch.engine.optim import CosineSchedule, build_adamw
from bigbatch.errors import ConfigError
from bigbatch.models.decoder import LanguageModel, fsdp_units
from bigbatch.models.registry import family_of
from bigbatch.models.routing import router_recorder
from bigbatch.parallel.distributed import (
    DistContext,
    GradSync,
    Say,
    launched_by_torchrun,
    resolve_parallel,
    wrap_model,
)
from bigbatch.progress import plural
from bigbatch.run.checkpoints.resume import initial_schedule
from bigbatch.run.configuration.optim_section import OptimSection
from bigbatch.run.configuration.train_config import GuardSection, TrainConfig, field_of


@dataclass(frozen=True)
class WrappedModel:
    """``wrapped`` is the model as DDP or FSDP2 wrapped it; ``train_model`` is what the engine runs (``wrapped``,
    compiled where asked)."""

    train_model: nn.Module
    wrapped: nn.Module
    grad_sync: GradSync
    parallel: str  # none, ddp or fsdp: what --parallel resolved to for this world size
    compiled: bool = False  # torch.compile wraps it: the first step compiles (the header says so)


def wrap_for_training(
    config: TrainConfig, model: LanguageModel, dist: DistContext, device: torch.device, precision: str, say: Say
) -> WrappedModel:
    parallel = resolve_parallel(config.run.parallel, dist.world_size)
    if config.run.parallel in ("ddp", "fsdp") and dist.world_size == 1:
        say(
            "--parallel %s has no effect in a single process: this run neither shards nor replicates the model "
            "(start several processes with --nproc N or torchrun)",
            config.run.parallel,
            level=logging.WARNING,
        )
    if config.run.max_restarts and not launched_by_torchrun():
        say(
            "--max-restarts has no effect in a single process: torchrun's elastic agent restarts workers of "
            "--nproc N > 1 (a single process resumes when run again)",
            level=logging.WARNING,
        )
    wrapped, grad_sync = wrap_model(
        model, parallel, dist, device, config.run.sync_every_micro_step, precision, units=fsdp_units(model)
    )
    # --replay-every re-runs a micro-batch eagerly: auto leaves the model eager so the two compute the same bits
    auto_compiles = device.type == "cuda" and not config.guard.replay_every
    compile_model = config.run.compile == "on" or (config.run.compile == "auto" and auto_compiles)
    train_model: nn.Module = wrapped
    if compile_model:  # as the family compiles (an hf: architecture that does not compile trains eagerly)
        train_model = family_of(model).compile(wrapped)
    return WrappedModel(train_model, wrapped, grad_sync, parallel, compiled=compile_model)


def check_optimizer(config: TrainConfig) -> None:
    """Optimizer settings that cannot train this run, or that would change nothing in it, refused in one line
    before anything is made."""
    opt = config.optim
    if opt.optimizer == "muon" and config.model.lora_rank:
        raise ConfigError(LORA_REFUSAL)
    if opt.optimizer != "muon":
        defaults = OptimSection()
        given = [
            f"--{field.name.replace('_', '-')} {getattr(opt, field.name)}"
            for field in fields(OptimSection)
            if field.name.startswith(("muon_", "batch_change_momentum"))
            and getattr(opt, field.name) != getattr(defaults, field.name)
        ]
        if given:
            raise ConfigError(
                f"{given[0]} applies to --optimizer muon, and this run trains with {opt.optimizer}; add "
                "--optimizer muon or leave it out"
            )


def build_optimizer(
    config: TrainConfig, model: LanguageModel, resume_from: Path | None, dist: DistContext, say: Say
) -> tuple[torch.optim.Optimizer, CosineSchedule]:
    """AdamW (or Muon with AdamW: ``--optimizer muon``) over ``model``'s parameters (after wrapping: FSDP2 replaces
    them with sharded ones) and the warmup + cosine schedule of this run's length."""
    opt = config.optim
    betas = (opt.beta1, opt.beta2)
    optimizer: torch.optim.Optimizer
    if opt.optimizer == "muon":
        muon = muon_settings(config)
        optimizer = build_muon(
            model,
            muon,
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            betas=betas,
            eps=opt.eps,
            world_size=dist.world_size,
            rank=dist.rank,
        )
    else:
        optimizer = build_adamw(model, lr=opt.lr, weight_decay=opt.weight_decay, betas=betas, eps=opt.eps)
    schedule = initial_schedule(opt.lr, opt.min_lr_ratio, opt.warmup_steps, opt.decay_steps, config.run.max_steps)
    if opt.warmup_steps > schedule.warmup_steps and resume_from is None:
        say(
            "warmup_steps %d is longer than the run (%s): warming up over all %d",
            opt.warmup_steps,
            plural(schedule.decay_steps, "step"),
            schedule.warmup_steps,
            level=logging.WARNING,
        )
    return optimizer, schedule


def muon_settings(config: TrainConfig) -> MuonSettings:
    """Muon's settings from ``[optim]``: its learning rate ``auto`` is ``--lr`` with the RMS-matched scale (the
    update's size is AdamW's) and 0.02 with the spectral one."""
    opt = config.optim
    lr = opt.muon_lr or (opt.lr if opt.muon_scale == "rms" else 0.02)
    return MuonSettings(
        lr=lr,
        momentum=opt.muon_momentum,
        weight_decay=opt.muon_weight_decay,
        ns_steps=opt.muon_ns_steps,
        coefficients=opt.muon_coefficients,
        scale=opt.muon_scale,
    )


def build_follower(config: TrainConfig, reference_tokens: int) -> BatchFollower:
    """How the optimizer follows a change of the tokens per step (``--batch-change-rule``), from the configured
    settings, which hold at ``reference_tokens`` (the plan's; a resumed run restores its first one)."""
    opt = config.optim
    rule = BatchChangeRule.resolve(
        opt.batch_change_rule, opt.batch_change_betas, opt.batch_change_weight_decay, opt.batch_change_momentum
    )
    base = OptimSettings(opt.lr, opt.beta1, opt.beta2, opt.weight_decay)
    if opt.optimizer == "muon":
        muon = muon_settings(config)
        base = replace(base, momentum=muon.momentum, muon_lr=muon.lr, muon_weight_decay=muon.weight_decay)
    return BatchFollower(rule, base, reference_tokens, requested=opt.batch_change_rule)


def bad_step_settings(config: TrainConfig, device: torch.device) -> BadStepSettings:
    """The engine's watch over its steps, from ``[guard]``. A replay compares bits, so on CUDA it turns on
    deterministic algorithms (cuBLAS needs its workspace setting before its first use)."""
    guard = config.guard
    if guard.replay_every and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return BadStepSettings(
        mode=guard.bad_step,
        replay_every=guard.replay_every,
        spike_window=guard.spike_window,
        loss_spike=loss_spike_threshold(config),
        grad_spike=guard.grad_spike,
        spike_min_steps=min(20, guard.spike_window),
        seed=config.run.seed,
    )


def loss_spike_threshold(config: TrainConfig) -> float:
    """``--loss-spike``; off for ``--objective grpo`` unless given: a policy-gradient loss hovers near 0 and changes
    sign from step to step (its value is not a loss bounded below), so its robust spread says nothing about a bad
    batch; the gradient-norm spike still watches each step and micro-batch."""
    guard = config.guard
    if config.objective.name == "grpo" and guard.loss_spike == field_of(GuardSection, "loss_spike").default:
        return 0.0
    return guard.loss_spike


def resolve_router_balance(config: TrainConfig, model: LanguageModel) -> str:
    """The engine's router-balance mode: ``auto`` is ``exact``. A router setting given for a dense model is refused
    in one line (it would change nothing)."""
    section = config.model
    if getattr(model, "router_refusal", ""):  # an hf: mixture of experts trained without balancing (checked before)
        return "off"
    if router_recorder(model) is None:
        given = [
            flag
            for flag, is_set in (
                (f"--router-balance {section.router_balance}", section.router_balance != "auto"),
                (f"--router-aux-coef {section.router_aux_coef:g}", bool(section.router_aux_coef)),
                (f"--router-z-coef {section.router_z_coef:g}", bool(section.router_z_coef)),
            )
            if is_set
        ]
        if given:
            raise ConfigError(
                f"{given[0]} applies to a mixture of experts, and {section.init_from or section.preset} is dense (no "
                "router); leave it out or train an MoE model (e.g. --model moe-nano)"
            )
    return "exact" if section.router_balance == "auto" else section.router_balance
