"""Learning from rewards (engine/policy_gradient.py, data/rollouts.py, data/rollout_loader.py), in process.

* Every aggregation mode's loss and gradient, driven through the engine's accumulation, equals a float64 reference
  written longhand here from the module docstring's formulas (per-token log-probabilities from a plain full-logits
  float64 forward of each completion alone; ppo with asymmetric clips, cispo, k3 KL to a perturbed reference, the
  entropy bonus; ratios moved off 1 by known offsets so both clips bite), and a hand-checkable group at ratio 1.
* The gradient of a step is the same however its completions are split: one micro-batch, one row each, packed or
  not, groups split across micro-batches, two simulated ranks with uneven completions, a rank of padding alone.
* Flat groups kept or dropped change the denominators exactly as defined; the step's facts count them.
* The loader: K = ceil(units / world), every completion once across ranks, bitwise resume, padding past the end;
  a sampled rollout of two steps scored once, before its first update.
* The rollout file's refusals, each one line naming the line.
* The ratio is 1 at the first update (the old policy is the trainer's own forward).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from tiny import VOCAB

from bigbatch.data.rollout_loader import MAX_EMPTY_ROLLOUTS, RESAMPLE_ROUNDS, FileRollouts, RolloutLoader
from bigbatch.data.rollouts import (
    ADVANTAGE_EPS,
    Completion,
    Group,
    StepFacts,
    deal,
    group_advantages,
    micro_batches_per_rank,
    read_rollout_file,
    step_completions,
)
from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import IGNORE_INDEX, MicroBatch
from bigbatch.engine.objective import UNITS, StepTotals, count_units, summarize
from bigbatch.engine.optim import constant_schedule
from bigbatch.engine.policy_gradient import (
    LOSS_AGGREGATIONS,
    ReferenceScorer,
    RewardLossSettings,
    RewardObjective,
    score_rollout,
    token_scores,
)
from bigbatch.errors import ConfigError, DataError
from bigbatch.models import GPT, GPTConfig
from bigbatch.parallel.distributed import DistContext

SEQ = 24
CPU = torch.device("cpu")
TOL_REFERENCE = 2e-5  # the fp32 engine against the float64 reference
TOL_SPLIT = 1e-5  # one fp32 split against another
CLIP_LOW, CLIP_HIGH = 0.1, 0.28  # asymmetric (DAPO's clip-higher)
NORM_CONSTANT = 7.0

# The step's groups: (prompt length, rewards, completion lengths). 14 completions, 44 completion tokens.
SPEC = [
    (3, [1.0, 0.0, 0.0, 1.0], [2, 5, 3, 4]),
    (2, [0.5, 0.25, 0.75], [6, 1, 3]),
    (4, [1.0, 1.0], [3, 2]),  # flat: every reward equal
    (1, [0.0, 2.0, 1.0, 3.0], [4, 2, 5, 1]),  # a prompt of one token
    (3, [0.5], [3]),  # a group of one: advantage 0 (and flat)
]
TOKENS = sum(sum(lengths) for _, _, lengths in SPEC)
COMPLETIONS = sum(len(lengths) for _, _, lengths in SPEC)
FLAT = {2, 4}  # the flat groups of SPEC
# log r = l - b for the step's completion tokens in turn: each ratio at least 0.02 away from 1 - 0.1 and 1 + 0.28,
# so the clips' kinks are far from fp32 rounding, and both clips bite (ratios 0.67 and 1.65)
OFFSETS = (-0.4, 0.03, 0.5, -0.05, 0.15)


# -- the data ------------------------------------------------------------------------------------------------------


def models(seed: int = 0) -> tuple[GPT, GPT]:
    """A tiny policy and a reference near it."""
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=VOCAB, dropout=0.0)
    policy, reference = GPT(config), GPT(config)
    with torch.no_grad():
        for p, r in zip(policy.parameters(), reference.parameters(), strict=True):
            r.copy_(p + 0.05 * torch.randn_like(p))
    return policy, reference


def make_groups(spec: list[tuple[int, list[float], list[int]]] = SPEC, seed: int = 0) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    groups = []
    for g, (prompt_length, rewards, lengths) in enumerate(spec):
        prompt = ids(prompt_length)
        groups.append(
            Group(f"g{g}", [Completion(list(prompt), ids(n), r) for r, n in zip(rewards, lengths, strict=True)])
        )
    return groups


def completion_scores(model: nn.Module, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The completion's log-probabilities and the next-token entropies at its tokens (|o|,), from the whole logits
    of its own forward (no neighbour, no padding), in the model's dtype (float64 for the reference)."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids[:, :-1])[0]  # (L - 1, V)
    logp = torch.log_softmax(logits.double(), dim=-1)[len(prompt) - 1 :]  # (|o|, V)
    chosen = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return chosen, entropy


def with_old_logps(groups: list[Group], policy: nn.Module) -> list[Group]:
    """The groups with ``old_logps`` = the policy's log-probabilities less :data:`OFFSETS` in turn (fp32 values,
    as a micro-batch holds them), so each ratio is ``exp(offset)``."""
    model = copy.deepcopy(policy).double()
    out, k = copy.deepcopy(groups), 0
    with torch.no_grad():
        for group in out:
            for c in group.completions:
                logp, _ = completion_scores(model, c.prompt, c.tokens)
                offsets = torch.tensor([OFFSETS[(k + t) % len(OFFSETS)] for t in range(len(c.tokens))])
                k += len(c.tokens)
                c.old_logps = (logp - offsets.double()).float().tolist()
    return out


def step_batches(
    groups: list[Group],
    micro_batch: int,
    pack: bool,
    rank: int = 0,
    world: int = 1,
    scale: str = "std",
    flat: str = "keep",
) -> tuple[list[MicroBatch], RolloutLoader]:
    """The micro-batches of one step of all ``groups`` on ``rank`` (fresh ones: scoring writes on them)."""
    loader = RolloutLoader(
        FileRollouts(groups),
        len(groups),
        micro_batch,
        SEQ,
        rank,
        world,
        pack=pack,
        advantage_scale=scale,
        flat_groups=flat,
    )
    k = loader.micro_batches_next_step()
    return [loader.next_micro_batch() for _ in range(k)], loader


def settings_for(aggregation: str, policy_loss: str, kl: float = 0.05, entropy: float = 0.01) -> RewardLossSettings:
    return RewardLossSettings(
        aggregation=aggregation,
        policy_loss=policy_loss,
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        kl_coef=kl,
        entropy_coef=entropy,
        norm_constant=NORM_CONSTANT,
    )


def gradient_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), math.ulp(1.0)))


# -- the float64 reference, longhand --------------------------------------------------------------------------------


def reference_advantages(rewards: list[float], scale: str) -> list[float]:
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if scale == "std":
        std = math.sqrt(sum(c * c for c in centred) / (n - 1))
        centred = [c / (std + 1e-6) for c in centred]
    return centred


@dataclass
class Reference:
    loss: torch.Tensor
    terms: dict[str, float]
    stats: dict[str, float]
    gradient: torch.Tensor
    clipped_low: int = 0
    clipped_high: int = 0


def reference_step(
    settings: RewardLossSettings,
    policy: nn.Module,
    reference: nn.Module | None,
    groups: list[Group],
    scale: str = "std",
    flat: str = "keep",
) -> Reference:
    """The step's loss and its gradient in float64, from the module docstring's formulas."""
    model = copy.deepcopy(policy).double()
    ref = copy.deepcopy(reference).double() if reference is not None else None
    kept = [g for g in groups if not (flat == "drop" and len({c.reward for c in g.completions}) <= 1)]
    rows: list[tuple[int, float, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    low = high = 0
    for g, group in enumerate(kept):
        for c, a in zip(
            group.completions, reference_advantages([c.reward for c in group.completions], scale), strict=True
        ):
            logp, entropy = completion_scores(model, c.prompt, c.tokens)
            old = torch.tensor(c.old_logps, dtype=torch.float32).double() if c.old_logps is not None else logp.detach()
            r = torch.exp(logp - old)
            if settings.policy_loss == "ppo":
                x = -torch.minimum(r * a, r.clamp(1 - settings.clip_low, 1 + settings.clip_high) * a)
                low += int(((r < 1 - settings.clip_low) & (a < 0)).sum())
                high += int(((r > 1 + settings.clip_high) & (a > 0)).sum())
            else:
                x = -r.clamp(max=1 + settings.clip_high).detach() * a * logp
                high += int((r > 1 + settings.clip_high).sum())
            if ref is not None:
                with torch.no_grad():
                    q, _ = completion_scores(ref, c.prompt, c.tokens)
                k3 = torch.exp(q - logp) - (q - logp) - 1
            else:
                k3 = torch.zeros_like(logp)
            rows.append((g, a, x, k3, entropy, (logp - old).detach().abs()))

    def aggregate(values: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        name = settings.aggregation
        if name == "token-mean":
            return sum(v.sum() for _, v in values) / sum(v.numel() for _, v in values)
        if name == "group-token-mean":
            groups_in = sorted({g for g, _ in values})
            per_group = []
            for g in groups_in:
                mine = [v for h, v in values if h == g]
                per_group.append(sum(v.sum() for v in mine) / sum(v.numel() for v in mine))
            return sum(per_group) / len(per_group)
        if name == "seq-mean-token-mean":
            return sum(v.mean() for _, v in values) / len(values)
        if name == "seq-mean-token-sum":
            return sum(v.sum() for _, v in values) / len(values)
        assert name == "seq-mean-token-sum-norm"
        return sum(v.sum() for _, v in values) / (len(values) * settings.norm_constant)

    policy_term = aggregate([(g, x) for g, _, x, _, _, _ in rows])
    kl_term = aggregate([(g, k) for g, _, _, k, _, _ in rows])
    entropy_term = aggregate([(g, h) for g, _, _, _, h, _ in rows])
    loss = policy_term + settings.kl_coef * kl_term - settings.entropy_coef * entropy_term
    loss.backward()
    tokens = sum(x.numel() for _, _, x, _, _, _ in rows)
    rewards = [c.reward for g in kept for c in g.completions]
    n = len(rewards)
    mean = sum(rewards) / n
    stats = {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "advantage/std": math.sqrt(sum(a * a for _, a, _, _, _, _ in rows) / n),
        "completion/tokens": tokens / n,
        "clipped": (low + high) / tokens,
        "entropy": float(sum(h.detach().sum() for _, _, _, _, h, _ in rows)) / tokens,
        "ratio/abs_log": float(sum(d.sum() for _, _, _, _, _, d in rows)) / tokens,
        "kl": float(sum(k.detach().sum() for _, _, _, k, _, _ in rows)) / tokens,
    }
    terms = {
        "policy": float(policy_term.detach()),
        "kl": float(kl_term.detach()),
        "entropy": float(entropy_term.detach()),
    }
    return Reference(loss.detach(), terms, stats, gradient_of(model), low, high)


# -- the engine ----------------------------------------------------------------------------------------------------


def make_engine(
    settings: RewardLossSettings,
    policy: nn.Module,
    reference: nn.Module | None,
    dist: DistContext | None = None,
    rollout_facts: Any = None,
) -> tuple[AccumulationEngine, nn.Module]:
    model = copy.deepcopy(policy)
    scorer = ReferenceScorer(copy.deepcopy(reference)) if reference is not None else None
    objective = RewardObjective(settings, scorer, rollout_facts)
    engine = AccumulationEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        constant_schedule(1.0),
        grad_clip=0.0,
        objective=objective,
        dist=dist,
    )
    return engine, model


def engine_step(
    settings: RewardLossSettings,
    policy: nn.Module,
    reference: nn.Module | None,
    batches: list[MicroBatch],
    rollout_facts: Any = None,
) -> tuple[torch.Tensor, float, dict[str, float], StepTotals]:
    """One step (lr 0, no clipping): the gradient, the step's loss, its record's measurements, its totals."""
    engine, model = make_engine(settings, policy, reference, rollout_facts=rollout_facts)
    totals = engine.step_totals(batches)
    record = engine.step(batches)
    return gradient_of(model), record.loss, record.measurements["objective"].as_dict(), totals


@dataclass(frozen=True)
class SimulatedRank(DistContext):
    """One rank of a world simulated in process. Its one all-reduce in a step (the units, before the first
    backward) records this rank's vector and adds ``others``: the other ranks' vectors recorded beforehand."""

    others: tuple[torch.Tensor, ...] = ()
    seen: list[torch.Tensor] = field(default_factory=list)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.seen.append(tensor.clone())
        for other in self.others:
            tensor.add_(other.to(tensor))
        return tensor


def simulated_ranks(
    settings: RewardLossSettings,
    policy: nn.Module,
    reference: nn.Module | None,
    per_rank: list[list[MicroBatch]],
) -> tuple[torch.Tensor, float, StepTotals]:
    """Every rank's accumulation of its micro-batches, combined as DDP would (the average of the ranks'
    gradients) and as the step's record would (the sums all-reduced): the gradient, the loss, the totals."""
    world = len(per_rank)
    local = []
    for rank, batches in enumerate(per_rank):  # what each rank contributes to the all-reduce of the units
        recorder = SimulatedRank(rank=rank, world_size=world)
        count_units(
            RewardObjective(settings, ReferenceScorer(copy.deepcopy(reference)) if reference is not None else None),
            batches,
            recorder,
            CPU,
        )
        local.append(recorder.seen[0])
    gradients, sums, all_totals = [], [], []
    engine = None
    for rank, batches in enumerate(per_rank):
        others = tuple(v for r, v in enumerate(local) if r != rank)
        engine, model = make_engine(
            settings, policy, reference, SimulatedRank(rank=rank, world_size=world, others=others)
        )
        summed, totals = engine.accumulate(batches)
        gradients.append(gradient_of(model))
        sums.append(summed)
        all_totals.append(totals)
    assert all(t == all_totals[0] for t in all_totals), "every rank counts the same units"
    assert engine is not None
    loss, _ = summarize(engine.objective, torch.stack(sums).sum(0).tolist(), all_totals[0])
    return torch.stack(gradients).mean(0), loss, all_totals[0]


