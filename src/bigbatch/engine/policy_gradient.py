"""Learning from rewards (GRPO and kin): a clipped policy-gradient loss over sampled completions, its aggregation
named, and every denominator counted over the whole optimizer step.

Each completion ``i`` of prompt group ``g`` has an advantage ``A_i`` (a fact of its rollout, the same on every rank:
see :mod:`bigbatch.data.rollouts`) and, per completion token ``t``, the log-probability ``l_it`` under the policy
being trained, ``b_it`` under the policy that sampled it (the *old* policy: the trainer's own forward in the
statistics pass, before the first update of the rollout, so the ratio ``r_it = exp(l_it - b_it)`` is 1 at the first
update), and ``q_it`` under the reference. The per-token losses:

* ``ppo`` (GRPO, DAPO with ``clip_high > clip_low``): ``-min(r A, clip(r, 1 - e_low, 1 + e_high) A)``;
* ``cispo``: ``-sg(min(r, 1 + e_high)) A l`` (the importance weight clipped and detached, every token's gradient
  kept);
* ``kl`` to the reference (k3): ``exp(q - l) - (q - l) - 1``, weight ``kl_coef``;
* ``entropy`` of the policy's next-token distribution, weight ``-entropy_coef`` (a bonus).

Every term is aggregated the same named way over the whole step (all micro-batches on all ranks; ``|o_i|`` is
completion ``i``'s tokens, ``T_g`` its group's, ``N`` the step's completions, ``G`` its groups, ``C`` a constant):

* ``token-mean``: ``sum_i sum_t x_it / sum_i |o_i|`` (unit ``token``);
* ``group-token-mean``: ``(1/G) sum_g (1/T_g) sum_{i in g} sum_t x_it`` (unit ``group``);
* ``seq-mean-token-mean``: ``(1/N) sum_i (1/|o_i|) sum_t x_it`` (unit ``sequence``);
* ``seq-mean-token-sum``: ``(1/N) sum_i sum_t x_it`` (unit ``sequence``);
* ``seq-mean-token-sum-norm``: ``(1/(N C)) sum_i sum_t x_it`` (Dr. GRPO; unit ``sequence``).

Each is a sum over tokens with a per-completion weight (1, ``1/T_g``, ``1/|o_i|``, 1, ``1/C``) divided by a count
of units, which is what :class:`~bigbatch.engine.objective.Objective` makes exact: a micro-batch returns its
weighted sums, the engine divides by the step's count of the unit, so no mode depends on how the step is split.
``T_g`` is counted over the group's completions in the step before the step starts (wherever they land).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.batch import MicroBatch, RolloutScores
from bigbatch.engine.objective import Objective, StepPass, Term, restored
from bigbatch.engine.rng import preserved_rng
from bigbatch.errors import ConfigError
from bigbatch.models.lm_output import computes_loss, token_losses_from_logits
from bigbatch.models.lora import adapters_off
from bigbatch.settings.choices import LOSS_AGGREGATION, POLICY_LOSS

LOSS_AGGREGATIONS = LOSS_AGGREGATION.values
AGGREGATION_UNIT = {
    "token-mean": "token",
    "group-token-mean": "group",
    "seq-mean-token-mean": "sequence",
    "seq-mean-token-sum": "sequence",
    "seq-mean-token-sum-norm": "sequence",
}
"""Each aggregation's unit: what the engine counts over the step and divides its weighted token sums by."""
POLICY_LOSSES = POLICY_LOSS.values
LOG_RATIO_BOUND = 20.0
"""The log-ratio's bound (as verl bounds it): exp(20) is far outside any clip, and finite in fp32."""

# The step's statistics, summed on the device per micro-batch (no sync) and all-reduced with the terms' sums.
STAT_NAMES = (
    "completions",
    "reward",
    "reward_sq",
    "advantage_sq",
    "tokens",
    "clipped",
    "entropy",
    "kl",
    "ratio_dev",
)


