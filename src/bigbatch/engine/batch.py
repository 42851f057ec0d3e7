"""The batch: micro-batches, their valid targets, and the optimizer step they make up.

Everything that moves tokens into the engine meets here; the data room builds these
types and the engine consumes them (this module needs only torch, the errors and choices, the
distributed context, and the loss's :data:`~bigbatch.models.head_loss.IGNORE_INDEX`):

* :class:`MicroBatch`, ``(B, T)`` inputs and targets, with :data:`IGNORE_INDEX`
  (-100) marking targets without loss;
* :func:`count_valid_targets` and :func:`global_valid_targets`: the one
  definition of "valid targets of a step" (``N_step``: every micro-batch on
  every rank), by which the engine normalizes;
* :func:`read_step`: the next step assembled from a micro-batch source, a
  :class:`StepPolicy` and the :class:`~bigbatch.parallel.distributed.DistContext`,
  counting and reducing ``N_step`` exactly once.

Two ways to size a step:

* fixed K: K micro-batches per rank;
* a token budget: micro-batches are taken until the valid targets of the step
  (all ranks) reach the budget. **Remainder rule:** the micro-batch that reaches
  or crosses the budget is included whole, so a step holds at least ``budget``
  valid targets and overshoots by less than one global micro-batch; nothing is
  carried into the next step. K varies.

The **last window of an epoch** of a document split (fewer sequences left than
one step needs) follows ``last_window``: ``partial`` (default) trains on what is
there, with a smaller K and exact normalization; ``drop`` skips it and starts
the next epoch. A token stream is endless (it wraps at micro-batch
granularity), so with fixed K the policy does not apply to it; with a token
budget it applies at the stream's wrap point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from bigbatch.errors import ConfigError, DataError
from bigbatch.models.head_loss import IGNORE_INDEX  # the loss's convention; batches follow it (and re-export it)
from bigbatch.parallel.distributed import DistContext
from bigbatch.progress import plural
from bigbatch.settings.choices import LAST_WINDOW


class DocumentPart(NamedTuple):
    """Where one document's tokens sit in a micro-batch, and which part of the document they are: what lets a bad
    step follow a bad document to every micro-batch that holds a part of it. A document longer than a sequence is
    read as ``windows`` windows of ``seq_len`` targets, window ``w`` starting at token ``start + w x seq_len`` of
    its shard (:func:`window_starts`); each window lands in one row (unpacked: a row of its own; packed: beside
    other documents), perhaps in another micro-batch, rank or step than its other windows."""

    shard: int
    start: int  # the document's first token in its shard: its identity
    window: int  # which of its windows this is (0: its first)
    windows: int  # how many windows it is read as (1: all of it is here)
    row: int
    column: int  # its first position in the row
    length: int  # positions it fills, each with a target (a masked prompt token's is -100)

    @property
    def key(self) -> str:
        """The document's identity in the data, in every epoch: what a rewind's exclusion of it names."""
        return document_key(self.shard, self.start)


DOCUMENT_PREFIX = "doc:"


def document_key(shard: int, start: int) -> str:
    """``doc:0@1024``: a document by its shard and first token (a micro-batch's key has no ``doc:`` prefix)."""
    return f"{DOCUMENT_PREFIX}{shard}@{start}"


def window_starts(start: int, windows: int, seq_len: int) -> list[int]:
    """Where each window of a document read as ``windows`` windows of ``seq_len`` targets starts in its shard (the
    documents loader's split of a long document)."""
    return [start + w * seq_len for w in range(windows)]


ROLE_CHOSEN, ROLE_REJECTED, ROLE_DESIRABLE, ROLE_UNDESIRABLE, ROLE_KL, ROLE_COMPLETION = 0, 1, 2, 3, 4, 5
"""What an answer is to the objective: a preference pair's chosen and rejected answers; a KTO row's completion,
desirable or undesirable; a KTO row's prompt followed by another row's completion (``ROLE_KL``: only its
reference point, the step's KL estimate, is read from it, never trained); and a sampled completion of a prompt
(``ROLE_COMPLETION``: learning from rewards, scored by :class:`RolloutScores`)."""


@dataclass
class RolloutScores:
    """What learning from rewards knows of each completion of a micro-batch (its answers, numbered as in
    :class:`Answers`) before the step trains on it: facts of the whole rollout, the same on every rank, so a
    completion carries them wherever it lands. ``old_logp`` and ``ref_logp`` are per target, like ``segment``:
    the behaviour policy's and the reference's log-probability of each completion token (0 elsewhere)."""

    advantage: torch.Tensor  # (S,) float32: the completion's advantage (group-relative, or given)
    reward: torch.Tensor  # (S,) float32
    member: torch.Tensor  # (S,) int64: its place in its group (0: the group's first, which counts the group)
    group_tokens: torch.Tensor  # (S,) float32: the tokens of all completions of its group in the step
    old_logp: torch.Tensor | None = None  # (B, T) float32
    ref_logp: torch.Tensor | None = None  # (B, T) float32

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RolloutScores:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return RolloutScores(
            self.advantage.to(device, non_blocking=non_blocking),
            self.reward.to(device, non_blocking=non_blocking),
            self.member.to(device, non_blocking=non_blocking),
            self.group_tokens.to(device, non_blocking=non_blocking),
            move(self.old_logp),
            move(self.ref_logp),
        )

    def pin_memory(self) -> RolloutScores:
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return RolloutScores(
            self.advantage.pin_memory(),
            self.reward.pin_memory(),
            self.member.pin_memory(),
            self.group_tokens.pin_memory(),
            pin(self.old_logp),
            pin(self.ref_logp),
        )


@dataclass
class Answers:
    """Where the answers of an objective over answers (preference pairs, KTO rows) sit in a micro-batch. An answer
    is the trained span of one document (its targets that are not -100); a *group* is a pair (its chosen and
    rejected answers, in that order) or a KTO row (its completion, then its KL answer), and a group is never split
    between micro-batches or ranks. ``segment`` says for each target which answer it belongs to; answers are
    numbered within the micro-batch."""

    segment: torch.Tensor  # (B, T) int64: the answer whose target this is, -1 for none (prompt, padding)
    group: torch.Tensor  # (S,) int64: each answer's group, numbered 0.. within the micro-batch
    role: torch.Tensor  # (S,) int64: ROLE_* of each answer
    # Each answer's document, numbered in its split (``source`` names the split's reader): what a table of
    # reference log-probabilities computed once is keyed by. None: answers made up in place (tests, the verifier).
    document: torch.Tensor | None = None  # (S,) int64
    source: str = ""
    # Each answer's -log ref(answer | prompt) (S,) fp32, set by the step's statistics pass on the micro-batch as read:
    # it travels with the micro-batch, so a re-run of it anywhere (a replay on another rank) reads its own.
    reference: torch.Tensor | None = None
    rollout: RolloutScores | None = None  # sampled completions (learning from rewards): what each one scored

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Answers:
        return Answers(
            self.segment.to(device, non_blocking=non_blocking),
            self.group.to(device, non_blocking=non_blocking),
            self.role.to(device, non_blocking=non_blocking),
            self.document,  # an index into a table on the host: stays there
            self.source,
            None if self.reference is None else self.reference.to(device, non_blocking=non_blocking),
            None if self.rollout is None else self.rollout.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Answers:
        return Answers(
            self.segment.pin_memory(),
            self.group.pin_memory(),
            self.role.pin_memory(),
            self.document,
            self.source,
            self.reference,
            None if self.rollout is None else self.rollout.pin_memory(),
        )

    def none(self) -> Answers:
        """The same shapes holding no answer (a filler micro-batch's)."""
        rollout = None
        if self.rollout is not None:
            r = self.rollout
            zeros = torch.zeros_like(self.segment, dtype=torch.float32)
            rollout = RolloutScores(
                r.advantage[:0],
                r.reward[:0],
                r.member[:0],
                r.group_tokens[:0],
                None if r.old_logp is None else zeros,
                None if r.ref_logp is None else zeros.clone(),
            )
        empty = torch.full_like(self.segment, -1)
        return Answers(empty, self.group[:0], self.role[:0], None, self.source, rollout=rollout)

    @property
    def count(self) -> int:
        return int(self.role.numel())


@dataclass
class MicroBatch:
    """One micro-batch: ``targets`` are ``inputs`` shifted by one token; ``-100`` marks no loss.

    ``positions`` (packed documents only) is each input token's position within its own document, 0 at every
    document's first token: a row holds several documents back to back, attention stays within each (a new
    document begins wherever the position is 0) and learned or rotary positions restart with it. The padding at a
    row's end is a segment of its own, also counted from 0, whose targets are all ``-100``. ``None``: one sequence
    per row, positions ``0..T-1``. ``padding`` counts the positions of this micro-batch that hold no document
    token (only metrics read it). ``origin`` says where its tokens come from, for a bad step's attribution and
    its exclusion: ``(shard, token offset)`` of each document (a token stream: of each window) it holds, in the
    loader's ``epoch``. ``parts`` (documents data only) says where each document's tokens sit, for following a bad
    document to the other micro-batches that hold parts of it; a token stream records no document boundaries."""

    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64
    positions: torch.Tensor | None = None  # (B, T) int64
    padding: int = 0
    origin: tuple[tuple[int, int], ...] = ()
    epoch: int = 0
    parts: tuple[DocumentPart, ...] = ()
    answers: Answers | None = None  # preference and KTO data: which answer each target belongs to

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        positions = None if self.positions is None else self.positions.to(device, non_blocking=non_blocking)
        answers = None if self.answers is None else self.answers.to(device, non_blocking=non_blocking)
        return MicroBatch(
            self.inputs.to(device, non_blocking=non_blocking),
            self.targets.to(device, non_blocking=non_blocking),
            positions,
            self.padding,
            self.origin,
            self.epoch,
            self.parts,
            answers,
        )

    def pin_memory(self) -> MicroBatch:
        positions = None if self.positions is None else self.positions.pin_memory()
        return MicroBatch(
            self.inputs.pin_memory(),
            self.targets.pin_memory(),
            positions,
            self.padding,
            self.origin,
            self.epoch,
            self.parts,
            None if self.answers is None else self.answers.pin_memory(),
        )

    @property
    def origin_key(self) -> str:
        """The micro-batch's identity in the data (its epoch and documents): what an exclusion names."""
        return f"{self.epoch}:" + ",".join(f"{shard}@{offset}" for shard, offset in self.origin)

    def excluded_by(self, keys: set[str]) -> bool:
        """Whether a rewind's exclusions name this micro-batch, or a document it holds a part of."""
        return self.origin_key in keys or any(part.key in keys for part in self.parts)


def count_valid_targets(batch: MicroBatch) -> int:
    """Targets that are not ``IGNORE_INDEX`` (-100)."""
    return int((batch.targets != IGNORE_INDEX).sum())


def global_valid_targets(
    micro_batches: Sequence[object], dist: DistContext, device: torch.device, count: Callable[[object], int]
) -> int:
    """Valid targets of ``micro_batches`` summed over every rank: one small all-reduce (none for one process)."""
    return dist.sum_int(sum(count(mb) for mb in micro_batches), device)


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step: this rank's micro-batches and the valid targets of the whole step (all ranks); for
    documents also the step's positions and those of them that are padding (all ranks; 0 for a token stream,
    where every position is a valid target)."""

    micro_batches: list[MicroBatch]
    n_valid: int
    positions: int = 0
    padding: int = 0

    @property
    def padding_share(self) -> float:
        """Share of the step's positions that hold no document token."""
        return self.padding / self.positions if self.positions else 0.0

    @property
    def prompt_share(self) -> float:
        """Share of the step's positions that hold a document token without loss (a masked prompt)."""
        return (self.positions - self.padding - self.n_valid) / self.positions if self.positions else 0.0

    @property
    def k(self) -> int:
        return len(self.micro_batches)


@dataclass(frozen=True)
class StepPolicy:
    """How a step is sized: ``k`` micro-batches per rank, or a ``token_budget`` of valid targets (K varies)."""

    k: int = 1
    token_budget: int = 0  # 0: fixed K
    last_window: str = "partial"

    def __post_init__(self) -> None:
        LAST_WINDOW.check(self.last_window)
        if self.k < 1:
            raise ConfigError(f"K must be at least 1, got {self.k}")
        if self.token_budget < 0:
            raise ConfigError(f"token_budget must be positive, got {self.token_budget}")


class MicroBatchSource(Protocol):
    """What :func:`read_step` reads: a loader of this rank's micro-batches that counts completed epochs."""

    @property
    def epoch(self) -> int: ...

    def next_micro_batch(self) -> MicroBatch: ...

    def sequences_left(self) -> int | None:
        """Sequences (all ranks) left in this epoch; ``None`` for an endless token stream."""
        ...

    def sequences_per_micro_batch(self) -> int:
        """Sequences one global micro-batch holds: micro_batch x world_size."""
        ...

    def sequences_per_epoch(self) -> int | None:
        """Sequences in one epoch of the split; ``None`` for an endless token stream."""
        ...

    def skip_rest_of_epoch(self) -> None: ...

    def known_valid_targets(self) -> int | None:
        """Valid targets in each of this rank's micro-batches when known without counting (a token stream:
        micro_batch x seq_len); ``None`` when they must be counted (documents: padding, masks)."""
        ...


def read_step(source: MicroBatchSource, policy: StepPolicy, dist: DistContext, device: torch.device) -> StepBatch:
    """This rank's micro-batches for the next step and the step's valid targets on all ranks.

    Every rank calls it with its own source and makes the same decisions: a token budget's stop depends on
    global counts, read once per micro-batch (one small all-reduce each, none for packed data or one process);
    a fixed K's count is one all-reduce per step (none for packed data, where it is known)."""
    known = source.known_valid_targets()
    per_micro_batch = known * dist.world_size if known is not None else None  # all ranks' micro-batches alike

    def count_global(batch: MicroBatch) -> int:
        if per_micro_batch is not None:
            return per_micro_batch
        return dist.sum_int(count_valid_targets(batch), device)

    if policy.token_budget:
        step = _budget_step(source, policy, count_global)
        if per_micro_batch is not None:
            return step
        padding = dist.sum_int(sum(batch.padding for batch in step.micro_batches), device)
        return StepBatch(step.micro_batches, step.n_valid, _global_positions(step.micro_batches, dist), padding)
    batches = _fixed_k_batches(source, policy)
    if per_micro_batch is not None:
        return StepBatch(batches, len(batches) * per_micro_batch)
    local_valid = sum(count_valid_targets(batch) for batch in batches)
    n_valid, padding = dist.sum_ints([local_valid, sum(batch.padding for batch in batches)], device)
    return StepBatch(batches, n_valid, _global_positions(batches, dist), padding)


def _global_positions(batches: Sequence[MicroBatch], dist: DistContext) -> int:
    """Positions of the step on all ranks: every rank reads the same number of micro-batches of one shape."""
    return sum(batch.inputs.numel() for batch in batches) * dist.world_size


def _fixed_k_batches(source: MicroBatchSource, policy: StepPolicy) -> list[MicroBatch]:
    """K micro-batches, or fewer for the last window of a document epoch under ``partial``."""
    k = policy.k
    left = source.sequences_left()
    if left is not None:
        per_micro_batch = source.sequences_per_micro_batch()
        needed = k * per_micro_batch
        if left < needed:
            if policy.last_window == "drop":
                total = source.sequences_per_epoch() or 0
                if total < needed:
                    raise DataError(
                        f"the data holds {plural(total, 'sequence')}, fewer than one step of {needed} "
                        "(K x micro_batch x world_size); use last_window = partial or a smaller batch"
                    )
                source.skip_rest_of_epoch()
            else:
                k = math.ceil(left / per_micro_batch)
    return [source.next_micro_batch() for _ in range(k)]


def _budget_step(source: MicroBatchSource, policy: StepPolicy, count_global: Callable[[MicroBatch], int]) -> StepBatch:
    """Micro-batches until the step's valid targets reach the budget (see the module docstring)."""
    budget = policy.token_budget
    batches: list[MicroBatch] = []
    total = 0
    epoch = source.epoch
    wraps = 0
    while total < budget:
        batch = source.next_micro_batch()
        batches.append(batch)
        total += count_global(batch)
        if source.epoch != epoch:  # this micro-batch ended an epoch
            epoch = source.epoch
            wraps += 1
            if total >= budget:
                break
            if policy.last_window == "partial" and total > 0:
                break
            if wraps > 1:
                raise DataError(
                    f"token_budget={budget:,} is more than the valid targets of the whole training data; "
                    "lower --token-budget or add data"
                )
            batches, total = [], 0  # drop: the epoch's incomplete remainder is skipped
    return StepBatch(batches, total)


class EmptyStepGuard:
    """Bounds the steps skipped in a row because they hold no valid target: a training split with valid
    targets yields one within an epoch, so two epochs of empty steps mean none will come."""

    def __init__(self) -> None:
        self.first_epoch: int | None = None

    def reset(self) -> None:
        self.first_epoch = None

    def skipped(self, loader: MicroBatchSource) -> None:
        if self.first_epoch is None:
            self.first_epoch = loader.epoch
        elif loader.epoch - self.first_epoch >= 2:
            raise DataError(
                "every step of a whole epoch held no valid targets (documents that are a single token or wholly "
                "masked); fix the training data"
            )
