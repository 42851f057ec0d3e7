"""The ``bigbatch train`` settings the benchmarks time the Trainer with (imported by them, not a benchmark)."""

from __future__ import annotations

from pathlib import Path

from bigbatch.config import TrainConfig


def cpu_run_config(data: Path | str, out: Path | str, micro_batch: int, seq_len: int, k: int, steps: int) -> TrainConfig:
    """The demo's defaults otherwise (nano, optimizer, noise scale, log every step): ``steps`` steps of ``k``
    micro-batches of ``micro_batch x seq_len`` on the CPU into ``out``, without evaluation or the end-of-run
    sample (the minimal loops they are compared with have neither)."""
    config = TrainConfig()
    config.data.data = str(data)
    config.batch.micro_batch, config.batch.seq_len = micro_batch, seq_len
    config.batch.total_batch_tokens = micro_batch * seq_len * k
    config.run.max_steps = steps
    config.run.out = str(out)
    config.run.device = "cpu"
    config.run.eval_every = 0
    config.run.sample_tokens = 0
    return config