@dataclass(frozen=True)
class RewardLossSettings:
    """The loss of learning from rewards: ``aggregation`` one of :data:`LOSS_AGGREGATIONS`, ``policy_loss`` one
    of :data:`POLICY_LOSSES`, the clip bounds, the KL and entropy coefficients (0: the term is left out, its value
    still reported where it can be), ``norm_constant`` (``C`` of ``seq-mean-token-sum-norm``) and the sampling
    ``temperature`` (the ratio, KL and entropy are of the distribution the completions were drawn from, as TRL and
    verl take them)."""

    aggregation: str = "token-mean"
    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    norm_constant: float = 1.0
    temperature: float = 1.0  # the sampler's: every log-probability and entropy is of the logits divided by it

    def __post_init__(self) -> None:
        if self.aggregation not in LOSS_AGGREGATIONS:
            raise ConfigError(
                f"--loss-aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}; got {self.aggregation!r}"
            )
        if self.policy_loss not in POLICY_LOSSES:
            raise ConfigError(f"--policy-loss must be one of {', '.join(POLICY_LOSSES)}; got {self.policy_loss!r}")
        if not (0 <= self.clip_low < 1) or not (self.clip_high >= 0) or not math.isfinite(self.clip_high):
            raise ConfigError(
                f"--clip-low must lie in [0, 1) and --clip-high be at least 0; got {self.clip_low}, {self.clip_high}"
            )
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"--temperature must be positive to score completions, got {self.temperature}")
        if not (self.norm_constant >= 0 and math.isfinite(self.norm_constant)):  # 0: set from the data before use
            raise ConfigError(f"the constant of seq-mean-token-sum-norm must be positive, got {self.norm_constant}")

    @property
    def unit(self) -> str:
        return AGGREGATION_UNIT[self.aggregation]


TokenScorer = Callable[[nn.Module, MicroBatch], torch.Tensor]
"""``(model, batch) -> (B, T, 2)``: each target's ``-log p`` and the next-token entropy (0 where no target)."""


