"""``bigbatch verify --objective NAME``: each term of an objective over answers, accumulated, against the one
micro-batch that holds every group.

The same random groups (pairs, or KTO rows with their KL answers) are cut into micro-batches every way a run
might: ``equal`` (K parts), ``unequal`` (parts of 1, 2, 3, ... groups), ``permuted`` (the groups shuffled first)
and ``empty`` (a micro-batch that holds no group, as a rank or the end of an epoch may). Each term's gradient is
measured alone (the others weighted 0) and compared with the whole batch's by relative L2 distance; a term over
the tolerance is named with the split that broke it. Packed rows are checked against one document a row, and a
negative control removes the packed rows' isolation (documents attend to each other): it must differ, or the
check could not have seen a leak.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import torch.nn as nn

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.objective import Objective
from bigbatch.engine.optim import constant_schedule
from bigbatch.engine.preference import PreferenceObjective, PreferenceSettings, ReferencePolicy
from bigbatch.engine.rng import preserved_rng
from bigbatch.models.lora import has_lora
from bigbatch.verify.answer_batches import Group, answer_micro_batch, random_kto_rows, random_pairs, split_groups

SPLITS = ("equal", "unequal", "permuted", "empty")
Item = TypeVar("Item")  # what a check cuts: groups of answers, or completions


@dataclass(frozen=True)
class TermCheck:
    """One term under one way of cutting the step: its relative L2 distance from the whole batch's gradient."""

    term: str
    split: str
    rel_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_diff <= self.tolerance


@dataclass
class ObjectiveReport:
    """Every term under every split, packed against unpacked, and the negative control."""

    objective: str
    groups: int
    k: int
    checks: list[TermCheck] = field(default_factory=list)
    packing: float = 0.0  # packed rows against one document a row, whole objective
    control: float = 0.0  # packed rows without isolation against with it: must be far from 0
    tolerance: float = 1e-5

    @property
    def broken(self) -> list[TermCheck]:
        return [check for check in self.checks if not check.ok]

    @property
    def control_seen(self) -> bool:
        return self.control > 10 * self.tolerance

    @property
    def across_ranks(self) -> bool:
        return any(check.split == "ranks" for check in self.checks)

    @property
    def equivalent(self) -> bool:
        return not self.broken and self.packing <= self.tolerance and self.control_seen

    def format(self) -> str:
        lines = [f"objective {self.objective}: {self.groups} groups, K {self.k}, tolerance {self.tolerance:g}"]
        for check in self.checks:
            mark = "ok" if check.ok else "BROKEN"
            lines.append(f"  term {check.term:<11} split {check.split:<9} rel L2 {check.rel_diff:.2e}  {mark}")
        if not self.across_ranks:
            lines.append(f"  packed vs one document a row   rel L2 {self.packing:.2e}")
            seen = "differs, as it must" if self.control_seen else "does NOT differ: the check cannot see a leak"
            lines.append(f"  negative control (packed rows without isolation) rel L2 {self.control:.2e}: {seen}")
        if self.equivalent:
            lines.append("verdict: EQUIVALENT")
        else:
            named = ", ".join(f"{c.term} ({c.split})" for c in self.broken) or "packing"
            lines.append(f"verdict: NOT EQUIVALENT: {named}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "groups": self.groups,
            "k": self.k,
            "tolerance": self.tolerance,
            "equivalent": self.equivalent,
            "checks": [check.__dict__ for check in self.checks],
            "packing_rel_diff": self.packing,
            "control_rel_diff": self.control,
        }


def only_term(objective: Objective, name: str) -> Objective:
    """``objective`` with every term but ``name`` weighted 0 (the engine leaves a term of scale 0 out)."""
    alone = copy.copy(objective)
    alone.terms = tuple(t if t.name == name else replace(t, weight=0.0) for t in objective.terms)
    return alone


