"""What the training loop has seen so far: the last step, the throughput of the session's steps, skipped steps,
a stop, and where a documents run's positions went."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bigbatch.engine.accumulate import StepRecord
from bigbatch.engine.batch import EmptyStepGuard, MicroBatch, StepBatch
from bigbatch.engine.step_guard import ACTIONS
from bigbatch.observe.metrics import Throughput
from bigbatch.parallel.distributed import DistContext


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
    saved_positions: tuple[int, int, int, int] = (0, 0, 0, 0)  # (step, positions, padding, prompt) at the last save

    def count_positions(self, trained: StepBatch) -> None:
        """A documents step's trained part (:func:`trained_part`): where its positions went (padding, masked
        prompts, valid targets)."""
        self.positions += trained.positions
        self.padding += trained.padding
        self.prompt += trained.positions - trained.padding - trained.n_valid

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was saved: a rewind to it undoes the positions counted after it."""
        self.saved_positions = (step, self.positions, self.padding, self.prompt)

    def rewound(self, step: int) -> None:
        """A rewind went back to the checkpoint of ``step``: the steps after it were not trained after all (this
        session's count restarts when the checkpoint is older than the session's last save)."""
        at, positions, padding, prompt = self.saved_positions
        self.positions, self.padding, self.prompt = (positions, padding, prompt) if at == step else (0, 0, 0)

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


def trained_part(
    step: StepBatch, record: StepRecord, excluded: set[str], dist: DistContext, device: torch.device
) -> StepBatch:
    """The part of an applied documents ``step`` that was trained: without the micro-batches a bad step dropped
    (``skip-micro``: its suspects, named by rank and index as read) or a rewind's exclusions left out (``excluded``:
    the guard's keys), its positions and padding summed over ranks. Every rank calls it: the one all-reduce runs
    only on a step where something may have been left out, which every rank knows alike."""
    bad = record.bad
    dropped_any = bad is not None and bad.action == ACTIONS["skip-micro"]
    if not dropped_any and not excluded:
        return step
    mine = {s.micro for s in bad.suspects if s.rank == dist.rank} if bad is not None and dropped_any else set()
    kept = [b for i, b in enumerate(step.micro_batches) if i not in mine and not _left_out(b, excluded)]
    positions, padding = dist.sum_ints([sum(b.inputs.numel() for b in kept), sum(b.padding for b in kept)], device)
    return StepBatch(kept, record.tokens, positions, padding)  # the record's tokens: the valid targets trained


def _left_out(batch: MicroBatch, excluded: set[str]) -> bool:
    """Whether a rewind's exclusions name ``batch``, as the guard decides it (its key, or a document it holds)."""
    if not excluded:
        return False
    check = getattr(batch, "excluded_by", None)
    return bool(check(excluded)) if check is not None else batch.origin_key in excluded
