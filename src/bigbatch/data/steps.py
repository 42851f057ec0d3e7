"""Which micro-batches make up one optimizer step.

Two ways to size a step:

* fixed K (``step_micro_batches``): K micro-batches per rank;
* a token budget (``budget_micro_batches``): micro-batches are taken until the
  valid target tokens of the step (all ranks) reach the budget. **Remainder
  rule:** the micro-batch that reaches or crosses the budget is included whole,
  so a step holds at least ``budget`` valid targets and overshoots by less than
  one global micro-batch; nothing is carried into the next step. K varies.

Either way the engine normalizes by the exact valid count of the step.

The **last window of an epoch** of a document dataset (fewer documents left than
one step needs) follows ``last_window``: ``partial`` (default) trains on what is
there, with a smaller K and exact normalization; ``drop`` skips it and starts
the next epoch. A packed token stream is endless (it wraps at micro-batch
granularity), so with fixed K the policy does not apply to it; with a token
budget it applies at the stream's wrap point.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bigbatch.accumulate import count_valid_targets
from bigbatch.data.loader import DocumentLoader, MicroBatch, PackedLoader
from bigbatch.errors import ConfigError, DataError

LAST_WINDOW_POLICIES = ("partial", "drop")

Loader = PackedLoader | DocumentLoader


def check_policy(last_window: str) -> None:
    if last_window not in LAST_WINDOW_POLICIES:
        raise ConfigError(f"last_window must be one of {', '.join(LAST_WINDOW_POLICIES)}, got {last_window!r}")


def step_micro_batches(loader: Loader, k: int, last_window: str = "partial") -> list[MicroBatch]:
    """K micro-batches, or fewer for the last window of a document epoch under ``partial``."""
    check_policy(last_window)
    if isinstance(loader, DocumentLoader):
        needed = k * loader.global_window
        if loader.docs_left() < needed:
            if last_window == "drop":
                if loader.n_sequences < needed:
                    raise DataError(
                        f"the data holds {loader.n_sequences} sequences, fewer than one step of {needed} "
                        "(K x micro_batch x world_size); use last_window = partial or a smaller batch"
                    )
                loader.skip_rest_of_epoch()
            else:
                k = math.ceil(loader.docs_left() / loader.global_window)
    return [loader.next_micro_batch() for _ in range(k)]


def budget_micro_batches(
    loader: Loader,
    budget: int,
    last_window: str = "partial",
    count_global: Callable[[MicroBatch], int] = count_valid_targets,
) -> list[MicroBatch]:
    """Micro-batches until the step's valid targets reach ``budget`` (see the module docstring)."""
    check_policy(last_window)
    if budget < 1:
        raise ConfigError(f"token_budget must be positive, got {budget}")
    batches: list[MicroBatch] = []
    total = 0
    epoch = loader.epoch
    wraps = 0
    while total < budget:
        batch = loader.next_micro_batch()
        batches.append(batch)
        total += count_global(batch)
        if loader.epoch != epoch:  # this micro-batch ended an epoch
            epoch = loader.epoch
            wraps += 1
            if total >= budget:
                break
            if last_window == "partial" and total > 0:
                break
            if wraps > 1:
                raise DataError(
                    f"token_budget={budget:,} is more than the valid targets of the whole training data; "
                    "lower --token-budget or add data"
                )
            batches, total = [], 0  # drop: the epoch's incomplete remainder is skipped
    return batches
