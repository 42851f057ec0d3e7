"""``bigbatch verify --objective grpo``: each term of the reward objective (``policy``, ``kl``, ``entropy``), under
each loss aggregation, accumulated, against the one micro-batch that holds every completion of the step.

The step is random rollout groups (2 to 4 completions of a random prompt, one group flat, one of a single
completion, rewards at random, advantages as the rollout computes them), within the model's vocabulary and a row
of ``seq_len``. The old log-probabilities are the model's own plus a fixed random offset per token in
[-:data:`OLD_OFFSET`, :data:`OLD_OFFSET`], so the ratios are not 1 and both clip bounds (:data:`CLIP_LOW`,
:data:`CLIP_HIGH`) bite; the reference is a frozen copy with its weights moved a little (the base with its adapters
off under LoRA), so the ``kl`` term is not 0; ``kl`` and ``entropy`` have weights above 0, so every term exists.

The completions (not the groups: a group's completions land in different micro-batches) are cut every way a run
might (:data:`~bigbatch.verify.objective_terms.SPLITS`: ``equal``, ``unequal``, ``permuted``, ``empty``) and each
term's gradient alone is compared with the whole step's by relative L2 distance; ``one-a-row`` compares the packed
whole step with one completion a row. A negative control removes the packed rows' isolation (completions attend to
each other): it must differ, or the check could not have seen a leak. Across ranks (:func:`check_rollout_across_ranks`)
uneven completions per rank (``ranks``: rank 0 one completion, so a group lies across ranks, then micro-batches
of none) and a rank of padding alone (``pad-rank``) are compared through DDP's one sync with one process.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from bigbatch.data.rollouts import Completion, Group, StepCompletions, build_micro_batch, step_completions
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.objective import Objective
from bigbatch.engine.policy_gradient import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ReferenceScorer,
    RewardLossSettings,
    RewardObjective,
    token_scores,
)
from bigbatch.models.lora import has_lora
from bigbatch.progress import plural
from bigbatch.verify.objective_terms import (
    SPLITS,
    ObjectiveReport,
    TermCheck,
    _rel,
    objective_gradient,
    only_term,
    rank_parts,
    split_sizes,
)

CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # asymmetric, as DAPO's
KL_COEF, ENTROPY_COEF = 0.1, 0.01
OLD_OFFSET = 0.4  # the most nats an old log-probability is moved from the model's own
WHOLE = "one-a-row"  # the packed whole step against one completion a row
RANK_SPLITS = ("ranks", "pad-rank")


@dataclass(frozen=True)
class RolloutTermCheck(TermCheck):
    """A term under one aggregation ``mode`` and one way of cutting the step."""

    mode: str = ""


@dataclass
class RolloutReport(ObjectiveReport):
    """Every (aggregation, term, split), and each aggregation's negative control."""

    completions: int = 0
    shape: str = ""  # what the groups hold: flat ones, ones of a single completion
    modes: tuple[str, ...] = ()
    policy_losses: tuple[str, ...] = ()
    controls: dict[str, float] = field(default_factory=dict)
    groups_cut: dict[str, int] = field(default_factory=dict)  # per split: groups whose completions it separates

    @property
    def across_ranks(self) -> bool:
        return any(check.split in RANK_SPLITS for check in self.checks)

    def format(self) -> str:
        losses = " and ".join(self.policy_losses)
        cut = ", ".join(f"{split} {n}" for split, n in self.groups_cut.items())
        lines = [
            f"objective {self.objective}: {self.groups} groups, {self.completions} completions ({self.shape}), "
            f"K {self.k}, tolerance {self.tolerance:g}",
            f"  {losses}, clip {CLIP_LOW:g}/{CLIP_HIGH:g}, kl {KL_COEF:g}, entropy {ENTROPY_COEF:g}; groups cut "
            f"between micro-batches: {cut}",
        ]
        width = max((len(mode) for mode in self.modes), default=10)
        for mode in self.modes:
            for check in self.checks:
                if getattr(check, "mode", "") != mode:
                    continue
                mark = "ok" if check.ok else "BROKEN"
                lines.append(
                    f"  {mode:<{width}}  term {check.term:<13} split {check.split:<9} rel L2 {check.rel_diff:.2e}  "
                    f"{mark}"
                )
            if mode in self.controls:
                control = self.controls[mode]
                seen = (
                    "differs, as it must"
                    if control > 10 * self.tolerance
                    else "does NOT differ: the check cannot see a leak"
                )
                lines.append(
                    f"  {mode:<{width}}  negative control (packed rows without isolation) rel L2 {control:.2e}: {seen}"
                )
        if self.equivalent:
            lines.append("verdict: EQUIVALENT")
        else:
            named = ", ".join(f"{getattr(c, 'mode', '')} {c.term} ({c.split})" for c in self.broken)
            lines.append(f"verdict: NOT EQUIVALENT: {named or 'the negative control does not differ'}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(
            completions=self.completions,
            shape=self.shape,
            modes=list(self.modes),
            policy_losses=list(self.policy_losses),
            controls=dict(self.controls),
            groups_cut=dict(self.groups_cut),
            settings={
                "clip_low": CLIP_LOW,
                "clip_high": CLIP_HIGH,
                "kl_coef": KL_COEF,
                "entropy_coef": ENTROPY_COEF,
                "old_offset": OLD_OFFSET,
            },
        )
        return out


