"""The ``[batch]`` section: the tokens per step and how they are split (micro-batch, seq_len, ramps)."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.run.configuration.fields import config_field as _opt
from bigbatch.run.configuration.seq_len import INIT_FROM_AUTO_SEQ_LEN_CAP
from bigbatch.settings.choices import LAST_WINDOW
from bigbatch.settings.ranges import NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_INT_OR_AUTO, POSITIVE_OR_AUTO


@dataclass
class BatchSection:
    total_batch_tokens: int = _opt(
        16384,
        "tokens per optimizer step = micro_batch x seq_len x K x world_size",
        range=POSITIVE_INT,
    )
    micro_batch: int = _opt(
        16,
        "sequences per micro-batch per device (B); 'auto' picks the largest that fits",
        range=POSITIVE_INT_OR_AUTO,
    )
    memory_budget: float = _opt(
        0.0,
        "MiB a training step may use on CPU, for --micro-batch auto; auto: none given (CUDA probes what fits in the "
        "device's memory; on CPU --micro-batch auto then asks for one)",
        range=POSITIVE_OR_AUTO,
        legacy_zero=True,
    )
    seq_len: int = _opt(
        0,
        "tokens per sequence (T); auto: the model's block size (the preset's, --block-size or --init-from's; "
        f"--init-from's and hf:DIR's at most {INIT_FROM_AUTO_SEQ_LEN_CAP:,})",
        range=POSITIVE_INT_OR_AUTO,
    )
    token_budget: int = _opt(
        0,
        "valid target tokens per step; when set, K varies per step (the micro-batch that reaches the budget is "
        "included whole) and total_batch_tokens is not used; 0 disables it (K fixed by total_batch_tokens)",
        range=NON_NEGATIVE_INT,
    )
    last_window: str = _opt(
        "partial",
        "last incomplete window of a document epoch: partial (train on it, exactly normalized) or drop (skip it)",
        choices=LAST_WINDOW,
    )
    batch_ramp: str = _opt(
        "",
        "batch-size ramp-up START_TOKENS:RAMP_TOKENS (e.g. 32K:10M): tokens per step grow linearly in tokens seen "
        "from START to total_batch_tokens over the first RAMP_TOKENS, in whole micro-batches; auto: grow toward "
        "the measured gradient noise scale; from:RUN: follow the critical batch that bigbatch critical-batch --every "
        "measured along RUN; empty: no ramp",
    )
    max_batch_tokens: int = _opt(
        0,
        "--schedule seesaw: the most tokens per step the doublings reach (K grows; micro-batch memory stays); past "
        "it the learning rate decays as the schedule says; auto: 8 x total_batch_tokens (the three doublings a "
        "cosine decay to min_lr_ratio 0.1 asks for)",
        range=POSITIVE_INT_OR_AUTO,
    )
