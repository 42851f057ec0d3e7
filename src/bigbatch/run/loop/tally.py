"""What the training loop has seen so far: the last step, the throughput of the session's steps, skipped steps,
a stop, and where a documents run's positions went."""

from __future__ import annotations

from dataclasses import dataclass, field

from bigbatch.engine.accumulate import StepRecord
from bigbatch.engine.batch import EmptyStepGuard, StepBatch
from bigbatch.observe.metrics import Throughput


@dataclass
class LoopTally:
    """What the loop has seen so far."""

    record: StepRecord | None = None
    val_loss: float | None = None
    first: StepRecord | None = None  # the session's first applied step: it includes warm-up (and compilation)
    timed: Throughput | None = None  # the session's applied steps after the first: their tokens and seconds
    consecutive_skips: int = 0
    empty_steps: EmptyStepGuard = field(default_factory=EmptyStepGuard)
    stopped_by: int = 0
    positions: int = 0  # documents: positions of the steps trained (all ranks), and of them padding, masked prompts
    padding: int = 0
    prompt: int = 0

    def count_positions(self, step: StepBatch) -> None:
        """A documents step: where its positions went (padding, masked prompts, valid targets)."""
        self.positions += step.positions
        self.padding += step.padding
        self.prompt += step.positions - step.padding - step.n_valid

    def applied(self, record: StepRecord) -> None:
        """Count an applied step's tokens and time toward the throughput, unless it is the session's first."""
        if self.first is None:
            self.first = record
        elif self.timed is None:
            self.timed = Throughput(record.tokens, record.dt, record.step, record.step)
        else:
            t = self.timed
            self.timed = Throughput(t.tokens + record.tokens, t.seconds + record.dt, t.first_step, record.step)

    @property
    def throughput(self) -> Throughput | None:
        """Total tokens over total time of the session's steps after its first (a ratio of totals, not a mean of
        the steps' rates); a session of one step: that step's, said to include warm-up; none before a step."""
        if self.timed is not None:
            return self.timed
        first = self.first
        return None if first is None else Throughput(first.tokens, first.dt, first.step, first.step, warm_up=True)