def _limits(seq_len: int) -> tuple[int, int]:
    """The longest prompt and completion of the check: a document of both fits a row of ``seq_len + 1``."""
    completion_max = max(1, min(8, seq_len // 2))
    prompt_max = max(1, min(6, seq_len + 1 - completion_max))
    return prompt_max, completion_max


def random_rollout_groups(n: int, vocab_size: int, seed: int, seq_len: int) -> list[Group]:
    """``n`` groups of random tokens: 2 to 4 completions of a prompt of 1 to 6 tokens, completions of 1 to 8, rewards
    at random in [0, 1]; group 1 is of a single completion, group 2 is flat (every reward equal)."""
    rng = random.Random(seed)
    prompt_max, completion_max = _limits(seq_len)

    def tokens(longest: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(rng.randint(1, longest))]

    groups = []
    for g in range(n):
        size = 1 if g == 1 else rng.randint(2, 4)
        prompt = tokens(prompt_max)
        flat = g == 2 or (n < 3 and g == n - 1)
        rewards = [0.5] * size if flat else [round(rng.random(), 3) for _ in range(size)]
        groups.append(Group(str(g), [Completion(prompt, tokens(completion_max), r) for r in rewards]))
    return groups


def _place(step: StepCompletions, chosen: Sequence[int], seq_len: int, packed: bool) -> list[tuple[int, int, int]]:
    """``(completion, row, column)`` of the ``chosen`` completions: first fit into rows (``packed``) or a row each."""
    fill: list[int] = []
    placed = []
    for i in chosen:
        completion = step.completions[i]
        size = len(completion.prompt) + len(completion.tokens) - 1
        row = next((r for r, used in enumerate(fill) if packed and used + size <= seq_len), len(fill))
        if row == len(fill):
            fill.append(0)
        placed.append((i, row, fill[row]))
        fill[row] += size
    return placed


def micro_batch(step: StepCompletions, chosen: Sequence[int], seq_len: int, packed: bool = True) -> MicroBatch:
    """The ``chosen`` completions in one micro-batch (at least one row: a micro-batch of none is padding)."""
    placed = _place(step, chosen, seq_len, packed)
    rows = max(1, 1 + max((r for _, r, _ in placed), default=0))
    return build_micro_batch(step, placed, rows, seq_len, packed, pad_token=0, origin=(0, 0))


def leaky(batch: MicroBatch) -> MicroBatch:
    """The negative control: a packed micro-batch without its positions, so its documents attend to each other."""
    return replace(batch, positions=None)


def check_step(
    model: nn.Module, n_groups: int, vocab_size: int, seed: int, seq_len: int, device: torch.device
) -> StepCompletions:
    """The check's step: random groups, advantages as a rollout computes them (flat groups kept), and each token's old
    log-probability the model's own plus a fixed random offset."""
    groups = random_rollout_groups(n_groups, vocab_size, seed, seq_len)
    step, _ = step_completions(groups, "std", "keep")
    everything = list(range(len(step.completions)))
    placed = _place(step, everything, seq_len, packed=False)
    batch = build_micro_batch(step, placed, len(placed), seq_len, False, pad_token=0, origin=(0, 0))
    with torch.no_grad():
        own = -token_scores(model, batch.to(device))[..., 0].double().cpu()
    rng = random.Random(seed + 1)
    completions = []
    for (_, r, c), completion in zip(placed, step.completions, strict=True):  # a row each, in order
        start = c + len(completion.prompt) - 1
        logps = own[r, start : start + len(completion.tokens)].tolist()
        moved = [lp + rng.uniform(-OLD_OFFSET, OLD_OFFSET) for lp in logps]
        completions.append(replace(completion, old_logps=moved))
    step.completions = completions
    return step


def rollout_reference(model: nn.Module, seed: int = 0) -> ReferenceScorer:
    """The reference the check uses: the model with its LoRA adapters off when it has adapters, else a frozen copy
    of the model with its weights moved a little (the policy and the reference differ, as a few steps in)."""
    if has_lora(model):
        return ReferenceScorer()
    frozen = copy.deepcopy(model)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for param in frozen.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param))
    return ReferenceScorer(frozen)


