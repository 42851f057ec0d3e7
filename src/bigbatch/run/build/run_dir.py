"""The run-directory phase of a build (after the check): the run directory, chosen (``--out`` or the
settings' default) and held by one writer."""

from __future__ import annotations

from pathlib import Path

from bigbatch.errors import ConfigError
from bigbatch.files.outputs import RUN_MARKER, is_legacy_run, require_own_dir
from bigbatch.parallel.distributed import DistContext, Say
from bigbatch.run.config import TrainConfig
from bigbatch.run.identity import default_run_dir
from bigbatch.run.lock import RunDirLock, lock_run_dir


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
            require_own_dir(run_dir, "run directory", "--out", RUN_MARKER, is_legacy_run)
            run_lock = lock_run_dir(run_dir, config.run.wait_for_lock, say)
        except ConfigError as exc:  # not bigbatch's directory, or in use
            refusal = exc
    message = dist.broadcast_object(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    if message is not None:
        raise ConfigError(message)
    return run_dir, run_lock
