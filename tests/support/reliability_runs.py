"""Short training runs shared by the reliability and randomness tests: the config, the command line, the
process launchers and what a finished run left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bigbatch.run.checkpoints import checkpoint as ckpt
from bigbatch.run.configuration.train_config import TrainConfig

STEPS = 6


def make_config(corpus: Path, out: Path, **run: object) -> TrainConfig:
    config = TrainConfig()
    config.model.preset = "pico"
    config.model.dropout = 0.1  # makes the RNG state matter for exactness
    config.data.data = str(corpus)
    config.data.cache_dir = str(out.parent / "cache")
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = 2, 32, 256  # K = 4
    config.run.max_steps = STEPS
    config.run.eval_every = 3
    config.run.eval_batches = 2
    config.run.sample_tokens = 0
    config.run.out = str(out)
    for key, value in run.items():
        setattr(config.run, key, value)
    return config


def step_losses(run_dir: Path) -> list[float]:
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "step"]


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(run_dir)["model"]


def assert_same_final_model(run_dir: Path, golden_dir: Path) -> None:
    """The newest checkpoints of two runs hold bitwise equal parameters (each read, and consolidated, once)."""
    ours, theirs = final_model(run_dir), final_model(golden_dir)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def cli_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--model",
        "pico",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--total-batch-tokens",
        "256",
        "--max-steps",
        str(STEPS),
        "--eval-every",
        "3",
        "--eval-batches",
        "2",
        "--sample-tokens",
        "0",
        "--cache-dir",
        str(out.parent / "cache"),
        "--out",
        str(out),
        *extra,
    ]


def run_cli(args: list[str], fault: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("BIGBATCH_FAULT", None)
    if fault:
        env["BIGBATCH_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "bigbatch", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def torchrun_cli(
    args: list[str], fault: str | None, max_restarts: int = 0, timeout: float = 300
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("BIGBATCH_FAULT", None)
    if fault:
        env["BIGBATCH_FAULT"] = fault
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        "-m",
        "bigbatch",
        *args,
    ]
    if "--collective-timeout" not in args:
        command += ["--collective-timeout", "60"]  # a stuck rendezvous fails within a minute, not ten
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


class Crash(RuntimeError):
    """The failure :func:`crash_at` injects."""


def crash_at(trainer: Any, step: int, micro: int) -> None:
    """Make the trainer fail inside micro-batch ``micro`` of optimizer step ``step`` (1-based)."""
    inner = trainer.engine.loss_fn
    seen = {"step": 0, "micro": -1}

    def failing(model: torch.nn.Module, batch: object) -> torch.Tensor:
        current = trainer.engine.step_count + 1
        seen["micro"] = seen["micro"] + 1 if seen["step"] == current else 0
        seen["step"] = current
        if model.training and current == step and seen["micro"] == micro:
            raise Crash(f"injected crash in step {step}")
        return inner(model, batch)

    trainer.engine.loss_fn = failing