def objectives(
    modes: Sequence[str], policy_losses: Sequence[str], reference: ReferenceScorer, norm_constant: float
) -> dict[tuple[str, str], RewardObjective]:
    """The objective of each (aggregation, policy loss), with every term."""
    return {
        (mode, loss): RewardObjective(
            RewardLossSettings(
                aggregation=mode,
                policy_loss=loss,
                clip_low=CLIP_LOW,
                clip_high=CLIP_HIGH,
                kl_coef=KL_COEF,
                entropy_coef=ENTROPY_COEF,
                norm_constant=norm_constant,
            ),
            reference,
        )
        for mode in modes
        for loss in policy_losses
    }


def _terms(objective: RewardObjective, loss: str, first: bool) -> list[tuple[str, Objective]]:
    """Each term to check alone, labelled: the policy term of every policy loss, the others once."""
    return [
        (f"policy({loss})" if term.name == "policy" else term.name, only_term(objective, term.name))
        for term in objective.terms
        if term.name == "policy" or first
    ]


def _cut(parts: Sequence[Sequence[int]], step: StepCompletions) -> int:
    """Groups whose completions lie in more than one of ``parts``."""
    where: dict[int, set[int]] = {}
    for p, part in enumerate(parts):
        for i in part:
            where.setdefault(step.group[i], set()).add(p)
    return sum(len(places) > 1 for places in where.values())


def _shape(step: StepCompletions) -> str:
    """``2 flat groups, 1 of a single completion``: what makes the step's groups uneven."""
    sizes: dict[int, int] = {}
    for g in step.group:
        sizes[g] = sizes.get(g, 0) + 1
    flat = {g for g in sizes if sizes[g] > 1}
    for g, advantage in zip(step.group, step.advantage, strict=True):
        if advantage != 0:
            flat.discard(g)
    singles = sum(size == 1 for size in sizes.values())
    return f"{plural(len(flat), 'flat group')}, {singles} of a single completion"


def _parts(split: str, n: int, k: int, seed: int) -> list[list[int]]:
    order = list(range(n))
    if split == "permuted":
        random.Random(seed).shuffle(order)
    parts, at = [], 0
    for size in split_sizes(split, n, k):
        parts.append(order[at : at + size])
        at += size
    return parts


def check_rollout_terms(
    model: nn.Module,
    *,
    groups: int,
    k: int,
    seq_len: int,
    vocab_size: int,
    modes: Sequence[str] = LOSS_AGGREGATIONS,
    policy_losses: Sequence[str] = POLICY_LOSSES,
    reference: ReferenceScorer | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    tolerance: float | None = None,
    splits: tuple[str, ...] = SPLITS,
) -> RolloutReport:
    """Each term of the reward objective on ``model`` under each aggregation of ``modes`` (see the module
    docstring; ``reference``: :func:`rollout_reference` unless given)."""
    device = torch.device(device)
    model = model.to(device)
    reference = reference if reference is not None else rollout_reference(model, seed)
    if reference.module is not None:
        reference.module.to(device)
    step = check_step(model, groups, vocab_size, seed, seq_len, device)
    n = len(step.completions)
    tol = tolerance if tolerance is not None else (1e-5 if precision == "fp32" else 2e-2)
    report = RolloutReport(
        "grpo",
        groups,
        k,
        tolerance=tol,
        completions=n,
        shape=_shape(step),
        modes=tuple(modes),
        policy_losses=tuple(policy_losses),
    )
    everything = list(range(n))
    # the micro-batches do not depend on the aggregation: built once (each keeps its reference scores once scored)
    whole = [micro_batch(step, everything, seq_len)]
    cuts = {split: _parts(split, n, k, seed) for split in splits}
    report.groups_cut = {split: _cut(parts, step) for split, parts in cuts.items()}
    batches = {split: [micro_batch(step, part, seq_len) for part in parts] for split, parts in cuts.items()}
    batches[WHOLE] = [micro_batch(step, everything, seq_len, packed=False)]
    control = [leaky(whole[0])]
    _, completion_max = _limits(seq_len)
    built = objectives(modes, policy_losses, reference, float(completion_max))
    for mode in modes:
        full: torch.Tensor | None = None
        for number, loss in enumerate(policy_losses):
            for label, alone in _terms(built[mode, loss], loss, number == 0):
                expected = objective_gradient(model, alone, whole, device, precision)
                if number == 0:
                    full = expected if full is None else full + expected  # the gradient is linear in the terms
                for split, parts in batches.items():
                    got = objective_gradient(model, alone, parts, device, precision)
                    report.checks.append(RolloutTermCheck(label, split, _rel(got, expected), tol, mode))
        assert full is not None
        leaked = objective_gradient(model, built[mode, policy_losses[0]], control, device, precision)
        report.controls[mode] = _rel(leaked, full)
    report.packing = max((c.rel_diff for c in report.checks if c.split == WHOLE), default=0.0)
    report.control = min(report.controls.values(), default=0.0)
    return report