def token_scores(model: nn.Module, batch: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """Each target's ``-log p(target)`` and the entropy of the next-token distribution, (B, T, 2) fp32, 0 where
    the target is -100, of the logits divided by ``temperature`` (the distribution the completions were sampled
    from): bigbatch's families and ``hf:`` models through their chunked head (never the whole logits), any other
    model from its logits."""
    if computes_loss(model):
        extra = {"temperature": temperature} if temperature != 1.0 else {}  # a model that predates it still works
        scores: torch.Tensor = model(
            batch.inputs, targets=batch.targets, positions=batch.positions, per_token=True, **extra
        )
        return scores
    if batch.positions is not None:
        raise ValueError(f"{type(model).__name__} does not take packed rows (positions); use --pack off")
    output = model(batch.inputs)
    logits = getattr(output, "logits", output)
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits  # (B, T, V)
    return token_losses_from_logits(logits / temperature, batch.targets)


class ReferenceScorer:
    """Where the reference's per-token log-probabilities come from: the trained model with its LoRA adapters off,
    or a frozen model of its own (``--reference DIR``, or a frozen copy of the starting model)."""

    def __init__(self, module: nn.Module | None = None) -> None:
        self.module = module
        if module is not None:
            module.eval()  # a reference draws no dropout
            for param in module.parameters():
                param.requires_grad_(False)

    def describe(self) -> str:
        return "a frozen reference model" if self.module is not None else "the base model, LoRA adapters off"

    def losses(self, model: nn.Module, batch: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
        """``-log ref`` of each target (B, T) fp32, at ``temperature``."""
        if self.module is not None:
            return token_scores(self.module, batch, temperature)[..., 0].float()
        with adapters_off(model) as off:
            if not off:
                raise ConfigError(
                    "--kl-coef needs a reference: --lora-rank (the base model with adapters off) or --reference DIR"
                )
            return token_scores(model, batch, temperature)[..., 0].float()


def score_rollout(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    device: torch.device,
    autocast: Callable[[], Any],
    reference: ReferenceScorer | None,
    temperature: float = 1.0,
) -> None:
    """The old policy's (and the reference's) log-probability of every completion token of ``micro_batches``,
    put on each micro-batch's :class:`RolloutScores` (on the host) where it has none yet: a forward without
    gradients, as the training pass runs it (its mode and autocast), the generators as they were. Every
    micro-batch gets its forward, also one without completions (FSDP gathers each layer with every rank)."""
    with torch.no_grad(), preserved_rng():
        for micro_batch in micro_batches:
            answers = micro_batch.answers
            if answers is None or answers.rollout is None:
                raise ValueError("learning from rewards reads completions; this micro-batch has none")
            scores = answers.rollout
            if scores.old_logp is not None and (reference is None or scores.ref_logp is not None):
                continue
            batch = micro_batch.to(device, non_blocking=True)
            with autocast():
                if scores.old_logp is None:
                    scores.old_logp = (-token_scores(model, batch, temperature)[..., 0].float()).cpu()
                if reference is not None and scores.ref_logp is None:
                    scores.ref_logp = (-reference.losses(model, batch, temperature)).cpu()


class RewardObjective(Objective):
    """The policy-gradient objective over completions (see the module docstring)."""

    def __init__(
        self,
        settings: RewardLossSettings,
        reference: ReferenceScorer | None = None,
        rollout_facts: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.settings = settings
        if settings.kl_coef > 0 and reference is None:
            raise ConfigError("--kl-coef needs a reference policy")
        self.reference = reference
        unit = settings.unit
        terms = [Term("policy", unit)]
        if settings.kl_coef > 0:
            terms.append(Term("kl", unit, settings.kl_coef))
        if settings.entropy_coef > 0:
            terms.append(Term("entropy", unit, -settings.entropy_coef))
        self.terms = tuple(terms)
        self.rollout_facts = rollout_facts  # what the rollout knew of the step (flat groups, generation time)
        self._stats = torch.zeros(len(STAT_NAMES), dtype=torch.float64)

    def units(self, batch: Any) -> dict[str, float]:
        scores = _scores(batch)
        segment = batch.answers.segment
        unit = self.settings.unit
        if unit == "token":
            return {"token": float((segment >= 0).sum())}
        if unit == "group":
            # each completion counts its share of its group, |o_i| / T_g (a group's shares sum to 1): a micro-batch
            # left out by a bad step takes exactly its part of its groups out of the count, wherever the group's
            # first completion lies
            count = scores.advantage.numel()
            if not count:
                return {"group": 0.0}
            lengths = torch.bincount(segment[segment >= 0], minlength=count)[:count].double()
            return {"group": float((lengths / scores.group_tokens.double().clamp_min(1.0)).sum())}
        return {"sequence": float(scores.advantage.numel())}

    def begin_step(self, step: StepPass) -> None:
        """The old policy's log-probabilities of completions not scored at their rollout (a rollout of one
        optimizer step is scored here, just before it trains), and the reference's."""
        self._stats = torch.zeros(len(STAT_NAMES), dtype=torch.float64, device=step.device)
        score_rollout(
            step.model, step.micro_batches, step.device, step.autocast, self.reference, self.settings.temperature
        )

    def kept(self) -> Any:
        return restored(self, "_stats")

    def token_weights(self, batch: MicroBatch) -> torch.Tensor:
        """Each completion's weight on each of its tokens in the aggregation (S,) fp32 (module docstring)."""
        scores = _scores(batch)
        count = scores.advantage.numel()
        name = self.settings.aggregation
        if name == "group-token-mean":
            return 1.0 / scores.group_tokens.float().clamp_min(1.0)
        if name == "seq-mean-token-mean":
            segment = batch.answers.segment  # type: ignore[union-attr]
            lengths = torch.bincount(segment[segment >= 0], minlength=count)[:count].float()
            return 1.0 / lengths.clamp_min(1.0)
        if name == "seq-mean-token-sum-norm":
            if not self.settings.norm_constant:
                raise RuntimeError("seq-mean-token-sum-norm's constant C was never set")
            return torch.full((count,), 1.0 / self.settings.norm_constant, device=scores.advantage.device)
        return torch.ones(count, device=scores.advantage.device)

    def sums(self, model: nn.Module, batch: Any, index: int) -> dict[str, torch.Tensor]:
        scores = _scores(batch)
        if scores.old_logp is None:
            raise RuntimeError(f"micro-batch {index} has no old log-probabilities: its rollout was not scored")
        out = token_scores(model, batch, self.settings.temperature)  # (B, T, 2)
        logp, entropy = -out[..., 0].float(), out[..., 1].float()  # (B, T)
        segment = batch.answers.segment  # (B, T)
        inside = segment >= 0
        owner = segment.clamp_min(0)
        mask = inside.float()
        if scores.advantage.numel():
            advantage = scores.advantage.float()[owner] * mask  # (B, T)
            weight = self.token_weights(batch)[owner] * mask  # (B, T)
        else:  # a micro-batch of padding alone
            advantage = torch.zeros_like(logp)
            weight = torch.zeros_like(logp)
        old = scores.old_logp.float()
        # 0 outside completions (the ratio there is 1); bounded, as a ratio beyond e^20 is clipped or noise anyway,
        # so that a stale old log-probability cannot overflow exp() into a non-finite gradient
        log_ratio = ((logp - old) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        s = self.settings
        if s.policy_loss == "cispo":
            weight_is = ratio.clamp(max=1.0 + s.clip_high).detach()
            per_token = -weight_is * advantage * logp
            clipped = (ratio > 1.0 + s.clip_high) & inside
        else:
            bounded = ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
            per_token = -torch.minimum(ratio * advantage, bounded * advantage)
            clipped = (
                ((ratio < 1.0 - s.clip_low) & (advantage < 0)) | ((ratio > 1.0 + s.clip_high) & (advantage > 0))
            ) & inside
        sums = {"policy": (per_token * weight).sum()}
        kl = None
        if scores.ref_logp is not None:
            delta = (scores.ref_logp.float() - logp) * mask
            kl = torch.exp(delta) - delta - 1.0  # (B, T), 0 outside completions
            if s.kl_coef > 0:
                sums["kl"] = (kl * weight).sum()
        if s.entropy_coef > 0:
            sums["entropy"] = (entropy * weight).sum()
        self._record(scores, inside, clipped, entropy, kl, log_ratio)
        return sums

    def _record(
        self,
        scores: RolloutScores,
        inside: torch.Tensor,
        clipped: torch.Tensor,
        entropy: torch.Tensor,
        kl: torch.Tensor | None,
        log_ratio: torch.Tensor,
    ) -> None:
        """The step's statistics of this micro-batch, added on the device (no sync)."""
        with torch.no_grad():
            reward = scores.reward.double()
            advantage = scores.advantage.double()
            mask = inside.double()
            values = [
                float(scores.reward.numel()),
                reward.sum(),
                (reward * reward).sum(),
                (advantage * advantage).sum(),
                mask.sum(),
                clipped.double().sum(),
                (entropy.double() * mask).sum(),
                (kl.double() * mask).sum() if kl is not None else 0.0,
                (log_ratio.double().abs() * mask).sum(),
            ]
            device = self._stats.device
            self._stats += torch.stack(
                [
                    v.to(device) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64, device=device)
                    for v in values
                ]
            )

    def local_statistics(self) -> list[float]:
        return [float(v) for v in self._stats.tolist()]

    def statistics(self, values: Sequence[float]) -> dict[str, float]:
        if len(values) < len(STAT_NAMES):
            return {}
        v = dict(zip(STAT_NAMES, values, strict=False))
        n, tokens = v["completions"], v["tokens"]
        out: dict[str, float] = {}
        if n:
            if self.rollout_facts is None:  # else the rollout's: every sampled group's, and none for advantages given
                mean = v["reward"] / n
                out["reward/mean"] = mean
                out["reward/std"] = math.sqrt(max(v["reward_sq"] / n - mean * mean, 0.0))
            out["advantage/std"] = math.sqrt(v["advantage_sq"] / n)
            out["completion/tokens"] = tokens / n
        if tokens:
            out["clipped"] = v["clipped"] / tokens
            out["entropy"] = v["entropy"] / tokens
            out["ratio/abs_log"] = v["ratio_dev"] / tokens
            if self.reference is not None:
                out["kl"] = v["kl"] / tokens
        if self.rollout_facts is not None:
            out.update(self.rollout_facts())
        return out

    def describe(self) -> list[str]:
        s = self.settings
        parts = [term.describe() for term in self.terms]
        clip = f"clip {s.clip_low:g}/{s.clip_high:g}" if s.policy_loss == "ppo" else f"weight clip {s.clip_high:g}"
        extra = f"{s.policy_loss}, {clip}, aggregation {s.aggregation}"
        if s.aggregation == "seq-mean-token-sum-norm":
            extra += f" (C = {s.norm_constant:g})" if s.norm_constant else " (C = the longest completion)"
        return [f"objective | grpo: {' + '.join(parts)} | {extra}"]


def _scores(batch: Any) -> RolloutScores:
    answers = getattr(batch, "answers", None)
    if answers is None or answers.rollout is None:
        raise ValueError("--objective grpo reads sampled completions (--prompts or --rollouts); this data has none")
    scores: RolloutScores = answers.rollout
    return scores
