"""The batch arithmetic: tokens per step = micro_batch x seq_len x K x world_size."""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.errors import PlanError


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is split into micro-batches."""

    micro_batch: int  # B: sequences per micro-batch per device
    seq_len: int  # T: tokens per sequence
    accumulation_steps: int  # K: micro-batches per device per optimizer step
    world_size: int = 1

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.accumulation_steps * self.world_size

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch * self.accumulation_steps * self.world_size

    def describe(self) -> str:
        return (
            f"micro_batch {self.micro_batch} x seq_len {self.seq_len} x K {self.accumulation_steps} "
            f"x world {self.world_size} = {self.tokens_per_step:,} tokens/step"
        )


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def suggest_micro_batches(total_tokens: int, seq_len: int, world_size: int, near: int, count: int = 4) -> list[int]:
    """Micro-batch sizes that divide the total exactly, closest to ``near`` first."""
    per_rank_sequences, remainder = divmod(total_tokens, seq_len * world_size)
    if remainder or per_rank_sequences == 0:
        return []
    candidates = _divisors(per_rank_sequences)
    return sorted(sorted(candidates, key=lambda b: (abs(b - near), -b))[:count])


def plan_batch(total_tokens: int, micro_batch: int, seq_len: int, world_size: int = 1) -> BatchPlan:
    """Derive K from a token budget per optimizer step; raise :class:`PlanError` with suggestions if it does not divide."""
    _require_positive(
        total_batch_tokens=total_tokens, micro_batch=micro_batch, seq_len=seq_len, world_size=world_size
    )
    window = micro_batch * seq_len * world_size
    k, remainder = divmod(total_tokens, window)
    if remainder == 0:
        return BatchPlan(micro_batch, seq_len, k, world_size)

    lower = k * window
    upper = (k + 1) * window
    totals = [f"{upper:,} (K={k + 1})"]
    if lower > 0:
        totals.insert(0, f"{lower:,} (K={k})")
    message = (
        f"total_batch_tokens={total_tokens:,} is not a multiple of micro_batch x seq_len x world_size "
        f"= {micro_batch} x {seq_len} x {world_size} = {window:,}; nearest valid totals: {' or '.join(totals)}"
    )
    micro_batches = suggest_micro_batches(total_tokens, seq_len, world_size, near=micro_batch)
    if micro_batches:
        message += f"; or keep the total with micro_batch in {{{', '.join(map(str, micro_batches))}}}"
    raise PlanError(message)