# -- 1. every mode against the float64 reference ---------------------------------------------------------------------


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo"])
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_each_mode_equals_the_float64_reference(aggregation: str, policy_loss: str) -> None:
    policy, reference = models()
    groups = with_old_logps(make_groups(), policy)
    settings = settings_for(aggregation, policy_loss)
    expected = reference_step(settings, policy, reference, groups)
    if policy_loss == "ppo":
        assert expected.clipped_low > 0 and expected.clipped_high > 0, "both clips bite"
    else:
        assert expected.clipped_high > 0
    batches, _ = step_batches(groups, micro_batch=2, pack=True)  # several micro-batches, groups split among them
    assert len(batches) > 1
    gradient, loss, measured, totals = engine_step(settings, policy, reference, batches)
    assert rel(gradient, expected.gradient) < TOL_REFERENCE
    assert loss == pytest.approx(float(expected.loss), rel=1e-5, abs=1e-7)
    for name in ("policy", "kl", "entropy"):
        assert measured[f"term/{name}"] == pytest.approx(expected.terms[name], rel=1e-5, abs=1e-7), name
    for name, value in expected.stats.items():
        assert measured[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    unit = {"token": TOKENS, "sequence": COMPLETIONS, "group": len(SPEC)}[settings.unit]
    assert totals.of(settings.unit) == unit
    assert totals.targets == TOKENS


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_without_kl_and_entropy_the_loss_is_the_policy_term_alone(aggregation: str) -> None:
    policy, _ = models(1)
    groups = with_old_logps(make_groups(seed=1), policy)
    settings = settings_for(aggregation, "ppo", kl=0.0, entropy=0.0)
    expected = reference_step(settings, policy, None, groups)
    batches, _ = step_batches(groups, micro_batch=2, pack=False)
    gradient, loss, measured, _ = engine_step(settings, policy, None, batches)
    assert rel(gradient, expected.gradient) < TOL_REFERENCE
    assert loss == pytest.approx(expected.terms["policy"], rel=1e-5, abs=1e-7)
    assert "kl" not in measured  # no reference: no KL to report


def test_group_advantages_by_hand() -> None:
    a = 0.5 / (math.sqrt(1 / 3) + ADVANTAGE_EPS)  # rewards [1, 0, 0, 1]: mean 1/2, unbiased std sqrt(1/3)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "std") == pytest.approx([a, -a, -a, a], rel=1e-12)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "none") == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([3.0, 1.0], "none") == [1.0, -1.0]
    assert group_advantages([3.0, 1.0], "std") == pytest.approx([1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6)])
    assert group_advantages([0.7], "std") == [0.0]  # a group of one completion
    assert group_advantages([0.7], "none") == [0.0]
    assert group_advantages([], "std") == []
    assert group_advantages([2.0, 2.0, 2.0], "std") == [0.0, 0.0, 0.0]  # flat: 0 / eps, finite
    for rewards in ([0.5, 0.25, 0.75], [0.0, 2.0, 1.0, 3.0]):
        for scale in ("std", "none"):
            assert group_advantages(rewards, scale) == pytest.approx(reference_advantages(rewards, scale), rel=1e-12)
    with pytest.raises(ConfigError, match="--advantage-scale"):
        group_advantages([1.0, 0.0], "rank")


