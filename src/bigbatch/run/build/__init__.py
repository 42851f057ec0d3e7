"""Every part of a training run, built from a :class:`~bigbatch.run.configuration.train_config.TrainConfig` in
phases, each with the narrow inputs it needs, in the order data flows:

check (:mod:`.checks`) -> run directory: chosen and held by one writer (:func:`hold_run_dir`, here) -> data
(:mod:`.data_phase`) -> model (:mod:`.model_phase`) -> sizing: plan, step policy, ramp (:mod:`.sizing_phase`) ->
loaders (:mod:`.data_phase`) -> engine: wrapping, optimizer, schedule (:mod:`.engine_phase`) -> observers: step
hooks, peak FLOPs (:mod:`.observers`) -> the engine.

:func:`build_run` returns them as one frozen :class:`RunParts`; the trainer runs them and
:class:`~bigbatch.run.checkpoints.state.TrainState` saves and restores their state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from bigbatch.data.dataset import Dataset
from bigbatch.data.validation_windows import ValidationWindows
from bigbatch.engine.accumulate import AccumulationEngine, resolve_precision
from bigbatch.engine.batch import StepPolicy
from bigbatch.engine.rng import seed_rank_generators
from bigbatch.errors import ConfigError
from bigbatch.files.outputs import require_own_run_dir
from bigbatch.models import LanguageModel
from bigbatch.noise.meter import NoiseMeter
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.run.build.checks import check_batch, check_config
from bigbatch.run.build.data_phase import Loader, build_loaders, open_run_data
from bigbatch.run.build.engine_phase import (
    bad_step_settings,
    build_follower,
    build_optimizer,
    check_optimizer,
    wrap_for_training,
)
from bigbatch.run.build.model_phase import build_run_model
from bigbatch.run.build.objective_phase import build_objective, check_objective, prepare_reference_table
from bigbatch.run.build.observers import build_observers
from bigbatch.run.build.rollout_phase import build_rollout_loader, connect_rollouts, rollout_pack, say_no_validation
from bigbatch.run.build.sizing_phase import build_ramp, build_seesaw, plan_steps
from bigbatch.run.checkpoints.resume import find_resume_checkpoint
from bigbatch.run.configuration.identity import default_run_dir
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.run_dir_lock import RunDirLock, lock_run_dir
from bigbatch.sizing.plan import BatchPlan
from bigbatch.sizing.ramp import BatchRamp
from bigbatch.sizing.seesaw import SeesawSchedule


@dataclass(frozen=True)
class RunParts:
    """The built run. ``model`` is the user's module (FSDP2 shards its parameters in place); ``train_model`` is
    what the engine runs (DDP-wrapped and/or compiled)."""

    config: TrainConfig
    dist: DistContext
    device: torch.device
    run_dir: Path
    resume_from: Path | None  # the checkpoint to continue from; None: a fresh start
    dataset: Dataset  # a prepared or foreign token dataset
    fingerprints: dict[str, str]  # of the dataset's tokenizer and tokens
    bpe_json: str | None  # a bpe:VOCAB tokenizer travels inside each checkpoint (it is small)
    model: LanguageModel  # GPT, Llama, MoE or an hf: model
    train_model: nn.Module
    parallel: str
    optimizer: torch.optim.Optimizer
    engine: AccumulationEngine  # holds the learning-rate schedule
    plan: BatchPlan
    policy: StepPolicy
    train_loader: Loader
    val_loader: ValidationWindows | None  # the fixed windows every evaluation scores
    peak_flops: float | None  # per device, for MFU; None when unknown
    ramp: BatchRamp | None = None  # --batch-ramp: K per step grows to the plan's (see bigbatch.sizing.ramp)
    seesaw: SeesawSchedule | None = None  # --schedule seesaw: K per step and the schedule in tokens
    noise: NoiseMeter | None = None  # the engine's noise-scale hook, for its estimate (None: not measured)
    run_lock: RunDirLock | None = None  # rank 0's hold on run_dir (run/loop/run_dir_lock.py); the trainer releases it
    seq_len_auto: bool = False  # --seq-len was auto: config.batch.seq_len is the model's block size
    data_mode_auto: bool = False  # --data-mode was auto: config.data.data_mode is what the data was read as
    compiled: bool = False  # train_model is torch.compile's: its first call compiles (see run/loop/header.py)

    @property
    def documents(self) -> bool:
        return bool(self.dataset.meta.mode == "documents")

    @property
    def k_varies(self) -> bool:
        return bool(self.policy.token_budget) or self.documents or self.ramp is not None or self.seesaw is not None

    @property
    def planned_tokens_per_step(self) -> int:
        """The tokens per step the run is planned at: its token budget, or K micro-batches on every rank (a ramp or
        Seesaw moves a step away from it)."""
        return self.policy.token_budget or self.plan.tokens_per_step

    @property
    def last_step(self) -> int:
        """The run's last optimizer step: ``max_steps``, or fewer with Seesaw (the same tokens in larger steps)."""
        return self.seesaw.total_steps if self.seesaw is not None else self.config.run.max_steps

    @property
    def batch_change_cause(self) -> str:
        """What changes the tokens per step during this run, for its batch-change lines."""
        if self.seesaw is not None:
            return "seesaw"
        if self.ramp is not None:
            return "batch ramp auto" if self.ramp.spec.auto else "batch ramp"
        return "batch"


