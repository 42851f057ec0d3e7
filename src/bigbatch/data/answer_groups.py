"""The rank-aware, resumable reader of a dataset of answers (preference pairs, KTO rows): whole groups dealt into
micro-batches, each answer marked for the objective.

A *group* is a row's documents, stored back to back (:mod:`bigbatch.data.answers`: a pair's chosen and rejected
documents; a KTO row's document and its KL document). A group is never split between micro-batches or ranks.

**An epoch** walks the groups in an order (the data's, or with ``shuffle`` a permutation drawn from ``seed`` and
the epoch, :func:`~bigbatch.data.windows.epoch_order`, as the documents loader draws its own) and deals them into
micro-batches of ``B`` rows x ``T`` positions, in that order (:func:`plan_epoch`):

* **unpacked** (``pack`` off): each document a row of its own, so a micro-batch holds ``B // 2`` groups; an odd
  ``B`` leaves its last row padding in every micro-batch, and ``B = 1`` (half a pair) is refused;
* **packed**: each document of the next group goes into the first row of the current micro-batch with room for it
  (first fit, documents back to back, ``positions`` restarting at 0 in each as in
  :class:`~bigbatch.data.documents.DocumentLoader`); a group that does not fit whole starts the next micro-batch.

The epoch's micro-batches are numbered (*units*) independently of the number of processes; global micro-batch
``j`` is units ``[j x world, (j + 1) x world)`` and rank ``r`` reads unit ``j x world + r``, so ranks read disjoint
groups in one global order whatever their number. The last global micro-batch of an epoch may hold fewer units
than ranks: a rank past the end reads a micro-batch of padding without an answer (its objective terms hold no
unit). The step assembler counts *rows* (``sequences_*``): ``B`` per unit.

**Each micro-batch** carries :class:`~bigbatch.engine.batch.Answers`: the answers (one per document, numbered in
placement order: a group's documents one after the other), each answer's group (numbered from 0 in the
micro-batch) and role, and for every target the answer it belongs to (-1 for a prompt's, padding's or any masked
target). A target at position ``t`` is the token at ``t + 1``: ``segment[b, t]`` says which answer's
``log p(targets[b, t])`` it is. Targets are the real next tokens on every answer token (KL documents included),
-100 elsewhere. Every document must fit a row (``T + 1`` tokens: ``prepare --seq-len`` keeps them so), except a
KTO row's KL document, which is cut to a row (only its reference point is read from it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bigbatch.data.answers import GROUP_ROLES, GROUP_SIZE, PAIRS, ROLE_KL, ROLE_NAMES
from bigbatch.data.documents import trained_targets
from bigbatch.data.shards import DocumentShard
from bigbatch.data.windows import SEQUENTIAL, SHUFFLED, check_saved_order, epoch_order
from bigbatch.engine.batch import IGNORE_INDEX, Answers, DocumentPart, MicroBatch
from bigbatch.errors import DataError
from bigbatch.progress import plural

log = logging.getLogger(__name__)

STATE_KIND = "answer_groups"


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's micro-batches (units), as placements in CSR form: unit ``m`` holds the placements
    ``[unit_starts[m], unit_starts[m + 1])``, each a document put at ``(row, column)``, its group numbered within
    the unit; placements are in answer order (a group's documents one after another)."""

    unit_starts: np.ndarray  # (M + 1,) int64
    document: np.ndarray  # (P,) int64: flat document index
    row: np.ndarray  # (P,) int64
    column: np.ndarray  # (P,) int64
    group: np.ndarray  # (P,) int64: the group's number within its unit

    @property
    def units(self) -> int:
        return len(self.unit_starts) - 1


