"""The sizing phase of a build: K and the micro-batch (measured with ``--micro-batch auto``), the step policy,
and the batch-size ramp."""

from __future__ import annotations

import torch

from bigbatch.engine.optim import CosineSchedule
from bigbatch.errors import ConfigError
from bigbatch.models import LanguageModel
from bigbatch.noise.scale import unavailable_reason
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.sizing.autobatch import candidate_micro_batches, choose_micro_batch
from bigbatch.sizing.plan import BatchPlan, plan_batch
from bigbatch.sizing.ramp import BatchRamp, parse_ramp
from bigbatch.sizing.seesaw import SeesawSchedule


def plan_steps(
    config: TrainConfig, model: LanguageModel, dist: DistContext, device: torch.device, precision: str, say: Say
) -> BatchPlan:
    """K and the micro-batch (measured with ``--micro-batch auto``); one micro-batch per step's unit with a budget."""
    batch = config.batch
    micro_batch = batch.micro_batch or auto_micro_batch(config, model, dist, device, precision, say)
    if batch.token_budget or config.objective.name == "grpo":  # K per step from the budget, or the completions
        return BatchPlan(micro_batch, batch.seq_len, accumulation_steps=1, world_size=dist.world_size)
    return plan_batch(batch.total_batch_tokens, micro_batch, batch.seq_len, world_size=dist.world_size)


def auto_micro_batch(
    config: TrainConfig, model: LanguageModel, dist: DistContext, device: torch.device, precision: str, say: Say
) -> int:
    """Rank 0 finds the largest micro-batch that fits and keeps tokens per step exact; every rank uses it."""
    batch = config.batch
    choice = 0
    if dist.is_main:
        if batch.token_budget:
            candidates = [2**i for i in range(11)]
        else:
            candidates = candidate_micro_batches(batch.total_batch_tokens, batch.seq_len, dist.world_size)
        choice = choose_micro_batch(
            model.config,
            candidates,
            batch.seq_len,
            k=2,
            device=device,
            precision=precision,
            memory_budget_mib=batch.memory_budget,
            activation_checkpointing=model.activation_checkpointing,
            chunked_loss=model.chunked_loss,
        )
        say("auto micro-batch: %d (largest that fits among %s)", choice, candidates)
    return int(dist.broadcast_object(choice))


def noise_unmeasurable(config: TrainConfig, plan: BatchPlan) -> str | None:
    """Why this run's steps can never measure the noise scale, or ``None``."""
    if config.objective.name != "lm":
        return f"it is measured in tokens of a next-token loss, which --objective {config.objective.name} is not"
    # A token budget sizes every step on its own (the plan's K = 1 is only its unit): the engine decides per step
    # whether that step has a second micro-batch to measure with.
    planned_k = 2 if config.batch.token_budget else plan.accumulation_steps
    return unavailable_reason(planned_k, plan.world_size)


def build_ramp(config: TrainConfig, plan: BatchPlan) -> BatchRamp | None:
    """The ``--batch-ramp`` of this plan, or ``None``; auto needs the noise scale this run measures."""
    spec = parse_ramp(config.batch.batch_ramp)
    if spec is None:
        return None
    if spec.auto:
        if not config.run.noise_scale_every:
            reason: str | None = "--noise-scale-every is 0; set it to N > 0"
        else:
            reason = noise_unmeasurable(config, plan)
        if reason:
            raise ConfigError(
                f"--batch-ramp auto grows toward the measured gradient noise scale, which this run cannot measure: "
                f"{reason}"
            )
    return BatchRamp(spec, plan)


SEESAW_DEFAULT_DOUBLINGS = 3
"""--max-batch-tokens auto: 8 x total_batch_tokens, the doublings a cosine decay to 0.1 x lr halves through."""


def build_seesaw(config: TrainConfig, plan: BatchPlan, schedule: CosineSchedule) -> SeesawSchedule | None:
    """``--schedule seesaw``'s sizes and learning rates over this plan, or ``None`` for the plain schedule."""
    batch = config.batch
    if config.optim.schedule != "seesaw":
        if batch.max_batch_tokens:
            raise ConfigError(
                "--max-batch-tokens caps the doublings of --schedule seesaw, and this run's schedule is "
                f"{config.optim.schedule}; add --schedule seesaw or leave --max-batch-tokens out"
            )
        return None
    if batch.batch_ramp or batch.token_budget:
        flag = "--batch-ramp" if batch.batch_ramp else "--token-budget"
        raise ConfigError(
            f"--schedule seesaw sets the tokens of every step itself, and so does {flag}; use one of them"
        )
    unit = plan.tokens_per_k
    cap = batch.max_batch_tokens or plan.tokens_per_step * 2**SEESAW_DEFAULT_DOUBLINGS
    if cap % unit:
        raise ConfigError(
            f"--max-batch-tokens {cap:,} is not a whole number of micro-batches of {unit:,} tokens (micro_batch "
            f"{plan.micro_batch} x seq_len {plan.seq_len} x world {plan.world_size}); use a multiple of {unit:,}"
        )
    return SeesawSchedule(schedule, plan.accumulation_steps, cap // unit, config.run.max_steps)
