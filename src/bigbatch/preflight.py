"""What every worker of ``bigbatch train --nproc N`` would refuse, checked once before torchrun starts.

A user error found here is one line from one process, before any process group
exists. The workers check again (they are the authority, and torchrun can be
started without bigbatch's launcher); these checks only read, except that the
data is prepared into the cache, which the workers' rank 0 would do anyway.
"""

from __future__ import annotations

from pathlib import Path

from bigbatch.config import TrainConfig
from bigbatch.errors import require_creatable_dir


def check_before_launch(config: TrainConfig, world_size: int) -> None:
    """Raise the :class:`~bigbatch.errors.BigBatchError` a worker would raise at start-up, if any."""
    from bigbatch.build import check_micro_batch_fits
    from bigbatch.data.cache import ensure_prepared
    from bigbatch.data.dataset import open_dataset
    from bigbatch.data.loader import loader_for
    from bigbatch.distributed import resolve_device
    from bigbatch.metrics import check_optional_loggers
    from bigbatch.model import preset
    from bigbatch.outputs import RUN_MARKER, is_legacy_run, require_own_dir
    from bigbatch.plan import plan_batch
    from bigbatch.resume import find_resume_checkpoint

    run, data, batch = config.run, config.data, config.batch
    check_optional_loggers(bool(run.tensorboard), str(run.wandb or ""))
    resolve_device(run.device)  # e.g. cuda asked for where there is none
    if run.out:
        out = Path(run.out)
        require_own_dir(out, "run directory", "--out", RUN_MARKER, is_legacy_run)
        find_resume_checkpoint(out, run.resume, run.overwrite, is_main=False)
    if data.cache_dir:
        require_creatable_dir(Path(data.cache_dir), "cache directory")
    if batch.micro_batch and not batch.token_budget:
        plan_batch(batch.total_batch_tokens, batch.micro_batch, batch.seq_len, world_size=world_size)
    dataset = open_dataset(ensure_prepared(data.data, data.tokenizer, data.val_fraction, data.cache_dir or None,
                                           mode=data.data_mode))  # fmt: skip
    if not config.model.init_from:
        overrides = {"block_size": config.model.block_size} if config.model.block_size else {}
        shape = preset(config.model.preset, vocab_size=dataset.vocab_size, **overrides)
        if batch.seq_len > shape.block_size:
            from bigbatch.errors import ConfigError

            raise ConfigError(
                f"seq_len={batch.seq_len} exceeds the {config.model.preset} model's block_size={shape.block_size}; "
                "lower --seq-len or raise --block-size"
            )
    if batch.micro_batch:
        train = loader_for(dataset, "train", batch.micro_batch, batch.seq_len, 0, world_size, name="training",
                           long_documents=data.long_documents)
        check_micro_batch_fits(train, batch.micro_batch, world_size)