@pytest.mark.parametrize(
    ("aggregation", "factor"),
    [
        # one group [1, 0, 0, 1] of lengths [2, 5, 3, 4] at ratio 1: each token's ppo loss is -A, A = +-a
        ("token-mean", 1 / 7),  # -(2a - 5a - 3a + 4a) / 14
        ("group-token-mean", 1 / 7),  # one group: the same
        ("seq-mean-token-mean", 0.0),  # -(a - a - a + a) / 4
        ("seq-mean-token-sum", 1 / 2),  # -(2a - 5a - 3a + 4a) / 4
        ("seq-mean-token-sum-norm", 1 / 8),  # ... / (4 x C), C = 4
    ],
)
def test_a_hand_checked_group_at_ratio_one(aggregation: str, factor: float) -> None:
    policy, _ = models(2)
    groups = make_groups([(3, [1.0, 0.0, 0.0, 1.0], [2, 5, 3, 4])], seed=2)
    settings = RewardLossSettings(aggregation=aggregation, norm_constant=4.0)
    a = 0.5 / (math.sqrt(1 / 3) + ADVANTAGE_EPS)
    for micro_batch, pack in ((8, True), (1, False)):
        batches, _ = step_batches(groups, micro_batch, pack)
        _, loss, measured, _ = engine_step(settings, policy, None, batches)
        assert loss == pytest.approx(factor * a, rel=1e-6, abs=1e-6)
        assert measured["advantage/std"] == pytest.approx(a, rel=1e-6)
        assert measured["reward/mean"] == 0.5 and measured["reward/std"] == 0.5


# -- 2. the split does not matter ----------------------------------------------------------------------------------


def completions_of(batch: MicroBatch) -> list[tuple[int, int]]:
    """(group, member) of each completion of ``batch``, the group numbered in its step."""
    assert batch.answers is not None and batch.answers.rollout is not None
    return list(zip(batch.answers.group.tolist(), batch.answers.rollout.member.tolist(), strict=True))


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo"])
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_the_gradient_does_not_depend_on_the_split(aggregation: str, policy_loss: str) -> None:
    policy, reference = models(3)
    groups = with_old_logps(make_groups(seed=3), policy)
    settings = settings_for(aggregation, policy_loss)
    one, _ = step_batches(groups, micro_batch=16, pack=True)
    assert len(one) == 1
    baseline, base_loss, _, base_totals = engine_step(settings, policy, reference, one)
    layouts = {
        "a row each": step_batches(groups, 1, pack=False)[0],  # K 14
        "packed rows": step_batches(groups, 1, pack=True)[0],
        "3 rows": step_batches(groups, 3, pack=False)[0],  # the last micro-batch not full
    }
    assert len(layouts["a row each"]) == COMPLETIONS
    assert len(layouts["packed rows"]) >= 2
    first_group = [i for i, b in enumerate(layouts["3 rows"]) if any(g == 0 for g, _ in completions_of(b))]
    assert len(first_group) == 2, "the first group is split between micro-batches"
    for name, batches in layouts.items():
        gradient, loss, _, totals = engine_step(settings, policy, reference, batches)
        assert rel(gradient, baseline) <= TOL_SPLIT, name
        assert loss == pytest.approx(base_loss, rel=1e-5, abs=1e-7), name
        assert totals == base_totals, name
    for micro_batch, pack in ((2, False), (1, True), (3, True)):  # two ranks of uneven completions
        per_rank = [step_batches(groups, micro_batch, pack, rank, 2)[0] for rank in range(2)]
        counts = [sum(len(completions_of(b)) for b in batches) for batches in per_rank]
        assert len(per_rank[0]) == len(per_rank[1]) and sum(counts) == COMPLETIONS
        gradient, loss, totals = simulated_ranks(settings, policy, reference, per_rank)
        assert rel(gradient, baseline) <= TOL_SPLIT, (micro_batch, pack)
        assert loss == pytest.approx(base_loss, rel=1e-5, abs=1e-7)
        assert totals == base_totals
    # unpacked, 2 rows: 7 units, so rank 0 holds 8 completions, rank 1 holds 6 and a micro-batch of padding
    per_rank = [step_batches(groups, 2, False, rank, 2)[0] for rank in range(2)]
    assert [[len(completions_of(b)) for b in batches] for batches in per_rank] == [[2, 2, 2, 2], [2, 2, 2, 0]]


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_a_rank_of_padding_alone_adds_nothing(aggregation: str) -> None:
    """A step of one micro-batch on two and three ranks: the others run one of padding (no unit), whose forward
    and backward reach every parameter with zeros."""
    policy, reference = models(4)
    groups = with_old_logps(make_groups(SPEC[:2], seed=4), policy)
    settings = settings_for(aggregation, "ppo")
    one, _ = step_batches(groups, 8, True)
    baseline, base_loss, _, _ = engine_step(settings, policy, reference, one)
    for world in (2, 3):
        per_rank = [step_batches(groups, 8, True, rank, world)[0] for rank in range(world)]
        assert [len(b) for b in per_rank] == [1] * world
        for batches in per_rank[1:]:
            assert batches[0].answers is not None and batches[0].answers.count == 0
        gradient, loss, _ = simulated_ranks(settings, policy, reference, per_rank)
        assert rel(gradient, baseline) <= TOL_SPLIT, world
        assert loss == pytest.approx(base_loss, rel=1e-5, abs=1e-7)
    # the padding rank's own gradient is exactly zero, but present on every parameter (DDP waits for each)
    engine, model = make_engine(settings, policy, reference)
    padding = step_batches(groups, 8, True, 1, 2)[0]
    engine.accumulate(padding, StepTotals({settings.unit: 5.0}, settings.unit, 5))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_a_micro_batch_of_padding_carries_old_log_probabilities_when_the_step_does() -> None:
    """Whether a micro-batch needs a scoring forward is the step's decision, the same on every rank: with a rollout
    file's log-probabilities, a rank's micro-batch of padding alone carries zeros, so that it runs no forward the
    other ranks do not (a DDP buffer broadcast or an FSDP gather would no longer pair up)."""
    policy, _ = models(4)
    groups = with_old_logps(make_groups(SPEC[:2], seed=4), policy)
    per_rank = [step_batches(groups, 8, True, rank, 2)[0] for rank in range(2)]
    padding = per_rank[1][0].answers
    assert padding is not None and padding.count == 0 and padding.rollout is not None
    assert padding.rollout.old_logp is not None and not padding.rollout.old_logp.any()
    before = copy.deepcopy(padding.rollout.old_logp)
    score_rollout(policy, per_rank[1], torch.device("cpu"), contextlib.nullcontext, None)
    assert torch.equal(padding.rollout.old_logp, before)  # nothing to score: no forward ran


