"""The training loader of learning from rewards: each optimizer step's micro-batches made from its rollout.

A *rollout* is ``updates_per_rollout x prompts_per_step`` groups of completions, from a sampler
(:class:`RolloutMaker`: the policy as it stands, every ``updates_per_rollout`` steps) or from a file generated
elsewhere (:class:`FileRollouts`, ``prompts_per_step`` groups a step, in the file's order, epoch after epoch). Each
optimizer step trains on its own ``prompts_per_step`` groups: its accumulation window is its own completions, dealt
as :mod:`bigbatch.data.rollouts` says, K micro-batches per rank (K follows the completions, not a flag).

The ratio's denominator, the old policy's log-probability of each completion token, is the trainer's own forward
without gradients: in the statistics pass of the step for a rollout of one step, and for a rollout of several,
right after it is sampled and before its first update (``score``, then shared by every rank), so that every later
step of the rollout reads the policy that sampled it. A rollout file's ``logps`` replace it.

The state (``state_dict``) holds where the rollouts stand: the file's epoch and step, or the sampler's position
and generators and the rollout's steps not yet trained (their completions, rewards and old log-probabilities), so
a resume is bitwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from bigbatch.data.rollouts import (
    Completion,
    Group,
    StepCompletions,
    StepFacts,
    build_micro_batch,
    deal,
    micro_batches_per_rank,
    step_completions,
)
from bigbatch.engine.batch import MicroBatch
from bigbatch.errors import DataError

log = logging.getLogger(__name__)

STATE_KIND = "rollouts"
RESAMPLE_ROUNDS = 4
MAX_EMPTY_ROLLOUTS = 8
"""Sampled rollouts in a row whose every group is flat and left out, before the run stops with one line."""
"""``--flat-groups resample``: at most this many rounds of sampling replacements; groups still flat are dropped."""


class RolloutMaker(Protocol):
    """Samples groups of completions with the current policy and scores them."""

    def make(self, prompts: int) -> tuple[list[Group], float]:
        """``prompts`` groups (every rank the same) and the seconds it took."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FileRollouts:
    """A rollout file's groups, ``prompts_per_step`` a step in the file's order, epoch after epoch (the last step of
    an epoch trains on the groups left)."""

    def __init__(self, groups: list[Group]) -> None:
        self.groups = groups


Scorer = Callable[[Sequence[MicroBatch]], None]
"""Sets the old policy's log-probabilities on micro-batches (:func:`~bigbatch.engine.policy_gradient.score_rollout`)."""
Gather = Callable[[Any], list[Any]]
"""Every rank's object, in rank order (``all_gather_object``)."""


