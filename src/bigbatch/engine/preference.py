"""Preference objectives over answers: DPO, IPO, SimPO, ORPO and KTO, each exact under accumulation.

A micro-batch of preference data marks its answers (:class:`~bigbatch.engine.batch.Answers`): each pair's chosen
and rejected answer, each KTO row's completion and its KL answer (the row's prompt with the next row's
completion). One forward gives every answer's summed log-probability ``log pi(y|x)`` (the chunked head, per
answer: the logits are never held whole). The terms and their units:

* ``dpo`` per pair: ``-(1-e) log s(b h) - e log s(-b h)`` with ``h = (log pi(c) - log ref(c)) - (log pi(r) -
  log ref(r))`` and label smoothing ``e`` (conservative DPO); ``robust`` divides by ``1 - 2e`` and flips the sign
  of the second part (robust DPO, Chowdhury et al. 2024).
* ``ipo`` per pair: ``(h - 1/(2b))^2`` with log-probabilities averaged over each answer's tokens (as TRL defines it,
  after its authors; Azar et al. write sequence sums).
* ``simpo`` per pair: ``-log s(b (avg log pi(c) - avg log pi(r)) - gamma)``: length-normalised, no reference.
* ``orpo``: ``nll`` per chosen-answer token (the SFT term) plus ``odds_ratio`` per pair, weighted by lambda:
  ``-log s(log odds(c) - log odds(r))`` with ``odds = p / (1 - p)`` of the answer's mean token log-probability.
  The two terms have different units: each is normalised by its own count over the whole step.
* ``kto`` per completion (KL answers are not trained): ``w_D (1 - s(b (r - z)))`` for a desirable one,
  ``w_U (1 - s(b (z - r)))`` for an undesirable one, ``r = log pi - log ref``, with the reference point
  ``z = max(0, mean over the step's KL answers of r)``: one statistic of the whole step (every micro-batch on every
  rank), taken in the statistics pass without gradients, never per micro-batch.

The reference log-probabilities (DPO, IPO, KTO) come from the statistics pass too, once per step: from the same
model with its LoRA adapters switched off (no second copy in memory), or from a frozen reference model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.engine.batch import (
    ROLE_CHOSEN,
    ROLE_DESIRABLE,
    ROLE_KL,
    ROLE_REJECTED,
    ROLE_UNDESIRABLE,
    MicroBatch,
)
from bigbatch.engine.objective import Objective, StepPass, Term, restored
from bigbatch.engine.rng import preserved_rng
from bigbatch.errors import ConfigError
from bigbatch.models.lm_output import computes_loss, segment_logits_losses
from bigbatch.models.lora import adapters_off

PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")
NEEDS_REFERENCE = ("dpo", "ipo", "kto")
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1, "kto": 0.1}
"""beta's default per objective (ORPO's is its lambda, the odds-ratio term's weight), as their papers use them."""