# -- 3. flat groups ------------------------------------------------------------------------------------------------


def test_step_facts_count_flat_and_dropped_groups() -> None:
    groups = make_groups()
    rewards = [c.reward for g in groups for c in g.completions]
    every = {"reward_sum": sum(rewards), "reward_sq": sum(r * r for r in rewards), "rewarded": len(rewards)}
    kept, facts = step_completions(groups, "std", "keep")
    assert facts == StepFacts(groups=5, flat=2, dropped=0, **every)
    assert len(kept.completions) == COMPLETIONS
    assert [a for a, g in zip(kept.advantage, kept.group, strict=True) if g in FLAT] == [0.0, 0.0, 0.0]
    assert kept.group_tokens[:4] == [14] * 4 and kept.group_tokens[4:7] == [10] * 3
    dropped, facts = step_completions(groups, "std", "drop")
    assert facts == StepFacts(groups=5, flat=2, dropped=2, **every)  # the rewards of every sampled group
    assert sorted(set(dropped.group)) == [0, 1, 3]  # groups keep their number in the step
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum(r * r for r in rewards) / len(rewards) - mean * mean)
    assert facts.as_dict() == pytest.approx(
        {"groups/flat_share": 0.4, "groups/dropped": 2.0, "reward/mean": mean, "reward/std": std}
    )
    assert StepFacts(5, 2, 0).as_dict() == {"groups/flat_share": 0.4}
    # given advantages: flat when all are 0, whatever the rewards (a file's advantage line has reward 0)
    given = [
        Group("z", [Completion([1], [2], 0.0, 0.0), Completion([1], [3], 0.0, 0.0)]),
        Group("y", [Completion([1], [2], 0.0, 0.5), Completion([1], [3], 0.0, -0.5)]),
    ]
    step, facts = step_completions(given, "std", "drop")
    assert facts == StepFacts(2, 1, 1) and step.advantage == [0.5, -0.5]
    with pytest.raises(ConfigError, match="--flat-groups"):
        step_completions(groups, "std", "skip")


@pytest.mark.parametrize(
    ("aggregation", "keep_units", "drop_units"),
    [
        ("token-mean", TOKENS, TOKENS - 5 - 3),
        ("group-token-mean", 5, 3),
        ("seq-mean-token-mean", COMPLETIONS, COMPLETIONS - 3),
        ("seq-mean-token-sum", COMPLETIONS, COMPLETIONS - 3),
        ("seq-mean-token-sum-norm", COMPLETIONS, COMPLETIONS - 3),
    ],
)
def test_keeping_or_dropping_flat_groups_changes_the_denominators_exactly(
    aggregation: str, keep_units: int, drop_units: int
) -> None:
    policy, reference = models(5)
    groups = with_old_logps(make_groups(seed=5), policy)
    settings = settings_for(aggregation, "ppo", kl=0.0, entropy=0.0)
    runs = {}
    for flat in ("keep", "drop"):
        batches, loader = step_batches(groups, 3, True, flat=flat)
        runs[flat] = engine_step(settings, policy, None, batches, rollout_facts=loader.step_facts)
    (g_keep, loss_keep, m_keep, t_keep), (g_drop, loss_drop, m_drop, t_drop) = runs["keep"], runs["drop"]
    assert t_keep.of(settings.unit) == keep_units and t_drop.of(settings.unit) == drop_units
    assert t_keep.targets == TOKENS and t_drop.targets == TOKENS - 8
    # a flat group's advantages are 0: its policy loss and gradient are 0, it only counts in the denominator
    assert rel(g_keep * keep_units, g_drop * drop_units) <= TOL_SPLIT
    assert loss_keep * keep_units == pytest.approx(loss_drop * drop_units, rel=1e-5)
    assert m_keep["groups/flat_share"] == 0.4 and "groups/dropped" not in m_keep
    assert m_drop["groups/flat_share"] == 0.4 and m_drop["groups/dropped"] == 2.0
    # and each equals the reference with the same choice
    assert rel(g_drop, reference_step(settings, policy, None, groups, flat="drop").gradient) < TOL_REFERENCE
    # with KL and entropy the flat groups' tokens train too: keep is no longer a rescaled drop
    settings = settings_for(aggregation, "cispo")
    for flat in ("keep", "drop"):
        batches, _ = step_batches(groups, 3, True, flat=flat)
        gradient, _, _, _ = engine_step(settings, policy, reference, batches)
        assert rel(gradient, reference_step(settings, policy, reference, groups, flat=flat).gradient) < TOL_REFERENCE


def test_advantages_without_std_scaling_equal_the_reference() -> None:
    policy, reference = models(6)
    groups = with_old_logps(make_groups(seed=6), policy)
    settings = settings_for("seq-mean-token-sum-norm", "ppo")
    batches, _ = step_batches(groups, 4, True, scale="none")
    gradient, _, _, _ = engine_step(settings, policy, reference, batches)
    assert rel(gradient, reference_step(settings, policy, reference, groups, scale="none").gradient) < TOL_REFERENCE


# -- 4. the loader -------------------------------------------------------------------------------------------------

