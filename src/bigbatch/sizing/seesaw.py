"""``--schedule seesaw``: the batch doubles wherever the learning-rate schedule would halve the learning rate.

Seesaw (Meterez et al., 2025) trades a halving of the learning rate for a doubling of the batch, with the learning
rate moved by ``1/sqrt(2)`` instead. bigbatch reads the run's warmup + cosine schedule in *tokens*: step ``s`` of a
Seesaw run stands where ``e(s)`` steps of the starting size would (its tokens seen, in steps of
``total_batch_tokens``), and from the ``j``-th point at which ``schedule(e)`` falls to ``lr / 2**j`` the step is
``2**j`` times the starting one (``K`` doubles; the micro-batch, hence the memory, stays). The schedule gives
``schedule(e(s))``; the batch-change rule scales it (``sqrt``: by ``sqrt(2**j)``, so across each halving the
learning rate moves by ``1/sqrt(2)``; ``linear`` keeps it, as "increase the batch instead of decaying" did; ``none``
decays it as cosine would) and keeps beta2's half-life in tokens.

The run trains the tokens of ``max_steps`` steps of the starting size in fewer optimizer steps (its last step is
shortened to end exactly there). The doublings stop at ``--max-batch-tokens``; past it the learning rate decays
as the schedule says. K is a pure function of the step, so a resumed run takes the same sizes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from bigbatch.engine.optim import CosineSchedule
from bigbatch.errors import ConfigError


@dataclass(frozen=True)
class SeesawPhase:
    """Steps at one size: from 0-based step ``first_step``, ``k`` micro-batches per rank, the step's tokens
    ``multiple`` times the starting size's; ``first_equivalent`` starting-size steps of tokens before it."""

    first_step: int
    k: int
    multiple: int
    first_equivalent: int


class SeesawSchedule:
    """K and the schedule's learning rate of every step of a Seesaw run (see the module's doc)."""

    def __init__(self, schedule: CosineSchedule, base_k: int, max_k: int, max_steps: int) -> None:
        if max_k < base_k:
            raise ConfigError(
                f"--max-batch-tokens is below total_batch_tokens (K {max_k} < {base_k}): Seesaw only doubles the "
                "batch; raise --max-batch-tokens (auto: 8 x total_batch_tokens)"
            )
        self.base_k, self.max_k, self.max_steps = base_k, max_k, max_steps
        self.set_schedule(schedule)

    def set_schedule(self, schedule: CosineSchedule) -> None:
        """Lay the phases out for ``schedule`` (a resumed run's, which may have been extended)."""
        self.schedule = schedule
        self.doublings_allowed = (self.max_k // self.base_k).bit_length() - 1
        self.halvings = self._halvings()  # starting-size steps at which the schedule halves the learning rate
        phases, step, equivalent = [], 0, 0
        for j in range(len(self.halvings[: self.doublings_allowed]) + 1):
            multiple = 2**j
            phases.append(SeesawPhase(step, self.base_k * multiple, multiple, equivalent))
            end = self.halvings[j] if j < min(len(self.halvings), self.doublings_allowed) else self.max_steps
            end = min(end, self.max_steps)
            steps = max(0, -(-(end - equivalent) // multiple))
            step, equivalent = step + steps, equivalent + steps * multiple
            if equivalent >= self.max_steps:
                break
        self.phases = [p for p in phases if p.first_equivalent < self.max_steps]
        self.total_steps = step
        self._overshoot = equivalent - self.max_steps  # starting-size steps the last step is shortened by

    def _halvings(self) -> list[int]:
        """The first starting-size step at which the schedule is at most ``lr / 2**j``, for j = 1, 2, ... (within
        the run)."""
        schedule, found = self.schedule, []
        for j in range(1, 64):
            target = schedule.max_lr / 2**j
            if schedule(self.max_steps - 1) > target:
                break
            low, high = schedule.warmup_steps, self.max_steps - 1  # nonincreasing from the warmup's end on
            while low < high:
                middle = (low + high) // 2
                if schedule(middle) <= target:
                    high = middle
                else:
                    low = middle + 1
            found.append(low)
        return found

    def _phase(self, step: int) -> SeesawPhase:
        return self.phases[bisect.bisect_right([p.first_step for p in self.phases], step) - 1]

    def equivalent_step(self, step: int) -> int:
        """Starting-size steps of tokens before 0-based step ``step``."""
        phase = self._phase(step)
        return phase.first_equivalent + (step - phase.first_step) * phase.multiple

    def k(self, step: int) -> int:
        """K of 0-based step ``step`` (the last step holds only the tokens left to ``max_steps``)."""
        phase = self._phase(step)
        if step == self.total_steps - 1 and self._overshoot:
            return (self.max_steps - self.equivalent_step(step)) * self.base_k
        return phase.k

    def size_k(self, step: int) -> int:
        """K of the size step ``step`` belongs to, which the batch-change rule sets the optimizer for (the last step,
        shortened to the tokens left, is a partial step of its size, not another size)."""
        return self._phase(step).k

    def __call__(self, step: int) -> float:
        """The schedule's learning rate where step ``step`` stands in tokens (the batch-change rule scales it)."""
        return self.schedule(min(self.equivalent_step(step), self.max_steps - 1))

    def state_dict(self) -> dict[str, float | int]:
        return self.schedule.state_dict()

    def describe(self, unit: int) -> str:
        """E.g. ``K 4 -> 8 at step 54 -> 16 at step 74 | 690 steps for the tokens of 1,000``."""
        sizes = " -> ".join(
            f"{p.k * unit:,} tokens/step (K {p.k})" + (f" from step {p.first_step + 1:,}" if p.first_step else "")
            for p in self.phases
        )
        return (
            f"{sizes} | {self.total_steps:,} optimizer steps for the tokens of {self.max_steps:,} steps of "
            f"{self.base_k * unit:,} ({self.total_steps / self.max_steps:.2f}x the steps)"
        )

    def stop_note(self, unit: int, cap_flag: str = "--max-batch-tokens") -> str | None:
        """Where the doublings stop short of the schedule's halvings, or ``None`` when none is cut."""
        cut = self.halvings[self.doublings_allowed :]
        if not cut:
            return None
        last = self.phases[-1]
        at = sorted(set(cut))
        shown = ", ".join(f"{h * self.base_k * unit:,}" for h in at[:4]) + (", ..." if len(at) > 4 else "")
        return (
            f"seesaw stops doubling at {last.k * unit:,} tokens/step (K {last.k}, from step {last.first_step + 1:,}): "
            f"{cap_flag} {self.max_k * unit:,} holds no further doubling; the schedule's {len(cut)} later "
            f"halving{'s' if len(cut) > 1 else ''} (from {shown} tokens seen) decay the learning rate instead; raise "
            "the cap to double there too"
        )
