"""The batch arithmetic: tokens per step = micro_batch x seq_len x K x world_size."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bigbatch.errors import PlanError
from bigbatch.settings.ranges import INT_LIMIT


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
    def tokens_per_k(self) -> int:
        """Tokens one more micro-batch on every process adds to a step (K -> K + 1)."""
        return self.micro_batch * self.seq_len * self.world_size

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


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def exact_micro_batches(total_tokens: int, seq_len: int, world_size: int) -> list[int]:
    """Micro-batch sizes, ascending, for which the total is a whole number of micro-batches on every rank
    (none when the total is not a whole number of sequences per rank)."""
    per_rank_sequences, remainder = divmod(total_tokens, seq_len * world_size)
    if remainder or per_rank_sequences == 0:
        return []
    return divisors(per_rank_sequences)


def suggest_micro_batches(total_tokens: int, seq_len: int, world_size: int, near: int, count: int = 4) -> list[int]:
    """Micro-batch sizes that divide the total exactly, closest to ``near`` first."""
    candidates = exact_micro_batches(total_tokens, seq_len, world_size)
    return sorted(sorted(candidates, key=lambda b: (abs(b - near), -b))[:count])


def plan_batch(total_tokens: int, micro_batch: int, seq_len: int, world_size: int = 1) -> BatchPlan:
    """Derive K from a token budget per optimizer step; raise :class:`PlanError` with suggestions if it does not
    divide."""
    _require_positive(total_batch_tokens=total_tokens, micro_batch=micro_batch, seq_len=seq_len, world_size=world_size)
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
    worlds = [w for w in range(1, 2 * world_size + 9) if total_tokens % (micro_batch * seq_len * w) == 0]
    if worlds and world_size > 1:  # a resumed run keeps its total: the number of processes can change instead
        message += f"; or keep both with {', '.join(map(str, worlds))} processes"
    raise PlanError(message)


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_count(text: str) -> int:
    """``524288``, ``524_288``, ``2M`` (2,000,000), ``512Ki`` (524,288), ``0.5Mi``; at most :data:`INT_LIMIT`."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    lowered = cleaned.lower()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if lowered.endswith(suffix):
            number = lowered[: -len(suffix)]
            try:
                value = float(number) * _SUFFIXES[suffix]
            except ValueError:
                break
            if not math.isfinite(value) or value != int(value) or value < 1:
                break
            return _within_limit(text, int(value))
    try:
        value = int(cleaned)
    except ValueError:
        raise PlanError(f"{text!r} is not a count; use e.g. 524288, 2M (2,000,000) or 512Ki (524,288)") from None
    if value < 1:
        raise PlanError(f"{text!r} must be positive")
    return _within_limit(text, value)


def _within_limit(text: str, value: int) -> int:
    if value > INT_LIMIT:
        raise PlanError(f"{text!r} is more than 2**62 ({INT_LIMIT:,}), the largest count bigbatch takes")
    return value


_SOLVED = {
    "micro_batch": ("micro-batch", "--micro-batch"),
    "accumulation_steps": ("K", "--k"),
    "world_size": ("devices", "--devices"),
}
"""Each quantity :func:`solve_plan` derives: its name in messages, and its ``bigbatch plan`` flag."""


def count_name(tokens: int) -> str:
    """``tokens`` as a count it can be typed as, when one is shorter: 2,097,152 is ``2Mi``, 2,000,000 ``2M``."""
    for suffix in ("Gi", "G", "Mi", "M", "Ki", "K"):
        unit = _SUFFIXES[suffix.lower()]
        if tokens % unit == 0 and tokens // unit < 1000:
            return f"{tokens:,} = {tokens // unit}{suffix}"
    return f"{tokens:,}"