def rollout_rank_parts(completions: list[int], world: int, rank: int, k: int, layout: str) -> list[list[int]]:
    """This rank's ``k`` micro-batches of ``completions``: ``ranks`` as
    :func:`~bigbatch.verify.objective_terms.rank_parts` (rank 0 one completion, then micro-batches of none; a group
    lies across ranks); ``pad-rank`` the last rank padding alone, the others sharing every completion unevenly."""
    if layout == "ranks":
        return rank_parts(completions, world, rank, k)
    if rank == world - 1:
        return [[] for _ in range(k)]
    share = [c for i, c in enumerate(completions) if i % (world - 1) == rank]
    parts, at = [], 0
    for size in [min(len(share), i + 1) for i in range(k - 1)]:
        parts.append(share[at : at + size])
        at += size
    return [*parts, share[at:]]


def check_rollout_across_ranks(
    model: nn.Module,
    dist: Any,
    *,
    groups: int,
    k: int,
    seq_len: int,
    vocab_size: int,
    modes: Sequence[str] = LOSS_AGGREGATIONS,
    policy_losses: Sequence[str] = POLICY_LOSSES,
    reference: ReferenceScorer | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    tolerance: float = 1e-5,
) -> RolloutReport:
    """Under torchrun, every rank alike: each term's gradient after DDP's one sync, under each layout of
    :data:`RANK_SPLITS`, against one process holding every completion in one micro-batch."""
    device = torch.device(device)
    model = model.to(device)
    reference = reference if reference is not None else rollout_reference(model, seed)
    if reference.module is not None:
        reference.module.to(device)
    step = check_step(model, groups, vocab_size, seed, seq_len, device)
    n = len(step.completions)
    report = RolloutReport(
        f"grpo across {dist.world_size} ranks",
        groups,
        k,
        tolerance=tolerance,
        completions=n,
        shape=_shape(step),
        modes=tuple(modes),
        policy_losses=tuple(policy_losses),
    )
    everything = list(range(n))
    whole = [micro_batch(step, everything, seq_len)]
    report.groups_cut = {
        layout: _cut(
            [
                part
                for rank in range(dist.world_size)
                for part in rollout_rank_parts(everything, dist.world_size, rank, k, layout)
            ],
            step,
        )
        for layout in RANK_SPLITS
    }
    mine = {
        layout: [
            micro_batch(step, part, seq_len)
            for part in rollout_rank_parts(everything, dist.world_size, dist.rank, k, layout)
        ]
        for layout in RANK_SPLITS
    }
    _, completion_max = _limits(seq_len)
    built = objectives(modes, policy_losses, reference, float(completion_max))
    for mode in modes:
        for number, loss in enumerate(policy_losses):
            for label, alone in _terms(built[mode, loss], loss, number == 0):
                expected = objective_gradient(model, alone, whole, device)
                for layout, parts in mine.items():
                    got = objective_gradient(model, alone, parts, device, dist=dist)
                    report.checks.append(RolloutTermCheck(label, layout, _rel(got, expected), tolerance, mode))
    report.control = float("inf")  # no packing comparison across ranks: the one-process check makes it
    return report
