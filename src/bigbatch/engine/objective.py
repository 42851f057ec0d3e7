"""An objective: a sum of loss terms, each normalised by its own units over the whole optimizer step.

A term names its unit, one of :data:`UNITS`: ``token`` (a next-token loss, a per-token KL), ``sequence`` (one
answer), ``pair`` (a chosen and a rejected answer), ``group`` (a prompt's completions) or ``none`` (a value that
does not depend on the data: it is averaged over the step's micro-batches, so a micro-batch of the whole step gives
it once). For a micro-batch ``m`` the objective returns each term's *sum* ``S_t(m)`` of its per-unit losses, and
what the micro-batch holds of each unit. The engine counts each unit over all K micro-batches on all ranks before
the first backward (one all-reduce for all of them) and back-propagates

    sum over terms t of  weight_t x S_t(m) x world_size / N_unit(t)

in one place (:class:`~bigbatch.engine.accumulate.AccumulationEngine`): the K backward passes add up and DDP's
average over ranks undoes ``world_size``, so the gradient is that of ``sum_t weight_t x (step's S_t) / N_t``: each
term's mean over its own units of the whole step, whatever the split. A term must never divide by K or the world
size itself (the field's most common accumulation bug), and a statistic of the step (an MoE's expert counts, KTO's
reference point, a reference model's log-probabilities) is computed in :meth:`Objective.begin_step`, a pass
without gradients over the step's micro-batches, never per micro-batch.

A term with no units anywhere in the step adds nothing (the engine says so once per term); a step where no term
has a unit holds nothing to train on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from bigbatch.models.head_loss import IGNORE_INDEX
from bigbatch.parallel.distributed import DistContext

UNITS = ("token", "sequence", "pair", "group", "none")
"""What a term's loss is a mean over. ``none``: the step's micro-batches (a constant term is added once)."""


@dataclass(frozen=True)
class Term:
    """One loss term: its ``name`` (in records), its ``unit`` and its ``weight`` in the objective. An
    ``auxiliary`` term (an MoE router's) is optimised but logged apart from the step's loss."""

    name: str
    unit: str
    weight: float = 1.0
    auxiliary: bool = False

    def describe(self) -> str:
        """``odds_ratio per pair x 0.1``."""
        return f"{self.name} per {self.unit}" + (f" x {self.weight:g}" if self.weight != 1 else "")

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"term {self.name!r}: unit must be one of {', '.join(UNITS)}, got {self.unit!r}")


@dataclass(frozen=True)
class StepTotals:
    """Each unit's count over the whole step (every micro-batch on every rank); ``primary`` is the unit of the
    objective's first term (what a bad step's per-unit values count); ``targets`` the step's valid target tokens
    whatever the objective (what a step's ``tokens`` and throughput count)."""

    counts: Mapping[str, float]
    primary: str = "token"
    targets: int = 0

    def of(self, unit: str) -> float:
        return float(self.counts.get(unit, 0.0))

    @property
    def primary_count(self) -> int:
        return int(round(self.of(self.primary)))

    @property
    def empty(self) -> bool:
        """No unit of any kind: nothing of the step can be trained."""
        return not any(value > 0 for unit, value in self.counts.items() if unit != "none")

    def as_dict(self) -> dict[str, float]:
        return {unit: float(value) for unit, value in self.counts.items()}


@dataclass
class StepPass:
    """What :meth:`Objective.begin_step` gets: the step's micro-batches (this rank's, on the host), the totals,
    and how to run a forward the way the training pass will (on the device, under the engine's autocast)."""

    model: nn.Module
    micro_batches: Sequence[Any]
    totals: StepTotals
    dist: DistContext
    device: torch.device
    autocast: Callable[[], AbstractContextManager[Any]]


@dataclass(frozen=True)
class ObjectiveMeasurement:
    """The step's terms (each a mean over its own units of the whole step, before its weight) and the
    objective's own statistics (rewards, margins, accuracies: means over the step), for the step's record."""

    terms: Mapping[str, float]
    values: Mapping[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        out = {f"term/{name}": value for name, value in self.terms.items()}
        out.update(self.values)
        return out


class Objective(ABC):
    """Base of every objective (see the module docstring). A subclass sets :attr:`terms` (the first is the
    primary one), and implements :meth:`units` and :meth:`sums`; :meth:`begin_step` is its statistics pass."""

    terms: tuple[Term, ...] = ()

    def bind(self, model: nn.Module, dist: DistContext, device: torch.device) -> None:
        """Called once by the engine that will run it (an objective may depend on the model it trains)."""
        return None  # an objective that does not is not told

    @property
    def primary(self) -> Term:
        return self.terms[0]

    def unit_names(self) -> list[str]:
        """The units the terms use, each once, in the order of the terms (``none`` counted by the engine)."""
        return list(dict.fromkeys(term.unit for term in self.terms))

    @abstractmethod
    def units(self, batch: Any) -> dict[str, float]:
        """What micro-batch ``batch`` holds of each unit its terms use (``none`` excepted)."""

    def targets(self, batch: Any) -> float:
        """The valid target tokens of ``batch`` (what throughput counts), whatever the terms' units."""
        targets = getattr(batch, "targets", None)
        return float((targets != IGNORE_INDEX).sum()) if isinstance(targets, torch.Tensor) else 0.0

    def totals_for_tokens(self, n_valid: int) -> StepTotals | None:
        """The step's totals from its valid targets alone, when they say everything (a token-only objective whose
        tokens are the valid targets): the caller that already knows them saves an all-reduce. ``None`` when
        the step's micro-batches must be counted."""
        return None

    def begin_step(self, step: StepPass) -> None:
        """The statistics pass before the first backward of a step (no gradients)."""
        return None  # an objective without a statistic of the step has none to take

    @abstractmethod
    def sums(self, model: nn.Module, batch: Any, index: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``index``'s sum ``S_t`` of every term (0-d tensors with their graphs), by term name."""

    def kept(self) -> AbstractContextManager[Any]:
        """Around a re-run of a micro-batch (a replay, a check): what the step has measured stays as it was."""
        return nullcontext()

    def end_step(self) -> dict[str, Any]:
        """The objective's measurements of the step (after its last micro-batch), by name, for the step's record."""
        return {}

    def describe(self) -> list[str]:
        """The header's lines: ``objective | lm per token``, and any others the objective needs to say."""
        parts = [term.describe() for term in self.terms]
        return [f"objective | {' + '.join(parts)}"]

    def statistics(self, values: Sequence[float]) -> dict[str, float]:
        """Named means of the step from the all-reduced sums :meth:`local_statistics` gave (default: none)."""
        return {}

    def local_statistics(self) -> list[float]:
        """This rank's sums of the step's statistics (reduced with the terms' sums in one all-reduce)."""
        return []


@contextmanager
def restored(owner: Any, name: str) -> Iterator[None]:
    """Around a re-run of a micro-batch: ``owner``'s tensor ``name`` (an objective's sums of its statistics) as it
    was before, whatever the re-run added (what :meth:`Objective.kept` returns for such an objective)."""
    saved = getattr(owner, name).clone()
    try:
        yield
    finally:
        setattr(owner, name, saved)


def count_units(
    objective: Objective, micro_batches: Sequence[Any], dist: DistContext, device: torch.device
) -> StepTotals:
    """Each unit of ``objective``'s terms counted over ``micro_batches`` on every rank: one all-reduce (none for one
    process). ``none`` counts the micro-batches."""
    names = objective.unit_names()
    local = [0.0] * (len(names) + 1)  # each unit, then the valid targets
    for batch in micro_batches:
        held = objective.units(batch)
        for i, unit in enumerate(names):
            local[i] += 1.0 if unit == "none" else float(held.get(unit, 0.0))
        local[-1] += objective.targets(batch)
    if dist.world_size > 1:
        local = dist.all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=device)).tolist()
    return StepTotals(dict(zip(names, local[:-1], strict=True)), objective.primary.unit, int(local[-1]))


def term_scales(objective: Objective, totals: StepTotals, world_size: int) -> list[float]:
    """Each term's factor ``weight x world_size / N_unit``; 0 for a term whose unit the step does not hold."""
    scales = []
    for term in objective.terms:
        units = totals.of(term.unit)
        scales.append(term.weight * world_size / units if units > 0 else 0.0)
    return scales


def objective_value(sums: Mapping[str, torch.Tensor], terms: Sequence[Term], scales: Sequence[float]) -> torch.Tensor:
    """``sum_t S_t x scale_t`` over the terms with units (a term without any is left out: never ``0 x inf``)."""
    total: torch.Tensor | None = None
    for term, scale in zip(terms, scales, strict=True):
        if scale == 0.0:
            continue
        part = sums[term.name] * scale
        total = part if total is None else total + part
    if total is None:  # no term has units: a zero that still reaches every parameter (DDP needs a backward)
        total = sum(s * 0.0 for s in sums.values())  # type: ignore[assignment]
    assert isinstance(total, torch.Tensor)
    return total


def step_loss(objective: Objective, term_sums: Sequence[float], totals: StepTotals) -> float:
    """The step's loss: the weighted means of its terms that are not auxiliary (a term without units adds 0)."""
    loss = 0.0
    for term, value in zip(objective.terms, term_sums, strict=True):
        units = totals.of(term.unit)
        if not term.auxiliary and units > 0:
            loss += term.weight * value / units
    return loss


def summarize(objective: Objective, reduced: Sequence[float], totals: StepTotals) -> tuple[float, ObjectiveMeasurement]:
    """From the step's all-reduced sums (each term's, then the objective's statistics, as the engine reduces
    them): the step's loss, and each term's mean with the objective's statistics."""
    n_terms = len(objective.terms)
    term_sums, statistics = reduced[:n_terms], reduced[n_terms:]
    measurement = ObjectiveMeasurement(term_means(objective, term_sums, totals), objective.statistics(statistics))
    return step_loss(objective, term_sums, totals), measurement


def term_means(objective: Objective, term_sums: Sequence[float], totals: StepTotals) -> dict[str, float]:
    """Each term's mean over its units of the step, before its weight (``nan`` where the step holds none)."""
    means = {}
    for term, value in zip(objective.terms, term_sums, strict=True):
        units = totals.of(term.unit)
        means[term.name] = value / units if units > 0 else float("nan")
    return means