def not_a_multiple(total_tokens: int, unit_tokens: int, solved_for: str) -> str:
    """Why ``total_tokens`` does not solve (it is no multiple of the ``unit_tokens`` each unit of ``solved_for``
    adds), naming the multiples on either side."""
    name = _SOLVED[solved_for][0]
    below, above = total_tokens // unit_tokens, total_tokens // unit_tokens + 1
    neighbours = [f"{count_name(above * unit_tokens)} ({name} {above})"]
    if below > 0:
        neighbours.insert(0, f"{count_name(below * unit_tokens)} ({name} {below})")
    return (
        f"--tokens-per-step {total_tokens:,} is not a multiple of the {unit_tokens:,} tokens each increment of "
        f"{name} adds, so {name} would not be whole; the nearest that are: {' or '.join(neighbours)}"
    )


def _flags(names: list[str]) -> str:
    return ", ".join(_SOLVED[name][1] for name in names)


@dataclass(frozen=True)
class SolvedPlan:
    plan: BatchPlan
    requested_tokens: int | None  # what was asked for, when the plan had to round
    solved_for: str  # "micro_batch", "accumulation_steps", "world_size" or "" (everything was given)

    @property
    def rounded(self) -> bool:
        return self.requested_tokens is not None and self.requested_tokens != self.plan.tokens_per_step


def solve_plan(
    seq_len: int,
    total_tokens: int | None = None,
    micro_batch: int | None = None,
    accumulation_steps: int | None = None,
    world_size: int | None = None,
    exact: bool = False,
) -> SolvedPlan:
    """Derive the missing one of micro_batch, K and world size (world defaults to 1 when two are missing).

    When the token budget is not a whole number of micro-batches on every device: with ``exact`` (a budget the
    user typed, as ``bigbatch plan --tokens-per-step`` and ``train`` take it) a :class:`PlanError` names both
    neighbours; without it (a measured noise scale, an estimate) the number of sequences is rounded to the
    nearest multiple that is (never to zero), and the plan reports the total it came to.
    """
    _require_positive(seq_len=seq_len)
    given = {"micro_batch": micro_batch, "accumulation_steps": accumulation_steps, "world_size": world_size}
    for name, value in given.items():
        if value is not None:
            _require_positive(**{name: value})
    if total_tokens is None:
        missing = [n for n, v in given.items() if v is None]
        if missing and missing != ["world_size"]:
            needed = [n for n in missing if n != "world_size"]  # devices default to 1
            raise PlanError(f"without --tokens-per-step, give --micro-batch and --k (missing: {_flags(needed)})")
        plan = BatchPlan(micro_batch, seq_len, accumulation_steps, world_size or 1)  # type: ignore[arg-type]
        return SolvedPlan(plan, None, "")
    _require_positive(total_batch_tokens=total_tokens)
    missing = [n for n, v in given.items() if v is None]
    if len(missing) >= 2 and "world_size" in missing:
        given["world_size"] = world_size = 1
        missing.remove("world_size")
    if len(missing) > 1:
        raise PlanError(
            f"give all but one of --micro-batch, --k and --devices (missing: {_flags(missing)}; devices default to 1)"
        )
    target = missing[0] if missing else "accumulation_steps"
    others = [int(v) for n, v in given.items() if n != target and v is not None]  # the two given quantities
    granularity = others[0] * others[1]  # sequences per unit of the solved quantity
    sequences = total_tokens / seq_len
    units = max(1, round(sequences / granularity))
    if exact and missing and units * granularity * seq_len != total_tokens:
        raise PlanError(not_a_multiple(total_tokens, granularity * seq_len, target))
    if missing:
        given[target] = units
    elif given[target] != units:
        raise PlanError(
            f"micro_batch x K x devices x seq_len = {micro_batch} x {accumulation_steps} x {world_size} x {seq_len} "
            f"= {micro_batch * accumulation_steps * world_size * seq_len:,} tokens, not {total_tokens:,}; "  # type: ignore[operator]
            "leave one of them out (--micro-batch, --k or --devices) to derive it"
        )
    plan = BatchPlan(given["micro_batch"], seq_len, given["accumulation_steps"], given["world_size"])  # type: ignore[arg-type]
    return SolvedPlan(plan, total_tokens, target if missing else "")