@dataclass(frozen=True)
class PreferenceSettings:
    """``name`` one of :data:`PREFERENCE_OBJECTIVES`; ``beta`` (``None``: :data:`DEFAULT_BETA`; ORPO: lambda);
    ``label_smoothing`` and ``robust`` for DPO; ``gamma`` SimPO's target margin; KTO's weights of desirable and
    undesirable completions."""

    name: str
    beta: float | None = None
    label_smoothing: float = 0.0
    robust: bool = False
    gamma: float = 1.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in PREFERENCE_OBJECTIVES:
            raise ConfigError(f"objective must be one of lm, {', '.join(PREFERENCE_OBJECTIVES)}; got {self.name!r}")
        if self.beta is not None and not (self.beta > 0 and math.isfinite(self.beta)):
            raise ConfigError(f"--beta must be a positive number, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if (self.label_smoothing or self.robust) and self.name != "dpo":
            raise ConfigError(f"--label-smoothing and --robust are DPO's; drop them for --objective {self.name}")
        if self.robust and not self.label_smoothing:
            raise ConfigError("--robust corrects for --label-smoothing; give --label-smoothing E (0 < E < 0.5)")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ConfigError("--desirable-weight and --undesirable-weight must be positive")
        for flag, value, owner, whose in (
            ("--simpo-gamma", self.gamma, "simpo", "SimPO's"),
            ("--desirable-weight", self.desirable_weight, "kto", "KTO's"),
            ("--undesirable-weight", self.undesirable_weight, "kto", "KTO's"),
        ):
            if value != 1.0 and self.name != owner:  # another objective's parameter, moved from its default
                raise ConfigError(f"{flag} is {whose}; drop it for --objective {self.name}")

    @property
    def b(self) -> float:
        return self.beta if self.beta is not None else DEFAULT_BETA[self.name]

    @property
    def needs_reference(self) -> bool:
        return self.name in NEEDS_REFERENCE

    @property
    def reads(self) -> str:
        """The answers the objective reads: ``pairs`` or ``kto`` rows."""
        return "kto" if self.name == "kto" else "pairs"


def answer_losses(model: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Each answer's summed cross-entropy ``-log pi(answer | prompt)`` (S,) fp32: bigbatch's families and ``hf:``
    models through their chunked head (never the whole logits), any other model from its logits."""
    assert batch.answers is not None
    segments = batch.answers.segment
    if computes_loss(model):  # every answer of the micro-batch, also a last one without a target (S,)
        losses = model(batch.inputs, targets=batch.targets, positions=batch.positions, segments=segments)
        return _padded(losses, batch.answers.count)
    if batch.positions is not None:
        raise ValueError(f"{type(model).__name__} does not take packed rows (positions); use --pack off")
    output = model(batch.inputs)
    logits = getattr(output, "logits", output)
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits  # (B, T, V)
    losses = segment_logits_losses(logits, batch.targets, segments)
    # every answer of the micro-batch, also one whose targets fall outside (S,)
    return _padded(losses, batch.answers.count)


def _padded(values: torch.Tensor, count: int) -> torch.Tensor:
    if values.numel() >= count:
        return values[:count]
    return torch.cat([values, values.new_zeros(count - values.numel())])


def answer_lengths(batch: MicroBatch) -> torch.Tensor:
    """Each answer's trained tokens (S,) float32."""
    assert batch.answers is not None
    segment = batch.answers.segment
    inside = segment[segment >= 0]
    return torch.bincount(inside, minlength=batch.answers.count).float()[: batch.answers.count]


def _by_group(batch: MicroBatch, role: int) -> torch.Tensor:
    """The answers of ``role`` in the order of their groups (G,) int64."""
    assert batch.answers is not None
    answers = batch.answers
    found = (answers.role == role).nonzero().squeeze(1)
    return found[torch.argsort(answers.group[found])]


def pair_indices(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's chosen and rejected answer (G,), (G,), checked to be of the same groups."""
    chosen, rejected = _by_group(batch, ROLE_CHOSEN), _by_group(batch, ROLE_REJECTED)
    assert batch.answers is not None
    group = batch.answers.group
    if chosen.numel() != rejected.numel() or not torch.equal(group[chosen], group[rejected]):
        raise ValueError("a micro-batch holds a preference pair without both its answers (a split pair)")
    return chosen, rejected


class ReferencePolicy:
    """Where the reference log-probabilities come from: ``adapters`` (the trained model with its LoRA adapters off),
    or ``module`` (a frozen model of its own, e.g. ``--reference DIR``)."""

    def __init__(self, module: nn.Module | None = None) -> None:
        self.module = module
        if module is not None:
            module.eval()  # a reference draws no dropout
            for param in module.parameters():
                param.requires_grad_(False)

    def describe(self, model: nn.Module) -> str:
        return "a frozen reference model" if self.module is not None else "the base model, LoRA adapters off"

    def losses(self, model: nn.Module, batch: MicroBatch) -> torch.Tensor:
        if self.module is not None:
            return answer_losses(self.module, batch)
        with adapters_off(model) as off:
            if not off:
                raise ConfigError(
                    "a reference policy needs --lora-rank (the base model with adapters off) or --reference DIR "
                    "(a frozen model); the trained model itself moves"
                )
            return answer_losses(model, batch)


@dataclass
class ReferenceTable:
    """Every answer's ``-log ref(answer | prompt)`` computed once, by the split's reader (``source``) and document:
    the statistics pass reads it instead of running the reference (``--reference-logps once``). ``nan`` marks a
    document not computed (never an answer's)."""

    values: dict[str, torch.Tensor]  # source -> (n_documents,) float64 on the host
    key: str = ""  # what it was computed for: the reference and the data (a table of another key is not read)

    def lookup(self, batch: MicroBatch) -> torch.Tensor | None:
        """The micro-batch's answers' values (S,) float32, or ``None`` when it cannot say for all of them."""
        answers = batch.answers
        if answers is None or answers.document is None or answers.source not in self.values:
            return None
        found = self.values[answers.source][answers.document.cpu()]
        if bool(torch.isnan(found).any()):
            return None
        return found.float()


def compute_reference_table(
    reference: ReferencePolicy,
    model: nn.Module,
    readers: dict[str, Any],
    dist: Any,
    device: torch.device,
    autocast: Any,
    key: str = "",
) -> ReferenceTable:
    """A :class:`ReferenceTable` of every document of each reader's split (``readers``: source -> a reader of whole
    units, ``n_docs``, ``plan()``, ``read_unit(u)``), each rank computing every ``world_size``-th unit and one
    all-reduce per split bringing them together; without gradients, in eval mode, the generators as they were."""
    values: dict[str, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), preserved_rng():
            for source, reader in readers.items():
                table = torch.zeros(reader.n_docs + 1, dtype=torch.float64, device=device)  # the last: a count
                units = reader.plan(0).units
                # every rank runs as many forwards (FSDP gathers each layer with all of them): past the end, a
                # micro-batch of padding alone
                for first in range(0, units, dist.world_size):
                    batch = reader.read_unit(first + dist.rank if first + dist.rank < units else -1)
                    assert batch.answers is not None and batch.answers.document is not None
                    with autocast():
                        losses = reference.losses(model, batch.to(device, non_blocking=True)).double()
                    table[batch.answers.document.to(device)] = losses
                    table[-1] += float(batch.answers.count)
                if dist.world_size > 1:
                    table = dist.all_reduce_sum(table)
                if int(table[-1].item()) != reader.n_docs:
                    raise RuntimeError(
                        f"the reference pass over the {source} split scored {int(table[-1].item())} of its "
                        f"{reader.n_docs} answers"
                    )
                values[source] = table[:-1].cpu()
    finally:
        model.train(was_training)
    return ReferenceTable(values, key)


class PreferenceObjective(Objective):
    """One of the preference objectives over answers (see the module docstring)."""

    def __init__(self, settings: PreferenceSettings, reference: ReferencePolicy | None = None) -> None:
        self.settings = settings
        if settings.needs_reference and reference is None:
            raise ConfigError(f"--objective {settings.name} needs a reference policy")
        self.reference = reference
        beta = settings.b
        if settings.name == "orpo":
            self.terms = (Term("nll", "token"), Term("odds_ratio", "pair", beta))
        elif settings.name == "kto":
            self.terms = (Term("kto", "sequence"),)
        else:
            self.terms = (Term(settings.name, "pair"),)
        self.table: ReferenceTable | None = None  # the reference computed once (--reference-logps once)
        self.reference_weights = ""  # a fingerprint of the reference's weights, for the table's key
        self._z = 0.0  # KTO: the step's reference point
        # This rank's sums of the step's rewards (on the device: no sync per micro-batch): pairs: chosen, rejected,
        # chosen over rejected, pairs; KTO: desirable, how many, undesirable, how many.
        self._stats = torch.zeros(4, dtype=torch.float64)

    def units(self, batch: Any) -> dict[str, float]:
        answers = batch.answers
        if answers is None:
            raise ValueError(self._no_answers())
        role = answers.role
        if self.settings.name == "kto":
            return {"sequence": float(((role == ROLE_DESIRABLE) | (role == ROLE_UNDESIRABLE)).sum())}
        units = {"pair": float((role == ROLE_CHOSEN).sum())}
        if self.settings.name == "orpo":
            chosen = (role == ROLE_CHOSEN).nonzero().squeeze(1)
            segment = answers.segment
            units["token"] = float(torch.isin(segment, chosen).sum()) if chosen.numel() else 0.0
        return units

    # ---- the statistics pass ------------------------------------------------------------------------------------

    def begin_step(self, step: StepPass) -> None:
        """The reference log-probabilities of every micro-batch's answers and, for KTO, the step's reference point
        ``z``: without gradients, the generators as they were (the training pass draws what it would have)."""
        self._stats = torch.zeros(4, dtype=torch.float64, device=step.device)
        if not self.settings.needs_reference:
            return
        kl_sum = torch.zeros(2, dtype=torch.float64, device=step.device)  # (sum of KL answers' log ratios, count)
        with torch.no_grad(), preserved_rng():
            for micro_batch in step.micro_batches:
                if micro_batch.answers is None:
                    raise ValueError(self._no_answers())
                batch = micro_batch.to(step.device, non_blocking=True)
                reference = self._reference_losses(step, batch)
                micro_batch.answers.reference = reference.detach().cpu()  # travels with the micro-batch
                if self.settings.name != "kto":
                    continue
                assert batch.answers is not None
                kl = (batch.answers.role == ROLE_KL).nonzero().squeeze(1)
                # every rank runs this forward, also without a KL answer: FSDP gathers each layer with all of them
                with step.autocast():
                    policy = answer_losses(step.model, batch).float()
                ratio = (reference[kl] - policy[kl]).double()  # log pi - log ref, per KL answer
                kl_sum += torch.stack([ratio.sum(), ratio.new_tensor(float(kl.numel()))])
        if self.settings.name == "kto":
            total = step.dist.all_reduce_sum(kl_sum).tolist() if step.dist.world_size > 1 else kl_sum.tolist()
            self._z = max(0.0, total[0] / total[1]) if total[1] > 0 else 0.0

    def _reference_losses(self, step: StepPass, batch: MicroBatch) -> torch.Tensor:
        """``-log ref`` of each answer of ``batch`` (S,) fp32: from the table when it holds them, else a forward of
        the reference policy."""
        if self.table is not None:
            found = self.table.lookup(batch)
            if found is not None:
                return found.to(step.device)
        if self.reference is None:
            source = batch.answers.source if batch.answers is not None else ""
            raise RuntimeError(f"no reference log-probabilities for answers of {source or 'this data'}")
        with step.autocast():
            return self.reference.losses(step.model, batch).float()

    def kept(self) -> Any:
        return restored(self, "_stats")

    # ---- the terms ---------------------------------------------------------------------------------------------

    def sums(self, model: nn.Module, batch: Any, index: int) -> dict[str, torch.Tensor]:
        losses = answer_losses(model, batch)  # (S,) -log pi
        logp = -losses
        name, beta = self.settings.name, self.settings.b
        if name == "kto":
            return {"kto": self._kto(batch, logp, self._reference_logp(index, batch))}
        chosen, rejected = pair_indices(batch)
        if name in ("simpo", "orpo", "ipo"):
            lengths = answer_lengths(batch).clamp_min(1.0)
            mean_logp = logp / lengths  # (S,)
        if name == "simpo":
            margin = beta * (mean_logp[chosen] - mean_logp[rejected]) - self.settings.gamma
            self._record_pairs(beta * mean_logp[chosen], beta * mean_logp[rejected])
            return {"simpo": -F.logsigmoid(margin).sum()}
        if name == "orpo":
            log_odds = _log_odds(mean_logp[chosen]) - _log_odds(mean_logp[rejected])
            self._record_pairs(beta * mean_logp[chosen], beta * mean_logp[rejected])
            return {"nll": losses[chosen].sum(), "odds_ratio": -F.logsigmoid(log_odds).sum()}
        ref = self._reference_logp(index, batch)
        if name == "ipo":
            ref_mean = ref / lengths
            h = (mean_logp[chosen] - ref_mean[chosen]) - (mean_logp[rejected] - ref_mean[rejected])
            self._record_pairs(beta * (logp - ref)[chosen], beta * (logp - ref)[rejected])
            return {"ipo": ((h - 1.0 / (2.0 * beta)) ** 2).sum()}
        chosen_reward = beta * (logp[chosen] - ref[chosen])
        rejected_reward = beta * (logp[rejected] - ref[rejected])
        self._record_pairs(chosen_reward, rejected_reward)
        logits = chosen_reward - rejected_reward
        eps = self.settings.label_smoothing
        loss = -(1.0 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
        if self.settings.robust:
            loss = (-(1.0 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1.0 - 2.0 * eps)
        return {"dpo": loss.sum()}

    def _reference_logp(self, index: int, batch: MicroBatch) -> torch.Tensor:
        """``log ref`` of each answer of ``batch`` (S,), as the step's statistics pass put it on the micro-batch."""
        assert batch.answers is not None
        reference = batch.answers.reference
        if reference is None:
            raise RuntimeError(f"no reference log-probabilities for micro-batch {index}: begin_step did not run")
        return -reference.to(batch.inputs.device)

    def _no_answers(self) -> str:
        return f"--objective {self.settings.name} reads answers ({self.settings.reads}); this data has none"

    def _kto(self, batch: MicroBatch, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        assert batch.answers is not None
        role = batch.answers.role
        beta, z = self.settings.b, self._z
        ratio = logp - ref  # (S,)
        desirable, undesirable = role == ROLE_DESIRABLE, role == ROLE_UNDESIRABLE
        loss_d = self.settings.desirable_weight * (1.0 - torch.sigmoid(beta * (ratio - z)))
        loss_u = self.settings.undesirable_weight * (1.0 - torch.sigmoid(beta * (z - ratio)))
        rewards = (beta * ratio).detach().double()
        self._stats += torch.stack(
            [rewards[desirable].sum(), desirable.sum().double(), rewards[undesirable].sum(), undesirable.sum().double()]
        ).to(self._stats.device)
        return loss_d[desirable].sum() + loss_u[undesirable].sum()

    def _record_pairs(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        chosen, rejected = chosen.detach().double(), rejected.detach().double()
        right = (chosen > rejected).double().sum()
        count = torch.tensor(float(chosen.numel()), dtype=torch.float64, device=chosen.device)
        self._stats += torch.stack([chosen.sum(), rejected.sum(), right, count]).to(self._stats.device)

    def local_statistics(self) -> list[float]:
        return [float(v) for v in self._stats.tolist()]

    def statistics(self, values: Sequence[float]) -> dict[str, float]:
        if len(values) < 4:
            return {}
        if self.settings.name == "kto":
            d_sum, d_n, u_sum, u_n = values[:4]
            return {
                "rewards/desirable": d_sum / d_n if d_n else math.nan,
                "rewards/undesirable": u_sum / u_n if u_n else math.nan,
                "kl": self._z,
            }
        chosen, rejected, right, pairs = values[:4]
        if not pairs:
            return {}
        return {
            "rewards/chosen": chosen / pairs,
            "rewards/rejected": rejected / pairs,
            "rewards/margin": (chosen - rejected) / pairs,
            "rewards/accuracy": right / pairs,
        }

    def describe(self) -> list[str]:
        s = self.settings
        parts = [term.describe() for term in self.terms]
        extra = f"beta {s.b:g}"
        if s.name == "dpo" and s.label_smoothing:
            extra += f", label smoothing {s.label_smoothing:g}" + (" (robust)" if s.robust else "")
        if s.name == "simpo":
            extra += f", gamma {s.gamma:g}"
        if s.name == "kto":
            extra += f", weights {s.desirable_weight:g}/{s.undesirable_weight:g}, reference point over the step"
        return [f"objective | {s.name}: {' + '.join(parts)} | {extra}"]


def _log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of ``p = exp(mean_logp)`` (< 1), stable: ``mean_logp - log1p(-exp(mean_logp))``."""
    return mean_logp - torch.log1p(-torch.exp(mean_logp.clamp(max=-1e-6)))
