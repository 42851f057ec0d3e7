"""The rules of a critical-batch measurement, as pure functions: the sizes tried and the token budget, and which
size is critical (torch-free: the command line parses with them). A branch's optimizer settings follow the
batch-change rule (:mod:`bigbatch.engine.batch_change`)."""

from __future__ import annotations

import math

from bigbatch.errors import ConfigError, PlanError
from bigbatch.sizing.plan import BatchPlan, parse_count, plan_batch

DEFAULT_LOSS_TOLERANCE = 0.01
"""A branch is "as good" when its loss is at most 1% above the smallest size's."""


def parse_sizes(text: str) -> list[int]:
    """``64K,128K,256K`` -> ``[64000, 128000, 256000]`` (``Ki`` for powers of two): ascending, duplicates
    dropped, at least two sizes."""
    items = [item for item in text.split(",") if item.strip()]
    try:
        sizes = sorted({parse_count(item) for item in items})
    except PlanError as exc:
        raise ConfigError(f"--tokens-per-step: {exc}") from None
    if len(sizes) < 2:
        raise ConfigError(
            f"--tokens-per-step {text!r}: give at least two different sizes, comma-separated (e.g. 16Ki,32Ki,64Ki)"
        )
    return sizes


def check_budget(budget: int, sizes: list[int]) -> None:
    """The budget must hold at least one step of the largest size and a whole number of steps of every size
    (so that every branch stops after exactly ``budget`` tokens)."""
    largest = max(sizes)
    if budget < largest:
        raise ConfigError(
            f"--budget {budget:,} tokens is smaller than one step of the largest size ({largest:,} tokens); "
            f"use --budget {largest:,} or more (a few steps of the largest size give a clearer answer)"
        )
    unit = math.lcm(*sizes)
    if budget % unit:
        lower, upper = budget // unit * unit, (budget // unit + 1) * unit
        nearest = " or ".join(f"{b:,}" for b in (lower, upper) if b >= largest)
        raise ConfigError(
            f"--budget {budget:,} is not a whole number of steps at every size (each of "
            f"{', '.join(f'{s:,}' for s in sizes)} must divide it, so every branch stops after the same tokens); "
            f"nearest budgets that do: {nearest}"
        )


def plan_sizes(sizes: list[int], micro_batch: int, seq_len: int) -> list[BatchPlan]:
    """Each size as whole micro-batches of ``micro_batch x seq_len`` in one process; one that is not says which
    sizes near it are."""
    plans = []
    for size in sizes:
        try:
            plans.append(plan_batch(size, micro_batch, seq_len, world_size=1))
        except PlanError as exc:
            raise PlanError(f"--tokens-per-step {size:,}: {exc}{_binary_hint(size, micro_batch, seq_len)}") from None
    return plans


def _binary_hint(size: int, micro_batch: int, seq_len: int) -> str:
    """For ``64K`` (64,000) where ``64Ki`` (65,536) would do: say that K means 1,000."""
    for unit, decimal, binary in (("M", 10**6, 2**20), ("K", 10**3, 2**10)):
        if size % decimal == 0 and (size // decimal * binary) % (micro_batch * seq_len) == 0:
            exact = size // decimal * binary
            return f" (K and M mean 1,000 and 1,000,000: for {exact:,} write {size // decimal}{unit}i)"
    return ""


def critical_batch_size(sizes: list[int], losses: list[float], tolerance: float) -> tuple[int, list[bool]]:
    """The largest size whose loss, and that of every smaller size, is at most ``(1 + tolerance)`` times the
    smallest size's; and, per size, whether its own loss is within that limit. ``sizes`` ascend."""
    limit = losses[0] + tolerance * abs(losses[0])
    within = [loss <= limit for loss in losses]
    critical = sizes[0]
    for size, ok in zip(sizes, within, strict=True):
        if not ok:
            break
        critical = size
    return critical, within
