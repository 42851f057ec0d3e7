"""The check phase: what a run's settings refuse before anything is built, shared by :func:`~bigbatch.run.build.
build_run` (every worker) and :func:`check_before_launch` (``bigbatch train --nproc N``, once, before torchrun
starts), so a user error found there is one line from one process, before any process group exists.

The workers check again (they are the authority, and torchrun can be started without bigbatch's launcher). The
launch check only reads, except that the data is prepared into the cache, which the workers' rank 0 would do
anyway.
"""

from __future__ import annotations

from pathlib import Path

from bigbatch.data.dataset import open_dataset
from bigbatch.errors import ConfigError, require_creatable_dir
from bigbatch.files.outputs import require_own_run_dir
from bigbatch.observe.metrics import check_optional_loggers
from bigbatch.parallel.distributed import DistContext, resolve_device
from bigbatch.run.build.data_phase import build_loader, check_micro_batch_fits, prepare_data
from bigbatch.run.build.model_phase import preset_shape
from bigbatch.run.checkpoints.resume import find_resume_checkpoint
from bigbatch.run.configuration.data_mode import resolve_data_mode
from bigbatch.run.configuration.seq_len import resolve_seq_len
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.sizing.plan import BatchPlan, plan_batch
from bigbatch.sizing.ramp import BatchRamp, parse_ramp


def check_config(config: TrainConfig) -> TrainConfig:
    """The settings on their own: valid fields, loggers whose packages are installed, a cache directory that can
    be made; returns the config with ``seq_len`` auto resolved to the model's block size (from here on, the
    number) and ``data_mode`` auto to the data's mode (documents for conversations, else packed)."""
    config.validate()
    check_guard(config)
    check_optional_loggers(bool(config.run.tensorboard), str(config.run.wandb or ""))
    if config.data.cache_dir:
        require_creatable_dir(Path(config.data.cache_dir), "cache directory")
    return resolve_data_mode(resolve_seq_len(config))


def check_guard(config: TrainConfig) -> None:
    """``--replay-every`` needs each rank's own gradient contribution and the same kernels twice: refused in one
    line with FSDP2 (gradients are reduce-scattered inside backward), ``--compile on`` (the re-run is eager) and
    ``--router-balance running`` (its loss reduces across ranks in each micro-batch)."""
    if not config.guard.replay_every:
        return
    refused = [
        (config.run.parallel == "fsdp", "--parallel fsdp: FSDP2 shards each gradient inside backward; use ddp"),
        (
            config.run.compile == "on",
            "--compile on: the re-run is eager and would differ in its last bits; leave "
            "--compile auto (off with --replay-every)",
        ),
        (
            config.model.router_balance == "running",
            "--router-balance running: its loss reduces across ranks in every micro-batch; use exact",
        ),
    ]
    for refused_here, why in refused:
        if refused_here:
            raise ConfigError(f"--replay-every {config.guard.replay_every} does not work with {why}")


def check_batch(config: TrainConfig, world_size: int) -> None:
    """The batch arithmetic of a resolved config, when the settings alone decide it (a micro-batch given, no token
    budget): a total that does not divide, or a ramp that starts below one micro-batch, is refused before any
    directory is made."""
    batch = config.batch
    if config.objective.name == "grpo":
        return  # a step is its completions (K follows them): the total does not size it
    if batch.micro_batch and not batch.token_budget:
        full = plan_batch(batch.total_batch_tokens, batch.micro_batch, batch.seq_len, world_size=world_size)
        spec = parse_ramp(batch.batch_ramp)
        if spec is not None:
            BatchRamp(spec, full)  # START_TOKENS below one micro-batch per process


def check_before_launch(config: TrainConfig, world_size: int) -> None:
    """Raise the :class:`~bigbatch.errors.BigBatchError` a worker would raise at start-up, if any."""
    config = check_config(config)
    run, batch = config.run, config.batch
    resolve_device(run.device)  # e.g. cuda asked for where there is none
    if run.out:
        out = Path(run.out)
        require_own_run_dir(out)
        find_resume_checkpoint(out, run.resume, run.overwrite, is_main=False)
    check_batch(config, world_size)
    dataset = open_dataset(prepare_data(config))
    if not config.model.init_from:
        preset_shape(config, dataset.vocab_size)  # the shape only: no weights are allocated here
    if batch.micro_batch:
        plan = BatchPlan(batch.micro_batch, batch.seq_len, accumulation_steps=1, world_size=world_size)
        train = build_loader(config, dataset, plan, DistContext(0, world_size), "train", "training")
        check_micro_batch_fits(train, batch.micro_batch, world_size)