def seed_everything(seed: int) -> None:
    """The same state on every rank: for building the model (identical parameters on every rank). Training
    itself draws from each rank's own streams (:func:`~bigbatch.engine.rng.seed_rank_generators`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def chosen_run_dir(config: TrainConfig) -> Path:
    """``--out``, or the default directory of these settings (the same settings find the same run again)."""
    return Path(config.run.out) if config.run.out else default_run_dir(config)


def hold_run_dir(config: TrainConfig, dist: DistContext, say: Say) -> tuple[Path, RunDirLock | None]:
    """The run directory (rank 0's choice when defaulted), held by rank 0 (or its launcher) from here to the end
    of the run; every rank raises the same one-line error when another process holds it."""
    run_dir = Path(dist.broadcast_object(str(chosen_run_dir(config))))
    run_lock, refusal = None, None
    if dist.is_main:  # alone: the others would see the directory half-made
        try:
            require_own_run_dir(run_dir)
            run_lock = lock_run_dir(run_dir, config.run.wait_for_lock, say)
        except ConfigError as exc:  # not bigbatch's directory, or in use
            refusal = exc
    message = dist.broadcast_object(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    if message is not None:
        raise ConfigError(message)
    return run_dir, run_lock


def build_run(config: TrainConfig, dist: DistContext, device: torch.device, say: Say) -> RunParts:
    """Every part of the run, on every rank alike (rank 0 prepares data; the others wait and find it)."""
    seq_len_auto = config.batch.seq_len in (0, "auto")  # auto is stored as 0 (or set as the word from Python)
    data_mode_auto = config.data.data_mode == "auto"
    config = check_config(config)
    check_objective(config)
    check_optimizer(config)
    check_batch(config, dist.world_size)  # before the run directory is made
    seed_everything(config.run.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    run_dir, run_lock = hold_run_dir(config, dist, say)
    try:
        return _build_parts(config, dist, device, say, run_dir, run_lock, seq_len_auto, data_mode_auto)
    except BaseException:  # a run refused or failed while building leaves its directory free
        if run_lock is not None:
            run_lock.release()
        raise


def _training_data(
    config: TrainConfig,
    dataset: Dataset,
    plan: BatchPlan,
    dist: DistContext,
    device: torch.device,
    pack: bool,
    model: LanguageModel,
    say: Say,
) -> tuple[Loader, ValidationWindows | None]:
    """The training loader and validation windows: the data's, or for learning from rewards the completions
    sampled each step or read from a rollouts file (no validation split)."""
    if config.objective.name != "grpo":
        return build_loaders(config, dataset, plan, dist, pack)
    say_no_validation(config, say)
    return build_rollout_loader(config, dataset, plan, dist, device, rollout_pack(config, model), say), None


def _build_parts(
    config: TrainConfig,
    dist: DistContext,
    device: torch.device,
    say: Say,
    run_dir: Path,
    run_lock: RunDirLock | None,
    seq_len_auto: bool,
    data_mode_auto: bool = False,
) -> RunParts:
    """The phases after the run directory is chosen and held (see :func:`build_run`)."""
    resume_from = find_resume_checkpoint(run_dir, config.run.resume, config.run.overwrite, dist.is_main)
    dist.barrier()
    data = open_run_data(config, dist, say)
    built = build_run_model(config, data.dataset, device, say)
    model = built.model
    objective = build_objective(config, model, data.dataset, device, say)  # a frozen reference: the model as it starts
    precision = resolve_precision(config.run.precision, device)
    plan = plan_steps(config, model, dist, device, precision, say)
    policy = StepPolicy(plan.accumulation_steps, config.batch.token_budget, config.batch.last_window)
    train_loader, val_loader = _training_data(config, data.dataset, plan, dist, device, built.pack, model, say)
    ramp = build_ramp(config, plan)
    wrapped = wrap_for_training(config, model, dist, device, precision, say)
    connect_rollouts(config, train_loader, objective, wrapped.train_model, wrapped.parallel, dist, device, say)
    prepare_reference_table(config, objective, wrapped.train_model, data, plan, run_dir, built.pack, dist, device, say)
    optimizer, cosine = build_optimizer(config, model, resume_from, dist, say)
    seesaw = build_seesaw(config, plan, cosine)
    schedule = seesaw or cosine
    # a grpo step is its prompts' completions, whatever --micro-batch or the processes: its size never changes
    grpo = config.objective.name == "grpo"
    follower = None if grpo else build_follower(config, config.batch.token_budget or plan.tokens_per_step)
    observers = build_observers(config, plan, wrapped.wrapped, wrapped.parallel, dist, device, say)
    engine = AccumulationEngine(
        wrapped.train_model,
        optimizer,
        schedule,
        grad_clip=config.optim.grad_clip,
        precision=precision,
        device=device,
        grad_sync=wrapped.grad_sync,
        dist=dist,
        hooks=observers.hooks,
        objective=objective,
        follower=follower,
        bad_steps=bad_step_settings(config, device),
        parallel=wrapped.parallel,
    )
    # Every part is built (the model from the shared seed above; probes leave the generators as they found
    # them): from here on each rank draws its own stream, e.g. its own dropout masks for its own samples.
    seed_rank_generators(config.run.seed, dist.rank)
    return RunParts(
        config=config,
        dist=dist,
        device=device,
        run_dir=run_dir,
        resume_from=resume_from,
        dataset=data.dataset,
        fingerprints=data.fingerprints,
        bpe_json=data.bpe_json,
        model=model,
        train_model=wrapped.train_model,
        parallel=wrapped.parallel,
        optimizer=optimizer,
        engine=engine,
        plan=plan,
        policy=policy,
        train_loader=train_loader,
        val_loader=val_loader,
        peak_flops=observers.peak_flops,
        ramp=ramp,
        seesaw=seesaw,
        noise=observers.noise,
        run_lock=run_lock,
        seq_len_auto=seq_len_auto,
        data_mode_auto=data_mode_auto,
        compiled=wrapped.compiled,
    )