LOADER_SPEC = [
    (2, [1.0, 0.0, 1.0], [2, 3, 1]),
    (3, [0.0, 1.0], [4, 2]),
    (1, [0.5, 0.5, 0.5, 0.5], [1, 2, 3, 4]),
    (2, [1.0, 0.0, 0.5, 0.25], [5, 1, 1, 2]),
    (4, [0.0, 1.0], [3, 3]),
    (2, [0.2, 0.1, 0.3], [2, 2, 2]),
    (3, [1.0, 0.0], [1, 6]),
]


def held(batch: MicroBatch) -> list[tuple[list[int], list[int]]]:
    """The (prompt, completion) of each completion of ``batch``, read back from its rows."""
    assert batch.answers is not None
    out = []
    for a in range(batch.answers.count):
        rows, cols = (batch.answers.segment == a).nonzero(as_tuple=True)
        r = int(rows[0])
        first, last = int(cols.min()), int(cols.max())
        completion = batch.targets[r, first : last + 1].tolist()
        # the prompt: the inputs of the document up to its first completion target
        positions = batch.positions[r] if batch.positions is not None else torch.arange(batch.inputs.shape[1])
        start = first - int(positions[first])
        prompt = batch.inputs[r, start : first + 1].tolist()
        out.append((prompt, completion))
    return out


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_loader_deals_every_completion_once_with_k_from_the_units(world: int, pack: bool) -> None:
    groups = make_groups(LOADER_SPEC, seed=7)
    loaders = [RolloutLoader(FileRollouts(groups), 3, 2, SEQ, r, world, pack=pack) for r in range(world)]
    assert loaders[0].steps_per_epoch == 3  # 3 + 3 + 1 groups
    for epoch in range(2):
        for step, first in enumerate((0, 3, 6)):
            mine = groups[first : first + 3]
            ks = [loader.micro_batches_next_step() for loader in loaders]
            completions, _ = step_completions(mine, "std", "keep")
            units = len(deal(completions, 2, SEQ, pack))
            if not pack:
                assert units == -(-len(completions.completions) // 2)
            assert ks == [micro_batches_per_rank(units, world)] * world == [max(1, -(-units // world))] * world
            found = []
            for loader in loaders:
                assert (loader.epoch, loader.step_in_epoch) == (epoch, step)
                for j in range(ks[0]):
                    batch = loader.next_micro_batch()
                    u = j * world + loader.rank
                    assert batch.origin == ((epoch * 1_000_000 + step, u),)
                    if u >= units:  # past the end: padding
                        assert batch.answers is not None and batch.answers.count == 0
                        assert (batch.targets == IGNORE_INDEX).all() and (batch.answers.segment == -1).all()
                        assert batch.padding == batch.inputs.numel()
                    found += held(batch)
            expected = [(c.prompt, c.tokens) for g in mine for c in g.completions]
            assert sorted(found) == sorted(expected)  # every completion once, whole, with its own prompt
    assert all((loader.epoch, loader.step_in_epoch) == (2, 0) for loader in loaders)


def batch_tensors(batch: MicroBatch) -> list[Any]:
    assert batch.answers is not None and batch.answers.rollout is not None
    r = batch.answers.rollout
    return [
        batch.inputs,
        batch.targets,
        batch.positions,
        batch.answers.segment,
        batch.answers.group,
        batch.answers.role,
        r.advantage,
        r.reward,
        r.member,
        r.group_tokens,
        r.old_logp,
        batch.origin,
        batch.padding,
        batch.epoch,
    ]


def same_batches(a: list[MicroBatch], b: list[MicroBatch]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        for u, v in zip(batch_tensors(x), batch_tensors(y), strict=True):
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                if u is None or v is None or u.dtype != v.dtype or not torch.equal(u, v):
                    return False
            elif u != v:
                return False
    return True


def read_step_of(loader: RolloutLoader) -> list[MicroBatch]:
    return [loader.next_micro_batch() for _ in range(loader.micro_batches_next_step())]


@pytest.mark.parametrize("world", [1, 2])
def test_the_loaders_state_resumes_at_the_same_step_bitwise(world: int) -> None:
    policy, _ = models(8)
    groups = with_old_logps(make_groups(LOADER_SPEC, seed=8), policy)  # the file's logps travel too

    def loader(rank: int) -> RolloutLoader:
        return RolloutLoader(FileRollouts(groups), 3, 2, SEQ, rank, world, pack=True, flat_groups="drop")

    for rank in range(world):
        straight = loader(rank)
        states, steps = [], []
        for _ in range(5):  # across the end of the first epoch
            states.append(json.loads(json.dumps(straight.state_dict())))  # as a checkpoint holds it
            steps.append(read_step_of(straight))
        for s in range(5):
            resumed = loader(rank)
            resumed.load_state_dict(states[s])
            assert same_batches(read_step_of(resumed), steps[s]), s
            if s + 1 < len(steps):
                assert same_batches(read_step_of(resumed), steps[s + 1]), s
        assert states[3] == {"kind": "rollouts", "epoch": 1, "step_in_epoch": 0, "prompts_per_step": 3}
        assert not same_batches(steps[0], steps[3])  # the same groups, but the origin names the epoch
        assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(steps[0], steps[3], strict=True))


def test_the_loaders_state_refuses_another_run() -> None:
    groups = make_groups(LOADER_SPEC, seed=9)
    loader = RolloutLoader(FileRollouts(groups), 3, 2, SEQ)
    state = loader.state_dict()
    with pytest.raises(DataError, match="--prompts-per-step 3"):
        RolloutLoader(FileRollouts(groups), 2, 2, SEQ).load_state_dict(state)
    with pytest.raises(DataError, match="ordinary training data"):
        loader.load_state_dict({"kind": "documents"})
    with pytest.raises(DataError, match="was the file changed"):
        loader.load_state_dict({**state, "step_in_epoch": 3})


def test_a_completion_longer_than_a_row_is_the_readers_to_refuse() -> None:
    """deal asserts a document fits a row; read_rollout_file (check_fits) is what refuses it first."""
    step, _ = step_completions(make_groups([(3, [1.0, 0.0], [SEQ - 2, 1])]), "std", "keep")
    assert len(deal(step, 1, SEQ, pack=True)) == 2  # 3 + (SEQ - 2) - 1 = SEQ positions: a row, exactly
    too_long, _ = step_completions(make_groups([(3, [1.0, 0.0], [SEQ, 1])]), "std", "keep")
    with pytest.raises(AssertionError):
        deal(too_long, 1, SEQ, pack=True)


class FixedSampler:
    """A RolloutMaker that hands out copies of the same groups (the sampler's stand-in)."""

    def __init__(self, groups: list[Group]) -> None:
        self.groups = groups
        self.made = 0

    def make(self, prompts: int) -> tuple[list[Group], float]:
        self.made += 1
        return copy.deepcopy(self.groups[:prompts]), 1.5

    def state_dict(self) -> dict[str, Any]:
        return {"made": self.made}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.made = state["made"]


def test_a_rollout_of_two_steps_is_scored_once_before_its_first_update() -> None:
    """updates_per_rollout 2: the old log-probabilities of both steps are the policy's as it sampled them (the
    first step's ratio exactly 1), the second step reads them after an update, and a resume between the two steps
    gives the second step bitwise without scoring again."""
    policy, _ = models(12)
    groups = make_groups(LOADER_SPEC[:6], seed=12)

    def loader(sampler: FixedSampler, model: nn.Module | None) -> RolloutLoader:
        out = RolloutLoader(sampler, 3, 2, SEQ, pack=True, updates_per_rollout=2)
        if model is not None:
            out.scorer = lambda batches: score_rollout(
                model, batches, CPU, lambda: torch.autocast("cpu", enabled=False), None
            )
        return out

    model = copy.deepcopy(policy)
    straight = loader(FixedSampler(groups), model)
    first = read_step_of(straight)
    facts = straight.step_facts()
    assert facts["groups/flat_share"] == pytest.approx(1 / 3) and facts["time/generation_s"] == 1.5
    first_rewards = [c.reward for g in groups[:3] for c in g.completions]  # the first step's 3 groups
    assert facts["reward/mean"] == pytest.approx(sum(first_rewards) / len(first_rewards))
    state = json.loads(json.dumps(straight.state_dict()))
    for batch in first:  # scored by the model as it sampled: the training forward's own values, bitwise
        with torch.no_grad():
            own = -token_scores(model, batch)[..., 0]
        assert torch.equal(batch.answers.rollout.old_logp, own)  # type: ignore[union-attr]
    with torch.no_grad():  # an update
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    second = read_step_of(straight)
    assert "time/generation_s" not in straight.step_facts()
    sampling = copy.deepcopy(policy).double()
    for batch in second:
        scores = batch.answers.rollout  # type: ignore[union-attr]
        for (prompt, tokens), (g, m) in zip(held(batch), completions_of(batch), strict=True):
            completion = groups[3 + g].completions[m]
            assert (prompt, tokens) == (completion.prompt, completion.tokens)
            a = completions_of(batch).index((g, m))
            old = scores.old_logp[batch.answers.segment == a]  # type: ignore[union-attr]
            logp, _ = completion_scores(sampling, prompt, tokens)
            assert torch.allclose(old.double(), logp, atol=1e-5)  # not the updated model's
    resumed = loader(FixedSampler(groups), None)  # no scorer: a resume must not score again
    resumed.load_state_dict(state)
    assert same_batches(read_step_of(resumed), second)
    assert resumed.source.made == 1 and (resumed.epoch, resumed.step_in_epoch) == (1, 0)  # type: ignore[union-attr]


# -- 5. the rollout file's refusals ---------------------------------------------------------------------------------

BYTE_VOCAB = 256
FILE_SEQ = 16


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", "replace")


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


GOOD = {"group": "a", "prompt": "1+1=", "completion": "2\n", "reward": 1.0}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": "1+1=", "completion": "3\n", "reward": 0.0}, "has no 'group'"),
        ({"group": "a", "prompt": "1+1=", "completion": "3\n"}, "has neither 'reward' nor 'advantage'"),
        ({**GOOD, "advantage": 0.5}, "gives both 'reward' and 'advantage'"),
        ({**GOOD, "reward": "high"}, "'reward' is 'high', not a finite number"),
        ({**GOOD, "reward": True}, "'reward' is True, not a finite number"),
        ('{"group": "a", "prompt": "1+1=", "completion": "3", "reward": NaN}', "'reward' is nan, not a finite number"),
        (
            {"group": "a", "prompt": "1+1=", "completion_ids": [50, 300], "reward": 0.0},
            "holds token 300, outside the model's vocabulary of 256",
        ),
        ({"group": "a", "prompt": "1+1=", "completion_ids": [-1], "reward": 0.0}, "holds token -1"),
        (
            {"group": "a", "prompt": "1+1=", "completion": "2", "completion_ids": [51], "reward": 0.0},
            "'completion_ids' are not the tokens of 'completion'",
        ),
        (
            {"group": "a", "prompt_ids": [49, 43, 49, 61.0], "completion": "2", "reward": 0.0},
            "'prompt_ids' is not a list of token ids",
        ),
        ({**GOOD, "logps": [-0.1]}, "one log-probability per completion token (2), got 1"),
        ({**GOOD, "logps": [-0.1, 0.5]}, "not a finite log-probability"),
        ({"group": "b", "prompt": "2+2=", "completion": "4", "advantage": 0.0}, None),  # (a second group: fine)
        (
            {"group": "a", "prompt": "1+2=", "completion": "3\n", "reward": 0.0},
            "group a has another prompt than its first line",
        ),
        (
            {"group": "a", "prompt": "1+1=", "completion": "3\n", "advantage": 0.0},
            "group a mixes rewards and advantages",
        ),
        ({"group": "a", "prompt": "1+1=", "completion": "2" * 14, "reward": 0.0}, "18 tokens, more than seq_len+1=17"),
        ({"group": "a", "prompt": "1+1=", "completion": "", "reward": 0.0}, "has no completion token"),
        ({"group": "a", "prompt": "", "completion": "2", "reward": 0.0}, "has an empty prompt"),
        ({"group": "a", "prompt": 12, "completion": "2", "reward": 0.0}, "'prompt' is not text"),
        ("{'group': 'a'}", "is not JSON"),
        ('["a", "1+1=", "2", 1.0]', "is not a JSON object"),
    ],
)
def test_a_bad_line_of_the_rollout_file_is_refused_in_one_line_naming_it(
    tmp_path: Path, bad: Any, message: str | None
) -> None:
    path = write_lines(tmp_path / "rollouts.jsonl", [GOOD, "", bad])  # a blank line still counts
    if message is None:
        assert [len(g.completions) for g in read_rollout_file(path, encode, decode, BYTE_VOCAB, FILE_SEQ)] == [1, 1]
        return
    with pytest.raises(DataError) as caught:
        read_rollout_file(path, encode, decode, BYTE_VOCAB, FILE_SEQ)
    text = str(caught.value)
    assert "\n" not in text
    assert f"line 3 of {path}" in text
    assert message in text


def test_a_document_of_exactly_seq_len_plus_one_tokens_is_read(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "r.jsonl", [{"group": 1, "prompt": "1+1=", "completion": "2" * 13, "reward": 0.0}])
    groups = read_rollout_file(path, encode, decode, BYTE_VOCAB, FILE_SEQ)  # 4 + 13 = 17 tokens = seq_len + 1
    assert groups[0].key == "1" and groups[0].completions[0].tokens == [50] * 13
    step, _ = step_completions(groups, "std", "keep")
    assert len(deal(step, 1, FILE_SEQ, pack=False)) == 1  # and it fills a row of seq_len positions exactly


@pytest.mark.parametrize("extra", ['"reward": 1' + "0" * 400, '"reward": 0, "logps": [-1' + "0" * 400 + ", -1]"])
def test_an_integer_too_large_for_a_float_is_refused_in_one_line(tmp_path: Path, extra: str) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"group": "a", "prompt": "1+1=", "completion": "2\\n", ' + extra + "}\n")
    with pytest.raises(DataError, match=f"line 1 of {path}"):
        read_rollout_file(path, encode, decode, BYTE_VOCAB, FILE_SEQ)


def test_logps_on_some_lines_only_are_refused(tmp_path: Path) -> None:
    for lines, where in (
        ([{**GOOD, "logps": [-0.5, -0.25]}, {**GOOD, "completion": "3"}], 2),
        ([GOOD, {**GOOD, "logps": [-0.5, -0.25]}], 2),
    ):
        path = write_lines(tmp_path / "r.jsonl", lines)
        with pytest.raises(DataError, match=f"line {where} of .*'logps' given on some lines only") as caught:
            read_rollout_file(path, encode, decode, BYTE_VOCAB, FILE_SEQ)
        assert "\n" not in str(caught.value)


def test_an_empty_or_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    for text in ("", "\n\n  \n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(text)
        with pytest.raises(DataError, match="holds no completion") as caught:
            read_rollout_file(path, encode, decode, BYTE_VOCAB, FILE_SEQ)
        assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(DataError, match="no such file"):
        read_rollout_file(tmp_path / "absent.jsonl", encode, decode, BYTE_VOCAB, FILE_SEQ)


def test_a_good_file_is_read_in_the_order_of_each_groups_first_line(tmp_path: Path) -> None:
    lines = [
        {"group": "q2", "prompt": "2+2=", "completion": "4\n", "reward": 1.0, "logps": [-0.5, -0.25]},
        {
            "group": "q1",
            "prompt_ids": encode("1+1="),
            "completion_ids": encode("2\n"),
            "completion": "2\n",
            "reward": 1,
            "logps": [-1, 0],
        },
        {"group": "q2", "prompt": "2+2=", "completion_ids": [53, 10], "reward": 0.0, "logps": [-2.0, -0.125]},
        {"group": 7, "prompt": "3+3=", "completion": "6", "advantage": -0.5, "logps": [-0.75]},
    ]
    groups = read_rollout_file(write_lines(tmp_path / "r.jsonl", lines), encode, decode, BYTE_VOCAB, FILE_SEQ)
    assert [g.key for g in groups] == ["q2", "q1", "7"]
    q2, q1, seven = groups
    assert [c.tokens for c in q2.completions] == [encode("4\n"), [53, 10]]
    assert [c.reward for c in q2.completions] == [1.0, 0.0] and q2.completions[0].advantage is None
    assert q2.completions[1].old_logps == [-2.0, -0.125]
    assert q1.completions[0].prompt == encode("1+1=") and q1.completions[0].old_logps == [-1.0, 0.0]
    assert seven.completions[0].advantage == -0.5 and seven.completions[0].reward == 0.0


# -- 6. the ratio is 1 at the first update ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo"])
def test_the_ratio_is_one_at_the_first_update(policy_loss: str) -> None:
    policy, reference = models(10)
    groups = make_groups(seed=10)  # no old_logps: the statistics pass scores them with the policy itself
    settings = settings_for("token-mean", policy_loss)
    for world in (1, 2):
        per_rank = [step_batches(groups, 3, True, rank, world)[0] for rank in range(world)]
        measured_sums = []
        for rank, batches in enumerate(per_rank):
            engine, _ = make_engine(
                settings, policy, reference, SimulatedRank(rank=rank, world_size=world) if world > 1 else None
            )
            assert all(b.answers.rollout.old_logp is None for b in batches if b.answers.count)  # type: ignore[union-attr]
            summed, totals = engine.accumulate(batches, StepTotals({"token": float(TOKENS)}, "token", TOKENS))
            measured_sums.append(summed)
        _, measurement = summarize(engine.objective, torch.stack(measured_sums).sum(0).tolist(), totals)
        stats = measurement.values
        assert stats["ratio/abs_log"] == 0.0
        assert stats["clipped"] == 0.0
        assert stats["completion/tokens"] == TOKENS / COMPLETIONS
    # and the loss at ratio 1 is the reference's with b = l (the policy's own log-probabilities)
    expected = reference_step(settings, policy, reference, groups)
    assert expected.stats["ratio/abs_log"] == 0.0
    gradient, _, measured, _ = engine_step(settings, policy, reference, step_batches(groups, 3, True)[0])
    assert rel(gradient, expected.gradient) < TOL_REFERENCE
    assert measured["ratio/abs_log"] == 0.0 and measured["clipped"] == 0.0


def test_score_rollout_sets_the_old_policys_log_probabilities_once() -> None:
    policy, reference = models(11)
    groups = make_groups(seed=11)
    batches, _ = step_batches(groups, 4, True, rank=1, world=3)  # the last is padding
    assert batches[-1].answers is not None and batches[-1].answers.count == 0
    state = torch.get_rng_state()
    scorer = ReferenceScorer(copy.deepcopy(reference))
    score_rollout(policy, batches, CPU, lambda: torch.autocast("cpu", enabled=False), scorer)
    assert torch.equal(torch.get_rng_state(), state)
    for batch in batches:
        scores = batch.answers.rollout  # type: ignore[union-attr]
        with torch.no_grad():
            own = -token_scores(policy, batch)[..., 0]
            ref = -token_scores(reference, batch)[..., 0]
        assert scores.old_logp is not None and torch.equal(scores.old_logp, own)
        assert scores.ref_logp is not None and torch.equal(scores.ref_logp, ref)
        assert not scores.old_logp[batch.targets == IGNORE_INDEX].any()
    # scored once: a second pass (another model) leaves them as they are
    before = [b.answers.rollout.old_logp.clone() for b in batches]  # type: ignore[union-attr]
    score_rollout(reference, batches, CPU, lambda: torch.autocast("cpu", enabled=False), None)
    assert all(torch.equal(b.answers.rollout.old_logp, x) for b, x in zip(batches, before, strict=True))  # type: ignore[union-attr]
    # completions given old logps (a file's) are not scored
    given, _ = step_batches(with_old_logps(groups, policy), 4, True)
    olds = [b.answers.rollout.old_logp.clone() for b in given]  # type: ignore[union-attr]
    score_rollout(reference, given, CPU, lambda: torch.autocast("cpu", enabled=False), None)
    assert all(torch.equal(b.answers.rollout.old_logp, x) for b, x in zip(given, olds, strict=True))  # type: ignore[union-attr]


def test_settings_and_objective_refusals() -> None:
    for bad, match in (
        ({"aggregation": "mean"}, "--loss-aggregation"),
        ({"policy_loss": "reinforce"}, "--policy-loss"),
        ({"clip_low": 1.0}, "--clip-low"),
        ({"clip_high": -0.1}, "--clip-low"),
        ({"clip_high": math.inf}, "--clip-low"),
        ({"norm_constant": -1.0}, "must be positive"),
    ):
        with pytest.raises(ConfigError, match=match):
            RewardLossSettings(**bad)
    unset = RewardObjective(RewardLossSettings(aggregation="seq-mean-token-sum-norm", norm_constant=0.0))
    with pytest.raises(RuntimeError, match="constant C was never set"):  # 0: a rollouts file's, set once it is read
        unset.token_weights(step_batches(make_groups(SPEC[:1]), 8, True)[0][0])
    with pytest.raises(ConfigError, match="--kl-coef needs a reference"):
        RewardObjective(RewardLossSettings(kl_coef=0.1))
    objective = RewardObjective(settings_for("group-token-mean", "ppo"), ReferenceScorer(models()[1]))
    assert [(t.name, t.unit, t.weight) for t in objective.terms] == [
        ("policy", "group", 1.0),
        ("kl", "group", 0.05),
        ("entropy", "group", -0.01),
    ]
    assert objective.describe() == [
        "objective | grpo: policy per group + kl per group x 0.05 + entropy per group x -0.01 | ppo, clip 0.1/0.28, "
        "aggregation group-token-mean"
    ]
    lm_batch = MicroBatch(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="--objective grpo reads sampled completions"):
        objective.units(lm_batch)
    with pytest.raises(ValueError, match="this micro-batch has none"):
        score_rollout(models()[0], [lm_batch], CPU, lambda: torch.autocast("cpu", enabled=False), None)


class ScriptedMaker:
    """A sampler whose groups' rewards follow a script: each call to ``make`` takes the next rewards per group."""

    def __init__(self, rewards: list[list[float]]) -> None:
        self.rewards = rewards
        self.drawn = 0
        self.calls: list[int] = []

    def make(self, prompts: int) -> tuple[list[Group], float]:
        self.calls.append(prompts)
        groups = []
        for _ in range(prompts):
            rewards = self.rewards[min(self.drawn, len(self.rewards) - 1)]
            groups.append(Group(f"p{self.drawn}", [Completion([1, 2], [3 + i, 4], r) for i, r in enumerate(rewards)]))
            self.drawn += 1
        return groups, 0.5

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = int(state["drawn"])


def test_resample_replaces_flat_groups_with_further_prompts_then_drops_what_stays_flat() -> None:
    """--flat-groups resample (DAPO's dynamic sampling): each flat group is replaced by a group of the next prompt,
    round after round; after RESAMPLE_ROUNDS, groups still flat are dropped, and the step's facts say so."""
    varied, flat = [1.0, 0.0], [1.0, 1.0]
    maker = ScriptedMaker([varied, flat, varied, flat, flat, varied])  # prompts 1, 3 and 4 flat
    loader = RolloutLoader(maker, 3, 4, 8, flat_groups="resample")
    loader.micro_batches_next_step()
    assert maker.calls == [3, 1, 1, 1]  # prompt 1 -> prompt 3 (flat) -> prompt 4 (flat) -> prompt 5 (varied)
    assert [g.key for g in loader.pending[0]] == ["p0", "p2", "p5"]
    assert loader.step_facts() == {
        "groups/flat_share": 0.0,
        "groups/resampled": 3.0,
        "time/generation_s": 2.0,
        "reward/mean": 0.5,
        "reward/std": 0.5,
    }
    always_flat = ScriptedMaker([varied, flat])
    loader = RolloutLoader(always_flat, 2, 4, 8, flat_groups="resample")
    loader.micro_batches_next_step()
    assert always_flat.calls == [2] + [1] * RESAMPLE_ROUNDS
    facts = loader.step_facts()
    assert facts["groups/dropped"] == 1.0 and facts["groups/resampled"] == float(RESAMPLE_ROUNDS)
    with pytest.raises(ConfigError, match="--flat-groups"):
        step_completions(make_groups(SPEC[:1]), "std", "refill")


def test_a_groups_unit_is_shared_by_its_completions_by_their_tokens() -> None:
    """group-token-mean counts each completion's share of its group, |o_i| / T_g: a group cut across micro-batches
    counts 1 in all, and a micro-batch left out (a bad step's) takes exactly its share out of the count."""
    objective = RewardObjective(settings_for("group-token-mean", "ppo", kl=0.0, entropy=0.0))
    groups = make_groups(SPEC[:2])
    batches = step_batches(groups, 1, False)[0]  # one completion a micro-batch: every group cut
    shares = [objective.units(b)["group"] for b in batches]
    assert sum(shares) == pytest.approx(2.0, abs=1e-12)
    first = groups[0].completions
    total = sum(len(c.tokens) for c in first)
    assert shares[: len(first)] == pytest.approx([len(c.tokens) / total for c in first])


def test_a_rollout_whose_every_group_is_dropped_is_followed_by_the_next() -> None:
    """--flat-groups drop: a sampled rollout with no group left to train is not a step; the next rollout is sampled
    (a step of a file is the trainer's to skip), and a run of them stops in one line."""
    varied, flat = [1.0, 0.0], [1.0, 1.0]
    maker = ScriptedMaker([flat, flat, varied, varied])
    loader = RolloutLoader(maker, 2, 4, 8, flat_groups="drop")
    assert loader.micro_batches_next_step() == 1
    assert maker.calls == [2, 2] and [g.key for g in loader.pending[0]] == ["p2", "p3"]
    never = RolloutLoader(ScriptedMaker([flat]), 2, 4, 8, flat_groups="drop")
    with pytest.raises(DataError, match=f"{MAX_EMPTY_ROLLOUTS} rollouts in a row held no group whose rewards differ"):
        never.micro_batches_next_step()


def test_a_reward_reads_the_completion_without_the_end_of_text_token() -> None:
    """The end-of-text token is a marker, not text: the reward functions read the completion without it (a --stop
    text such as a newline is the completion's own and stays)."""
    from bigbatch.data.tokenizers import ByteTokenizer
    from bigbatch.rewards.functions import RewardSet, RewardSpec
    from bigbatch.rewards.rollout_maker import PromptRow, SampledRollouts, SamplerSettings

    class EndOfText(ByteTokenizer):
        eot_token = 0  # the byte 0 stands for an end-of-text token here

        def decode(self, tokens: list[int]) -> str:
            return "".join("<|end|>" if t == 0 else chr(t) for t in tokens)

    prompt = PromptRow({"prompt": "1+1=", "answer": "2"}, list(b"1+1="), 1)
    rollouts = SampledRollouts(
        [prompt],
        RewardSet([RewardSpec("exact-answer")]),
        SamplerSettings(max_tokens=4),
        EndOfText(),
        16,
        0,
        DistContext(),
        CPU,
        "p.jsonl",
    )
    group = rollouts._scored(prompt, [[ord("2"), 0], [ord("2"), ord("\n")], [ord("3"), 0]])
    assert [c["reward"] for c in group["completions"]] == [1.0, 1.0, 0.0]
    assert group["completions"][0]["tokens"] == [ord("2"), 0]  # the token itself is trained


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_completions_are_scored_at_the_sampling_temperature(temperature: float) -> None:
    """Every log-probability and entropy is of the logits divided by the sampler's temperature (the distribution
    the completions were drawn from): the chunked head's, and a plain model's from its logits."""
    policy, _ = models(5)
    batch = step_batches(make_groups(SPEC[:2], seed=5), 8, True)[0][0]
    with torch.no_grad():
        scores = token_scores(policy, batch, temperature)  # (B, T, 2)
        logits = policy(batch.inputs, positions=batch.positions).double() / temperature  # (B, T, V)
    logp = torch.log_softmax(logits, dim=-1)
    inside = batch.targets != IGNORE_INDEX
    target_logp = logp.gather(-1, batch.targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(-scores[..., 0][inside].double(), target_logp[inside], atol=1e-5)
    assert torch.allclose(scores[..., 1][inside].double(), entropy[inside], atol=1e-5)

    class Plain(nn.Module):  # a model that returns logits (no chunked head)
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.inner(idx)

    unpacked = step_batches(make_groups(SPEC[:2], seed=5), 8, False)[0][0]
    with torch.no_grad():
        plain = token_scores(Plain(policy), unpacked, temperature)
        chunked = token_scores(policy, unpacked, temperature)
    assert torch.allclose(plain, chunked, atol=1e-5)


def test_every_aggregation_offered_has_a_unit() -> None:
    from bigbatch.engine.policy_gradient import AGGREGATION_UNIT

    assert set(AGGREGATION_UNIT) == set(LOSS_AGGREGATIONS) and set(AGGREGATION_UNIT.values()) <= set(UNITS)