def split_sizes(split: str, n: int, k: int) -> list[int]:
    """Groups per micro-batch for ``split`` of ``n`` groups in about ``k`` micro-batches."""
    if split in ("equal", "permuted"):
        base, extra = divmod(n, k)
        return [base + (1 if i < extra else 0) for i in range(k)]
    if split == "unequal":
        sizes: list[int] = []
        size = 1
        while sum(sizes) + size < n:
            sizes.append(size)
            size += 1
        return [*sizes, n - sum(sizes)]
    if split == "empty":
        return [n - n // 2, 0, n // 2]
    raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")


def objective_gradient(
    model: nn.Module,
    objective: Objective,
    batches: list[Any],
    device: torch.device,
    precision: str = "fp32",
    dist: Any = None,
) -> torch.Tensor:
    """The accumulated gradient of ``objective`` over ``batches`` (a copy of ``model``; fp16 unscaled); with a
    ``dist`` of several ranks, through DDP and its one sync, every rank calling it with its own ``batches``."""
    from bigbatch.parallel.distributed import DDPGradSync

    replica = copy.deepcopy(model)
    trained: nn.Module = replica
    sync = None
    if dist is not None and dist.world_size > 1:
        trained = nn.parallel.DistributedDataParallel(
            replica, device_ids=[device.index] if device.type == "cuda" else None
        )
        sync = DDPGradSync(trained)
    engine = AccumulationEngine(
        trained,
        torch.optim.SGD([p for p in replica.parameters() if p.requires_grad], lr=1.0),
        constant_schedule(1.0),
        grad_clip=0.0,
        precision=precision,
        device=device,
        objective=objective,
        grad_sync=sync,
        dist=dist,
    )
    replica.zero_grad(set_to_none=True)
    with preserved_rng():
        engine.accumulate(batches)
    if engine.scaler.is_enabled():
        engine.scaler.unscale_(engine.optimizer)
    grads = [p.grad.reshape(-1).double() for p in replica.parameters() if p.requires_grad and p.grad is not None]
    return torch.cat(grads) if grads else torch.zeros(1, dtype=torch.float64)


def check_groups(objective: str, groups: int, vocab_size: int, seed: int, seq_len: int) -> list[Group]:
    """The random groups the check cuts: pairs, or KTO rows for ``kto``, each document fitting a row of ``seq_len``."""
    answer_max = max(1, min(8, seq_len // 3))
    prompt_max = max(1, min(6, seq_len - 2 * answer_max))
    make = random_kto_rows if objective == "kto" else random_pairs
    return make(groups, vocab_size, seed, prompt_max, answer_max)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def verify_reference(model: nn.Module, settings: PreferenceSettings, seed: int = 0) -> ReferencePolicy | None:
    """The reference policy the check uses: the model with its LoRA adapters off when it has adapters, else a
    frozen copy of the model with its weights moved a little (so that the policy and the reference differ, as they
    do a few steps into training); ``None`` for an objective without one."""
    if not settings.needs_reference:
        return None
    if has_lora(model):
        return ReferencePolicy()
    frozen = copy.deepcopy(model)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for param in frozen.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param))
    return ReferencePolicy(frozen)


def check_objective_terms(
    model: nn.Module,
    objective: PreferenceObjective,
    *,
    groups: int,
    k: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    tolerance: float | None = None,
    splits: tuple[str, ...] = SPLITS,
) -> ObjectiveReport:
    """Each term of ``objective`` on ``model`` (see the module docstring; :func:`verify_reference` gives the
    reference policy the command uses)."""
    device = torch.device(device)
    model = model.to(device)
    if objective.reference is not None and objective.reference.module is not None:
        objective.reference.module.to(device)
    settings = objective.settings
    all_groups = check_groups(settings.name, groups, vocab_size, seed, seq_len)
    tol = tolerance if tolerance is not None else (1e-5 if precision == "fp32" else 2e-2)
    report = ObjectiveReport(settings.name, groups, k, tolerance=tol)

    def batches(parts: list[list[Group]], packed: bool = True, isolated: bool = True) -> list[Any]:
        return [answer_micro_batch(part, seq_len, packed, rows=2, isolated=isolated) for part in parts]

    whole = batches([all_groups])
    for term in objective.terms:
        alone = only_term(objective, term.name)
        expected = objective_gradient(model, alone, whole, device, precision)
        for split in splits:
            ordered = list(all_groups)
            if split == "permuted":
                random.Random(seed).shuffle(ordered)
            parts = split_groups(ordered, split_sizes(split, len(ordered), k))
            got = objective_gradient(model, alone, batches(parts), device, precision)
            report.checks.append(TermCheck(term.name, split, _rel(got, expected), tol))
    full = objective_gradient(model, objective, whole, device, precision)
    unpacked = objective_gradient(model, objective, batches([all_groups], packed=False), device, precision)
    report.packing = _rel(full, unpacked)
    leaky = objective_gradient(model, objective, batches([all_groups], isolated=False), device, precision)
    report.control = _rel(leaky, full)
    return report


def rank_parts(groups: list[Item], world: int, rank: int, k: int) -> list[list[Item]]:
    """This rank's micro-batches of ``groups`` across ``world`` ranks, each ``k`` micro-batches: uneven on purpose.
    Rank 0 holds one group and then empty micro-batches (a rank whose micro-batches hold no pair); the other ranks
    share the rest unevenly (1, 2, 3, ... groups a micro-batch)."""
    if rank == 0:
        return [groups[:1]] + [[] for _ in range(k - 1)]
    rest = groups[1:]
    share = [rest[i] for i in range(len(rest)) if i % (world - 1) == rank - 1]
    sizes = [min(len(share), i + 1) for i in range(k - 1)]
    parts, at = [], 0
    for size in sizes:
        parts.append(share[at : at + size])
        at += size
    parts.append(share[at:])
    return parts


def check_objective_across_ranks(
    model: nn.Module,
    objective: PreferenceObjective,
    dist: Any,
    *,
    groups: int,
    k: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    tolerance: float = 1e-5,
) -> ObjectiveReport:
    """Under torchrun, every rank alike: each term's gradient after DDP's one sync, with uneven groups per rank (rank
    0 holds one, then micro-batches of none), against one process holding every group in one micro-batch."""
    device = torch.device(device)
    model = model.to(device)
    if objective.reference is not None and objective.reference.module is not None:
        objective.reference.module.to(device)
    all_groups = check_groups(objective.settings.name, groups, vocab_size, seed, seq_len)
    mine = [
        answer_micro_batch(part, seq_len, True, rows=2)
        for part in rank_parts(all_groups, dist.world_size, dist.rank, k)
    ]
    whole = [answer_micro_batch(all_groups, seq_len, True, rows=2)]
    report = ObjectiveReport(
        f"{objective.settings.name} across {dist.world_size} ranks", groups, k, tolerance=tolerance
    )
    for term in objective.terms:
        alone = only_term(objective, term.name)
        expected = objective_gradient(model, alone, whole, device)
        got = objective_gradient(model, alone, mine, device, dist=dist)
        report.checks.append(TermCheck(term.name, "ranks", _rel(got, expected), tolerance))
    report.control = math.inf  # no packing comparison across ranks: the one-process check makes it
    return report
