"""Batch-size ramp-up: a schedule of K, from a small step to the configured tokens per step.

``--batch-ramp START_TOKENS:RAMP_TOKENS`` (``batch_ramp = "32K:10M"`` in ``[batch]``): over the first
``RAMP_TOKENS`` tokens seen, the tokens per step grow linearly in the tokens seen, from ``START_TOKENS`` to the
configured ``total_batch_tokens``, in whole micro-batches per rank::

    wanted(seen) = START + (TARGET - START) x seen / RAMP        (TARGET once seen >= RAMP)
    K(seen)      = floor(wanted(seen) / (micro_batch x seq_len x world)), between 1 and the target K

``seen`` is the run's tokens seen (valid targets trained on, all ranks; saved in every checkpoint), so K is a
pure function of where the run stands: a resumed run takes the same K at the same step, and a step whose
gradient was not finite (not applied) leaves it as it was. Each step is normalized by its own valid targets
(the engine's rule), so every step is exact at its own size.

``--batch-ramp from:RUN`` follows the critical batch that ``bigbatch critical-batch RUN --every N`` measured along
another run: at ``seen`` tokens, the size measured at the latest point at or before ``seen`` (the first point's
before it), never shrinking, capped by ``total_batch_tokens``, in whole micro-batches; the curve is saved with the
run, so a resume follows the same one.

``--batch-ramp auto`` starts at two micro-batches per rank (the least that measures the gradient noise scale)
and, after each step that measures it, grows the tokens per step toward the smoothed noise scale: whole
micro-batches, never shrinking, at most doubling per change, capped by ``total_batch_tokens``; each change is
logged, and the size reached is part of the run's state.

The learning-rate schedule is not changed by a ramp: it counts optimizer steps (warmup over ``warmup_steps``
updates, cosine decay ending at ``decay_steps`` or ``max_steps``), whatever each step's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from bigbatch.errors import BigBatchError, CheckpointError, ConfigError
from bigbatch.settings.ranges import AUTO
from bigbatch.sizing.critical_curve import read_over_run
from bigbatch.sizing.plan import BatchPlan, parse_count

FLAG = "--batch-ramp (batch.batch_ramp)"
FROM = "from:"


@dataclass(frozen=True)
class RampSpec:
    """A parsed ``--batch-ramp``: ``START:RAMP`` tokens, ``auto``, or ``from:RUN`` (``source``)."""

    start_tokens: int = 0
    ramp_tokens: int = 0
    auto: bool = False
    source: str = ""

    def __str__(self) -> str:
        if self.source:
            return f"{FROM}{self.source}"
        return AUTO if self.auto else f"{self.start_tokens:,}:{self.ramp_tokens:,}"


def parse_ramp(text: str) -> RampSpec | None:
    """``""`` (no ramp), ``auto`` or ``START_TOKENS:RAMP_TOKENS`` with counts like ``32768``, ``32K``, ``1Mi``."""
    text = str(text).strip()
    if not text:
        return None
    if text.lower() == AUTO:
        return RampSpec(auto=True)
    if text.startswith(FROM):
        if not text[len(FROM) :].strip():
            raise ConfigError(f"{FLAG} from:RUN needs the run directory (or its over-run-RULE.json), got {text!r}")
        return RampSpec(source=text[len(FROM) :].strip())
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise ConfigError(f"{FLAG} must be START_TOKENS:RAMP_TOKENS (e.g. 32K:10M) or auto, got {text!r}")
    counts = []
    for name, part in zip(("START_TOKENS", "RAMP_TOKENS"), parts, strict=True):
        try:
            counts.append(parse_count(part))
        except BigBatchError as exc:
            raise ConfigError(f"{FLAG} {text!r}: {name} {exc}") from None
    return RampSpec(counts[0], counts[1])


def check_ramp_settings(batch_ramp: str, total_batch_tokens: int, token_budget: int) -> RampSpec | None:
    """What can be checked from the config alone: the syntax, START within the target, no token budget."""
    spec = parse_ramp(batch_ramp)
    if spec is None:
        return None
    if token_budget:
        raise ConfigError(
            f"{FLAG} sizes steps by K and --token-budget by valid targets; use one of them (a ramp grows "
            "toward total_batch_tokens)"
        )
    if not spec.auto and not spec.source and spec.start_tokens > total_batch_tokens:
        raise ConfigError(
            f"{FLAG}: START_TOKENS {spec.start_tokens:,} is above the tokens per step {total_batch_tokens:,} "
            "(total_batch_tokens) that the ramp grows toward; lower START_TOKENS or raise --total-batch-tokens"
        )
    return spec


@dataclass(frozen=True)
class RampRow:
    """One row of the ramp table: the first step at ``k``, its tokens, the tokens seen after it."""

    step: int
    k: int
    tokens_per_step: int
    cumulative_tokens: int


class RampGrowth(NamedTuple):
    """A change of K made by ``--batch-ramp auto``."""

    k_before: int
    k_after: int


@dataclass
class BatchRamp:
    """K per step for a run whose plan is ``plan`` (its K is the target, reached at the end of the ramp)."""

    spec: RampSpec
    plan: BatchPlan
    auto_tokens: int = field(default=0)  # auto: the tokens per step reached so far (never shrinks)
    curve: list[tuple[int, int]] = field(default_factory=list)  # from:RUN: (tokens seen, tokens per step), rising

    def __post_init__(self) -> None:
        unit, p = self.unit, self.plan
        if self.spec.source and not self.curve:
            self.curve = critical_batch_curve(self.spec.source)
        if not self.spec.auto and not self.spec.source and self.spec.start_tokens < unit:
            per_world = f" x world {p.world_size}" if p.world_size > 1 else ""
            raise ConfigError(
                f"{FLAG}: START_TOKENS {self.spec.start_tokens:,} is below one micro-batch per process "
                f"(micro_batch {p.micro_batch} x seq_len {p.seq_len}{per_world} = {unit:,} tokens); raise "
                f"START_TOKENS to at least {unit:,} (K is 1,000, Ki 1,024) or lower --micro-batch"
            )
        if self.spec.auto and not self.auto_tokens:
            self.auto_tokens = self.start_k * unit

    @property
    def unit(self) -> int:
        """Tokens that one more micro-batch per rank adds to a step."""
        return self.plan.tokens_per_k

    @property
    def k_max(self) -> int:
        return self.plan.accumulation_steps

    @property
    def start_k(self) -> int:
        if self.spec.auto:
            return min(2, self.k_max)  # the least K that measures the noise scale
        if self.spec.source:
            return self.k(0)
        return min(self.spec.start_tokens // self.unit, self.k_max)

    def k(self, tokens_seen: int) -> int:
        """K (micro-batches per rank) of the next step of a run that has seen ``tokens_seen`` tokens."""
        if self.spec.auto:
            return max(1, min(self.auto_tokens // self.unit, self.k_max))
        if self.spec.source:
            wanted = self.curve[0][1]
            for seen, tokens in self.curve:
                if seen > tokens_seen:
                    break
                wanted = tokens
            return max(1, min(wanted // self.unit, self.k_max))
        start, ramp, target = self.spec.start_tokens, self.spec.ramp_tokens, self.plan.tokens_per_step
        if tokens_seen >= ramp:
            return self.k_max
        wanted_times_ramp = start * ramp + (target - start) * tokens_seen  # integers: no rounding drift
        return max(1, min(wanted_times_ramp // (ramp * self.unit), self.k_max))

    # -- auto ---------------------------------------------------------------------------------------------

    def grow(self, noise_scale: float | None) -> RampGrowth | None:
        """Auto: after a step that measured ``noise_scale`` (tokens), grow toward it; K before and after when K
        changes. Whole micro-batches, never shrinking, at most doubling, capped by the target."""
        if not self.spec.auto or noise_scale is None or not math.isfinite(noise_scale) or noise_scale <= 0:
            return None
        before = self.k(0)
        wanted = round(noise_scale / self.unit)
        after = min(max(wanted, before), 2 * before, self.k_max)
        if after == before:
            return None
        self.auto_tokens = after * self.unit
        return RampGrowth(before, after)

    def state_dict(self) -> dict[str, Any]:
        return {"spec": str(self.spec), "auto_tokens": self.auto_tokens, "curve": [list(p) for p in self.curve]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Auto: the tokens per step reached (a micro-batch or world size changed on resume keeps them, in
        whole micro-batches of the new size). A fixed ramp needs nothing: its K follows from the tokens seen."""
        if self.spec.auto and state.get("spec") == AUTO and int(state.get("auto_tokens", 0)) > 0:
            self.auto_tokens = max(int(state["auto_tokens"]), self.start_k * self.unit)
        if self.spec.source and state.get("spec") == str(self.spec) and state.get("curve"):
            self.curve = [(int(seen), int(tokens)) for seen, tokens in state["curve"]]  # the curve it started with

    # -- description --------------------------------------------------------------------------------------

    def describe(self) -> str:
        target = self.plan.tokens_per_step
        if self.spec.source:
            sizes = " -> ".join(f"{k * self.unit:,}" for k in sorted({self.k(seen) for seen, _ in self.curve}))
            return (
                f"from {self.spec.source}: the critical batch measured along it ({len(self.curve)} points, "
                f"{self.curve[0][0]:,} to {self.curve[-1][0]:,} tokens seen): {sizes} tokens/step, whole "
                f"micro-batches of {self.unit:,} tokens, never shrinking, up to K {self.k_max} ({target:,} tokens/step)"
            )
        if self.spec.auto:
            return (
                f"auto: from K {self.start_k} ({self.start_k * self.unit:,} tokens/step) toward the measured noise "
                f"scale, whole micro-batches of {self.unit:,} tokens, never shrinking, at most doubling per change, "
                f"up to K {self.k_max} ({target:,} tokens/step)"
            )
        return (
            f"{self.spec.start_tokens:,} -> {target:,} tokens/step over the first {self.spec.ramp_tokens:,} tokens "
            f"seen (K {self.start_k} -> {self.k_max}, whole micro-batches of {self.unit:,} tokens; the learning-rate "
            "schedule counts optimizer steps)"
        )

    def table(self) -> list[RampRow]:
        """The first step at each K, for full micro-batches (packed data), until the ramp reaches the target; from:RUN:
        the tokens seen (in ``cumulative_tokens``) at which each K starts."""
        if self.spec.auto:
            return []
        rows: list[RampRow] = []
        if self.spec.source:  # the tokens seen at which each K starts (steps depend on the data)
            for seen, _ in self.curve:
                k = self.k(seen)
                if not rows or k != rows[-1].k:
                    rows.append(RampRow(0, k, k * self.unit, seen))
            return rows
        step, seen = 1, 0
        while True:
            k = self.k(seen)
            tokens = k * self.unit
            rows.append(RampRow(step, k, tokens, seen + tokens))
            if k >= self.k_max:
                return rows
            # the first tokens-seen at which K grows: start*ramp + (target-start)*s >= (k+1)*unit*ramp
            start, ramp, target = self.spec.start_tokens, self.spec.ramp_tokens, self.plan.tokens_per_step
            threshold = min(ramp, -(-((k + 1) * self.unit * ramp - start * ramp) // (target - start)))
            steps_at_k = max(1, -(-(threshold - seen) // tokens))
            step += steps_at_k
            seen += steps_at_k * tokens


def format_ramp_table(ramp: BatchRamp, max_rows: int = 24) -> str:
    """``bigbatch plan --batch-ramp``: one row per change of K (thinned to about ``max_rows``), then a summary."""
    lines = [f"batch ramp: {ramp.describe()}"]
    rows = ramp.table()
    if not rows:
        return "\n".join(lines)
    if ramp.spec.source:  # sized by tokens seen, which steps of documents reach at their own pace
        lines.append(f"{'from tokens seen':>17}  {'K':>5}  {'tokens/step':>13}")
        lines += [f"{r.cumulative_tokens:>17,}  {r.k:>5}  {r.tokens_per_step:>13,}" for r in rows]
        return "\n".join(lines)
    shown = rows
    if len(rows) > max_rows:
        every = math.ceil((len(rows) - 1) / (max_rows - 1))
        shown = rows[:-1:every] + [rows[-1]]
        lines.append(f"(every {every}th change of K shown)")
    lines.append(f"{'step':>8}  {'K':>5}  {'tokens/step':>13}  {'cumulative tokens':>17}")
    lines += [f"{r.step:>8,}  {r.k:>5}  {r.tokens_per_step:>13,}  {r.cumulative_tokens:>17,}" for r in shown]
    last = rows[-1]
    ramp_tokens = last.cumulative_tokens - last.tokens_per_step
    fixed_steps = math.ceil(ramp_tokens / ramp.plan.tokens_per_step)
    lines.append(
        f"the ramp reaches K {ramp.k_max} at step {last.step:,}, after {ramp_tokens:,} tokens "
        f"({last.step - 1:,} ramp steps; at the full size those tokens take {fixed_steps:,}); "
        "packed data (documents count valid targets, so their ramp takes more steps)"
    )
    return "\n".join(lines)


def check_ramp_change(saved_config: dict[str, Any], batch_ramp: str, allow: bool, run_dir: object) -> str | None:
    """Refuse a resume whose ramp differs from the run's unless ``allow`` (``--allow-ramp-change``); with it, the
    note to log. Ramps are compared as parsed (``32K:1M`` is ``32000:1000000``)."""
    before_text = str(saved_config.get("batch", {}).get("batch_ramp", ""))
    before, now = _spec_or_text(before_text), parse_ramp(batch_ramp)
    if before == now:
        return None
    change = f"batch.batch_ramp {_show(before)} -> {_show(now)}"
    if not allow:
        raise CheckpointError(
            f"the run in {run_dir} has another batch ramp ({change}); add --allow-ramp-change to apply the new "
            "one from the next step, or keep the run's --batch-ramp"
        )
    return f"--allow-ramp-change: {change} from the next step on"


def _spec_or_text(text: str) -> RampSpec | str | None:
    try:
        return parse_ramp(text)
    except ConfigError:
        return text  # a value this bigbatch cannot read differs from any it can


def _show(spec: RampSpec | str | None) -> str:
    return "none" if spec is None else repr(str(spec))


def critical_batch_curve(source: str) -> list[tuple[int, int]]:
    """``(tokens seen, tokens per step)`` of a critical batch measured over a run (``critical-batch --every``),
    each size at least the one before (the measured lower end of each bracket, never shrinking)."""
    points = sorted(read_over_run(Path(source)).points, key=lambda p: p.tokens_seen)
    curve, largest = [], 0
    for point in points:
        largest = max(largest, point.low)
        curve.append((point.tokens_seen, largest))
    return curve