def plan_epoch(
    order: np.ndarray, group_first: np.ndarray, positions: np.ndarray, micro_batch: int, seq_len: int, pack: bool
) -> EpochPlan:
    """Groups in ``order`` dealt whole into micro-batches of ``micro_batch`` rows x ``seq_len`` positions (see the
    module's note). ``group_first`` (G + 1,): each group's first document, then the end; ``positions`` (docs,):
    the positions each document fills (its tokens minus one, at most ``seq_len``). Every group must fit an empty
    micro-batch (the loader checks)."""
    unit_starts = [0]
    document: list[int] = []
    row: list[int] = []
    column: list[int] = []
    group: list[int] = []
    fill = [0] * micro_batch  # positions used in each row of the open unit
    in_unit = 0  # groups in the open unit
    sizes = positions.tolist()
    firsts = group_first.tolist()
    for g in order.tolist():
        members = range(firsts[g], firsts[g + 1])
        placed = _place(fill, [sizes[d] for d in members], seq_len, pack)
        if placed is None:  # the group does not fit what is left: it starts the next micro-batch
            unit_starts.append(len(document))
            fill, in_unit = [0] * micro_batch, 0
            placed = _place(fill, [sizes[d] for d in members], seq_len, pack)
            assert placed is not None, "a group larger than a micro-batch"
        for d, (r, c) in zip(members, placed, strict=True):
            document.append(d)
            row.append(r)
            column.append(c)
            group.append(in_unit)
        in_unit += 1
    if len(document) > unit_starts[-1]:
        unit_starts.append(len(document))

    def array(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    return EpochPlan(array(unit_starts), array(document), array(row), array(column), array(group))


def _place(fill: list[int], sizes: list[int], seq_len: int, pack: bool) -> list[tuple[int, int]] | None:
    """Where each of a group's documents goes in the open micro-batch (``fill``: positions used per row), updating
    ``fill``; None (and ``fill`` untouched) when the group does not fit whole. Packed: the first row with room;
    unpacked: the first empty row."""
    trial = list(fill)
    placed = []
    for size in sizes:
        for r, used in enumerate(trial):
            if (used + size <= seq_len) if pack else used == 0:
                placed.append((r, used))
                trial[r] = used + size
                break
        else:
            return None
    fill[:] = trial
    return placed


class AnswerGroupLoader:
    """This rank's micro-batches of a split of answers, ``micro_batch`` rows x ``seq_len`` positions, whole groups
    dealt as the module's note says; ``state_dict`` / ``load_state_dict`` put it back where it was (bitwise).

    ``valid_targets`` is the number of targets one epoch trains on (all ranks; a cut KL document's count as cut);
    ``cut_kl_documents`` the KL documents longer than a row."""

    def __init__(
        self,
        shards: list[DocumentShard],
        micro_batch: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        pad_token: int = 0,
        name: str = "train",
        shuffle: bool = False,
        seed: int = 0,
        pack: bool = False,
        answers: str = PAIRS,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if answers not in GROUP_ROLES:
            raise ValueError(f"answers must be one of {', '.join(GROUP_ROLES)}, got {answers!r}")
        self.shards = shards
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.pad_token = pad_token
        self.name = name
        self.shuffle = shuffle
        self.seed = seed
        self.pack = pack
        self.answers = answers
        # Flat index of every document: its shard, first token, end and role.
        empty = np.zeros(0, dtype=np.int64)
        self._shard_of = np.concatenate([empty] + [np.full(len(s.offsets) - 1, i) for i, s in enumerate(shards)])
        self._start = np.concatenate([empty] + [np.asarray(s.offsets[:-1]) for s in shards]).astype(np.int64)
        self._end = np.concatenate([empty] + [np.asarray(s.offsets[1:]) for s in shards]).astype(np.int64)
        self._roles = np.concatenate([empty] + [_roles_of(s) for s in shards]).astype(np.int64)
        self.n_docs = len(self._start)
        if self.n_docs == 0:
            raise DataError(f"the {name} data holds no documents; use more data or a different --val-fraction")
        self.group_first = self._groups()  # (G + 1,)
        self.n_groups = len(self.group_first) - 1
        tokens = self._end - self._start
        is_kl = self._roles == ROLE_KL
        self.cut_kl_documents = int(np.sum(is_kl & (tokens - 1 > seq_len)))
        self.positions = np.minimum(tokens - 1, seq_len)  # (docs,): a KL document is cut to a row
        self._check_fits(tokens, is_kl)
        self.valid_targets = trained_targets(shards, seq_len)
        self.position = 0  # first unit of the next global micro-batch, within the epoch
        self.epoch = 0
        self._plans: dict[int, EpochPlan] = {}  # the last two computed

    def _groups(self) -> np.ndarray:
        """Where each group begins: documents are stored group by group, with the roles of
        :data:`~bigbatch.data.answers.GROUP_ROLES`; anything else is a damaged dataset."""
        expected = GROUP_ROLES[self.answers]
        if self.n_docs % GROUP_SIZE:
            raise DataError(f"the {self.name} split holds {self.n_docs} documents, not whole groups of {GROUP_SIZE}")
        for k, allowed in enumerate(expected):
            found = self._roles[k::GROUP_SIZE]
            wrong = np.flatnonzero(~np.isin(found, allowed))
            if len(wrong):
                doc = int(wrong[0]) * GROUP_SIZE + k
                raise DataError(
                    f"document {doc} of the {self.name} split has role {int(self._roles[doc])}, where a "
                    f"{self.answers} group holds {'/'.join(ROLE_NAMES[r] for r in allowed)}; re-run bigbatch prepare"
                )
        return np.arange(0, self.n_docs + 1, GROUP_SIZE, dtype=np.int64)

    def _check_fits(self, tokens: np.ndarray, is_kl: np.ndarray) -> None:
        """Every document has a target and fits a row (a KL document is cut instead); every group fits an empty
        micro-batch."""
        T, B = self.seq_len, self.micro_batch
        if np.any(tokens < 2):
            raise DataError(f"the {self.name} split holds a document without a target; re-run bigbatch prepare")
        too_long = ~is_kl & (tokens - 1 > T)
        if np.any(too_long):
            groups = len(np.unique(np.flatnonzero(too_long) // GROUP_SIZE))
            raise DataError(
                f"{plural(groups, 'group')} of the {self.name} split {'has' if groups == 1 else 'have'} a document "
                f"longer than seq_len+1={T + 1} tokens (the longest: {int(tokens[too_long].max()):,}); prepare the "
                f"rows with --seq-len {T} (--long-conversations decides what becomes of them), or train with a "
                "larger --seq-len"
            )
        if not self.pack and B < GROUP_SIZE:
            raise DataError(
                f"--micro-batch {B} with --pack off holds {plural(B, 'document')}, and each {self.answers} group is "
                f"{GROUP_SIZE} documents that share a micro-batch; use --micro-batch {GROUP_SIZE} or more, or --pack on"
            )
        if self.pack and B < GROUP_SIZE:
            sums = np.add.reduceat(self.positions, self.group_first[:-1])  # each group's positions
            if np.any(sums > T):
                raise DataError(
                    f"{plural(int(np.sum(sums > T)), 'group')} of the {self.name} split cannot share one row of "
                    f"seq_len={T} positions, and --micro-batch {B} has no other; use --micro-batch {GROUP_SIZE} or "
                    "more"
                )
        if not self.pack and B % GROUP_SIZE and self.rank == 0 and self.name in ("train", "training"):
            log.warning(
                "--micro-batch %d with --pack off: %d groups of %d documents per micro-batch, the last row padding "
                "in each; a multiple of %d wastes none",
                B,
                B // GROUP_SIZE,
                GROUP_SIZE,
                GROUP_SIZE,
            )

    # -- the epoch's plan ------------------------------------------------------------------------------------------

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """Epoch ``epoch``'s micro-batches (default: the current epoch's); the last two plans are kept."""
        epoch = self.epoch if epoch is None else epoch
        key = epoch if self.shuffle else 0
        plan = self._plans.get(key)
        if plan is None:
            order = epoch_order(self.n_groups, self.seed, epoch) if self.shuffle else np.arange(self.n_groups)
            plan = plan_epoch(order, self.group_first, self.positions, self.micro_batch, self.seq_len, self.pack)
            self._plans = {k: p for k, p in self._plans.items() if k == key - 1}
            self._plans[key] = plan
        return plan

    @property
    def n_units(self) -> int:
        """Micro-batches (all ranks together) of the current epoch."""
        return self.plan().units

    # -- the step assembler's view (bigbatch.engine.batch.MicroBatchSource), counted in rows -------------------------

    def sequences_left(self) -> int | None:
        return (self.n_units - self.position) * self.micro_batch

    def sequences_per_micro_batch(self) -> int:
        return self.micro_batch * self.world_size

    def sequences_per_epoch(self) -> int | None:
        return self.n_units * self.micro_batch

    def known_valid_targets(self) -> int | None:
        return None  # padding and prompts: counted per micro-batch

    def skip_rest_of_epoch(self) -> None:
        if self.position:
            self.position = 0
            self.epoch += 1

    def reset(self) -> None:
        self.position, self.epoch = 0, 0

    def next_micro_batch(self) -> MicroBatch:
        units = self.n_units
        batch = self.read_unit(self.position + self.rank)
        self.position += min(self.world_size, units - self.position)
        if self.position >= units:
            self.position = 0
            self.epoch += 1
        return batch

    def __iter__(self) -> AnswerGroupLoader:
        return self

    def __next__(self) -> MicroBatch:
        return self.next_micro_batch()

    # -- reading ---------------------------------------------------------------------------------------------------

    def read(self, units: np.ndarray | list[int]) -> MicroBatch:
        """Unit ``units[0]`` of the current epoch (a negative one, or none: a micro-batch of padding); what
        :class:`~bigbatch.data.validation_windows.ValidationWindows` reads, one unit per micro-batch."""
        picked = np.asarray(units, dtype=np.int64).reshape(-1)
        if len(picked) > 1:
            raise ValueError("an answers loader reads one unit (a whole micro-batch) at a time")
        return self.read_unit(int(picked[0]) if len(picked) else -1)

    def read_unit(self, unit: int) -> MicroBatch:
        """Unit ``unit`` of the current epoch's plan as a micro-batch; past the end (or negative), padding alone."""
        B, T = self.micro_batch, self.seq_len
        inputs = np.full((B, T), self.pad_token, dtype=np.int64)
        targets = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        segment = np.full((B, T), -1, dtype=np.int64)
        positions = np.zeros((B, T), dtype=np.int64) if self.pack else None
        plan = self.plan()
        lo, hi = (int(plan.unit_starts[unit]), int(plan.unit_starts[unit + 1])) if 0 <= unit < plan.units else (0, 0)
        documents = plan.document[lo:hi]
        fill = np.zeros(B, dtype=np.int64)
        origin: list[tuple[int, int]] = []
        parts: list[DocumentPart] = []
        for answer, (doc, r, c) in enumerate(
            zip(documents.tolist(), plan.row[lo:hi].tolist(), plan.column[lo:hi].tolist(), strict=True)
        ):
            shard_index, start, n = int(self._shard_of[doc]), int(self._start[doc]), int(self.positions[doc])
            shard = self.shards[shard_index]
            tokens = np.asarray(shard.tokens[start : start + n + 1], dtype=np.int64)  # (n + 1,)
            following = tokens[1:].copy()  # (n,) each position's target
            if shard.mask is not None:
                following[~np.asarray(shard.mask[start + 1 : start + n + 1], dtype=np.bool_)] = IGNORE_INDEX
            inputs[r, c : c + n] = tokens[:-1]
            targets[r, c : c + n] = following
            segment[r, c : c + n] = np.where(following != IGNORE_INDEX, answer, -1)
            if positions is not None:
                positions[r, c : c + n] = np.arange(n)
            fill[r] = c + n
            origin.append((shard_index, start))
            parts.append(DocumentPart(shard_index, start, 0, 1, r, c, n))
        if positions is not None:  # each row's padding is a segment of its own, counted from 0
            for r in range(B):
                positions[r, fill[r] :] = np.arange(T - fill[r])
        answers = Answers(
            torch.from_numpy(segment),
            torch.from_numpy(plan.group[lo:hi].copy()),
            torch.from_numpy(self._roles[documents]),
            torch.from_numpy(documents.copy()),
            self.name,
        )
        return MicroBatch(
            torch.from_numpy(inputs),
            torch.from_numpy(targets),
            None if positions is None else torch.from_numpy(positions),
            padding=B * T - int(fill.sum()),
            origin=tuple(origin),
            epoch=self.epoch,
            parts=tuple(parts),
            answers=answers,
        )

    # -- position --------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "answers": self.answers,
            "order": SHUFFLED if self.shuffle else SEQUENTIAL,
            "seed": self.seed,
            "position": self.position,
            "epoch": self.epoch,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "pack": self.pack,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was saved: the same epoch's plan, at the same unit. The plan depends on the
        micro-batch's shape and on packing, so those must be the run's own; the number of processes may change
        (units are numbered without it)."""
        if state.get("kind") != STATE_KIND:
            raise DataError(
                "the checkpoint read this data as ordinary documents, this run reads it as groups of answers; start a "
                "new run with --out"
            )
        check_saved_order(state, SHUFFLED if self.shuffle else SEQUENTIAL)
        saved_pack = bool(state.get("pack", False))
        if saved_pack != self.pack:
            raise DataError(
                f"the checkpoint read its answers {'packed' if saved_pack else 'one document per row'}, this run "
                f"{'packed' if self.pack else 'one per row'}; resume with --pack {'on' if saved_pack else 'off'}"
            )
        shape = (int(state["micro_batch"]), int(state["seq_len"]))
        if shape != (self.micro_batch, self.seq_len):
            raise DataError(
                f"the checkpoint dealt its groups of answers into micro-batches of {shape[0]} x {shape[1]}, this run "
                f"into {self.micro_batch} x {self.seq_len}; resume with --micro-batch {shape[0]} --seq-len "
                f"{shape[1]}"
            )
        seed = int(state.get("seed", self.seed)) if self.shuffle else self.seed  # the order the run started with
        epoch, position = int(state.get("epoch", 0)), int(state["position"])
        self.seed = seed
        self._plans = {}
        units = self.plan(epoch).units
        if not 0 <= position < max(units, 1):
            raise DataError(
                f"loader state position {position} lies outside the {units} micro-batches of epoch {epoch} of this "
                "split; was the data changed?"
            )
        self.epoch, self.position = epoch, position


def _roles_of(shard: DocumentShard) -> np.ndarray:
    if shard.roles is None:
        raise DataError("a shard of answers has no roles (.roles.npy); re-run bigbatch prepare")
    return np.asarray(shard.roles, dtype=np.int64)