class RolloutLoader:
    """This rank's micro-batches of each step's completions (see the module docstring)."""

    def __init__(
        self,
        source: FileRollouts | RolloutMaker,
        prompts_per_step: int,
        micro_batch: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        pad_token: int = 0,
        pack: bool = True,
        advantage_scale: str = "std",
        flat_groups: str = "keep",
        updates_per_rollout: int = 1,
    ) -> None:
        self.source = source
        self.prompts_per_step = prompts_per_step
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.pad_token = pad_token
        self.pack = pack
        self.advantage_scale = advantage_scale
        self.flat_groups = flat_groups
        self.updates_per_rollout = updates_per_rollout if not isinstance(source, FileRollouts) else 1
        self.scorer: Scorer | None = None  # set once the model is built (a rollout of several steps needs it)
        self.gather: Gather | None = None  # set for several processes
        self.epoch = 0  # the file's epochs; the sampler's rollouts
        self.step_in_epoch = 0  # the file's next step
        self.pending: list[list[Group]] = []  # the sampled rollout's steps not yet trained
        self.resampled = 0  # flat groups the last rollout replaced
        self.facts = StepFacts(0, 0, 0)
        self._ready: list[MicroBatch] = []

    # -- the step ------------------------------------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        if isinstance(self.source, FileRollouts):
            return -(-len(self.source.groups) // self.prompts_per_step)
        return self.updates_per_rollout

    def micro_batches_next_step(self) -> int:
        """K of the next step (this rank's micro-batches; the same on every rank), sampling a rollout first when
        the last one is used up."""
        self._prepare()
        return len(self._ready)

    def step_facts(self) -> dict[str, float]:
        """What the rollout knew of the step being trained (for its record)."""
        return self.facts.as_dict()

    def _groups_of_next_step(self) -> tuple[list[Group], float]:
        if isinstance(self.source, FileRollouts):
            first = self.step_in_epoch * self.prompts_per_step
            return self.source.groups[first : first + self.prompts_per_step], 0.0
        if not self.pending:
            groups, seconds = self._sample(self.prompts_per_step * self.updates_per_rollout)
            self.pending = [
                groups[u * self.prompts_per_step : (u + 1) * self.prompts_per_step]
                for u in range(self.updates_per_rollout)
            ]
            if self.updates_per_rollout > 1:
                self._score_rollout()
            return self.pending[0], seconds
        return self.pending[0], 0.0

    def _sample(self, prompts: int) -> tuple[list[Group], float]:
        """A rollout of ``prompts`` groups; with ``resample``, each flat group replaced by a group of the next prompt,
        round after round (at most :data:`RESAMPLE_ROUNDS`), as DAPO's dynamic sampling fills its batch. Every rank
        holds every group, so every rank makes the same replacements."""
        assert not isinstance(self.source, FileRollouts)
        groups, seconds = self.source.make(prompts)
        self.resampled = 0
        for _ in range(RESAMPLE_ROUNDS if self.flat_groups == "resample" else 0):
            flat = sum(group.flat for group in groups)
            if not flat:
                break
            more, more_seconds = self.source.make(flat)
            groups = [group for group in groups if not group.flat] + more
            seconds += more_seconds
            self.resampled += flat
        return groups, seconds

    def _prepare(self) -> None:
        if self._ready:
            return
        for _ in range(MAX_EMPTY_ROLLOUTS):
            fresh = not self.pending  # a sampled rollout of its own (the file's steps are always read fresh)
            groups, seconds = self._groups_of_next_step()
            step, facts = step_completions(groups, self.advantage_scale, self.flat_groups)
            resampled = self.resampled if fresh and not isinstance(self.source, FileRollouts) else 0
            self.facts = replace(facts, generation_s=seconds, resampled=resampled)
            if step.completions or isinstance(self.source, FileRollouts):
                break
            # every group flat and dropped: nothing to train, so the next rollout is sampled instead (a file's
            # empty step is the trainer's to skip: its data will not change)
            self._advance()
        else:
            raise DataError(
                f"{MAX_EMPTY_ROLLOUTS} rollouts in a row held no group whose rewards differ (every group flat, and "
                f"--flat-groups {self.flat_groups} leaves them out): check that the reward functions score "
                "completions differently, raise --temperature or --group-size, or use --flat-groups keep"
            )
        self._ready = self._micro_batches(step, self.epoch * 1_000_000 + self.step_in_epoch)

    def _micro_batches(self, step: StepCompletions, number: int) -> list[MicroBatch]:
        """This rank's K micro-batches of ``step`` (padding past the end of its units)."""
        units = deal(step, self.micro_batch, self.seq_len, self.pack)
        k = micro_batches_per_rank(len(units), self.world_size)
        out = []
        for j in range(k):
            u = j * self.world_size + self.rank
            placed = units[u] if u < len(units) else []
            out.append(
                build_micro_batch(step, placed, self.micro_batch, self.seq_len, self.pack, self.pad_token, (number, u))
            )
        return out

    def _score_rollout(self) -> None:
        """The old policy's log-probabilities of every completion of a rollout of several steps, before its first
        update: each rank scores its micro-batches, then every rank gets all of them (a checkpoint of any rank can
        resume the rollout on any number of processes)."""
        if self.scorer is None:
            raise RuntimeError("a rollout of several steps needs the loader's scorer")
        found: dict[tuple[int, int], list[float]] = {}
        for u, groups in enumerate(self.pending):
            step, _ = step_completions(groups, self.advantage_scale, self.flat_groups)
            units = deal(step, self.micro_batch, self.seq_len, self.pack)
            batches = self._micro_batches(step, -1)
            self.scorer(batches)
            for j, batch in enumerate(batches):
                unit = j * self.world_size + self.rank
                if unit >= len(units):
                    continue
                assert batch.answers is not None and batch.answers.rollout is not None
                old = batch.answers.rollout.old_logp
                assert old is not None
                for i, r, c in units[unit]:
                    completion = step.completions[i]
                    start = c + len(completion.prompt) - 1
                    found[(u, i)] = old[r, start : start + len(completion.tokens)].tolist()
        everyone = self.gather(found) if self.gather is not None else [found]
        merged: dict[tuple[int, int], list[float]] = {}
        for part in everyone:
            merged.update(part)
        for u, groups in enumerate(self.pending):
            step, _ = step_completions(groups, self.advantage_scale, self.flat_groups)
            for i, completion in enumerate(step.completions):
                completion.old_logps = merged[(u, i)]

    def _advance(self) -> None:
        """Past the step just read: the file's next step (a new epoch after its last), or the rollout's."""
        if isinstance(self.source, FileRollouts):
            self.step_in_epoch += 1
            if self.step_in_epoch >= self.steps_per_epoch:
                self.step_in_epoch, self.epoch = 0, self.epoch + 1
            return
        self.pending.pop(0)
        self.step_in_epoch += 1
        if not self.pending:
            self.step_in_epoch, self.epoch = 0, self.epoch + 1

    # -- MicroBatchSource ----------------------------------------------------------------------------------------

    def next_micro_batch(self) -> MicroBatch:
        self._prepare()
        batch = self._ready.pop(0)
        if not self._ready:
            self._advance()
        return batch

    def sequences_left(self) -> int | None:
        return None  # a step reads exactly what micro_batches_next_step said

    def sequences_per_micro_batch(self) -> int:
        return self.micro_batch * self.world_size

    def sequences_per_epoch(self) -> int | None:
        return None

    def known_valid_targets(self) -> int | None:
        return None

    def skip_rest_of_epoch(self) -> None:
        return None  # every step is whole: there is no rest to skip

    def reset(self) -> None:
        self.epoch, self.step_in_epoch, self.pending, self._ready = 0, 0, [], []

    def __iter__(self) -> RolloutLoader:
        return self

    def __next__(self) -> MicroBatch:
        return self.next_micro_batch()

    # -- position ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "kind": STATE_KIND,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "prompts_per_step": self.prompts_per_step,
        }
        if not isinstance(self.source, FileRollouts):
            state["pending"] = [
                [{"key": g.key, "completions": [c.as_dict() for c in g.completions]} for g in step]
                for step in self.pending
            ]
            state["sampler"] = self.source.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != STATE_KIND:
            raise DataError(
                "the checkpoint read ordinary training data, this run learns from rewards; start a new run with --out"
            )
        saved = int(state.get("prompts_per_step", self.prompts_per_step))
        if saved != self.prompts_per_step:
            raise DataError(
                f"the checkpoint trained {saved} prompts per step, this run {self.prompts_per_step}; resume with "
                f"--prompts-per-step {saved}"
            )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        self._ready = []
        if isinstance(self.source, FileRollouts):
            if not 0 <= self.step_in_epoch < max(self.steps_per_epoch, 1):
                raise DataError(
                    f"the checkpoint stood at step {self.step_in_epoch} of a rollout file of {self.steps_per_epoch} "
                    "steps; was the file changed?"
                )
            return
        self.pending = [
            [Group(g["key"], [Completion.from_dict(c) for c in g["completions"]]) for g in step]
            for step in state.get("pending", [])
        ]
        if "sampler" in state:
            self.source.load_state_dict(state["sampler"])
