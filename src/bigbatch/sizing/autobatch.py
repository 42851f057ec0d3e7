"""``--micro-batch auto``: the largest micro-batch that fits, among those that keep tokens per step exact."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from bigbatch.engine.rng import preserved_rng
from bigbatch.errors import ConfigError
from bigbatch.models import ModelConfig
from bigbatch.sizing.memory import MiB, measure
from bigbatch.sizing.plan import exact_micro_batches

log = logging.getLogger(__name__)


def candidate_micro_batches(total_tokens: int, seq_len: int, world_size: int, limit: int = 1024) -> list[int]:
    """Micro-batch sizes, ascending, for which ``total`` is a whole number of micro-batches on every rank."""
    candidates = exact_micro_batches(total_tokens, seq_len, world_size)
    if not candidates:
        raise ConfigError(
            f"total_batch_tokens={total_tokens:,} is not a whole number of sequences on {world_size} device(s) "
            f"of seq_len {seq_len}; --micro-batch auto needs a total divisible by seq_len x world_size"
        )
    return [b for b in candidates if b <= limit]


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int:
    """Binary search for the largest candidate that fits (fitting is monotone in the size)."""
    lo, hi, best = 0, len(candidates) - 1, 0
    if not fits(candidates[0]):
        raise ConfigError(
            f"even micro_batch {candidates[0]} does not fit; lower --seq-len, use --activation-checkpointing, "
            "or raise --memory-budget"
        )
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return candidates[best]


@preserved_rng()  # a probe: the caller's generators are left as they were
def choose_micro_batch(
    config: ModelConfig,
    candidates: list[int],
    seq_len: int,
    k: int,
    device: torch.device,
    precision: str,
    memory_budget_mib: float,
    activation_checkpointing: bool = False,
    chunked_loss: bool = True,
) -> int:
    """CUDA: probe forward + backward + optimizer step and catch out-of-memory. CPU: measured peak (fixed part
    plus the whole step) against ``memory_budget_mib``."""
    if device.type != "cuda" and memory_budget_mib <= 0:
        raise ConfigError("--micro-batch auto on CPU needs --memory-budget MIB (the memory a step may use)")

    def fits(micro_batch: int) -> bool:
        try:
            m = measure(
                config,
                micro_batch,
                seq_len,
                k=min(k, 2),
                device=device,
                precision=precision,
                activation_checkpointing=activation_checkpointing,
                chunked_loss=chunked_loss,
            )
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            log.info("auto micro-batch: %d does not fit (out of memory)", micro_batch)
            return False
        total = (m.fixed + max(m.backward_peak, m.step_peak_k)) / MiB
        ok = device.type == "cuda" or total <= memory_budget_mib
        budget = f" of a {memory_budget_mib:,.0f} MiB budget" if device.type != "cuda" else ""
        log.info("auto micro-batch: %d needs %.0f MiB%s: %s", micro_batch, total, budget, "fits" if ok else "too big")
        return ok

    return largest_fitting(candidates, fits)
