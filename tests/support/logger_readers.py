"""Reading back what the optional loggers wrote, with the packages' own readers, for comparison with
``metrics.jsonl``: TensorBoard's EventAccumulator, and W&B's record format (``wandb.proto``)."""

from __future__ import annotations

import json
from pathlib import Path

from bigbatch.observe.wandb_log import LoggedRun, read_logged_run


def wandb_offline_env(root: Path) -> dict[str, str]:
    """Environment for an offline W&B run that keeps everything under ``root`` and skips what tests don't need
    (console capture, system stats, machine metadata, git)."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_META": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_DIR": str(root / "wandb-dir"),
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
    }


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve in ``log_dir`` as TensorBoard itself loads it: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def metrics_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wandb_run(run_dir: Path) -> tuple[str, LoggedRun]:
    """The W&B run id kept in the run directory, and what that run's offline files hold."""
    run_id = json.loads((run_dir / "wandb.json").read_text())["id"]
    return run_id, read_logged_run(run_dir / "wandb", run_id)
