"""An independent float64 reference of every preference objective, over the verifier's synthetic groups
(:mod:`bigbatch.verify.answer_batches`: pairs, KTO rows with their KL answers, and micro-batches holding whole
groups, one document a row or packed). The reference scores every answer alone (its own forward, no padding, no
neighbour), in float64, and writes each objective's formula out longhand: nothing of it comes from the engine.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.engine.batch import ROLE_DESIRABLE, MicroBatch
from bigbatch.verify.answer_batches import (
    Group,
    answer_micro_batch,
    random_kto_rows,
    random_pairs,
    split_groups,
)

__all__ = [
    "Group",
    "answer_logp",
    "gradient_of",
    "micro_batch",
    "random_kto_rows",
    "random_pairs",
    "reference_objective",
    "rel",
    "split_groups",
]


def micro_batch(groups: list[Group], seq_len: int, packed: bool, rows: int | None = None) -> MicroBatch:
    return answer_micro_batch(groups, seq_len, packed, rows or 1)


def answer_logp(model: nn.Module, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """``log p(answer | prompt)`` from the answer's own forward (float64 if the model is)."""
    tokens = torch.tensor([prompt + answer])
    logits = model(tokens[:, :-1])
    logits = getattr(logits, "logits", logits)
    logp = torch.log_softmax(logits.double(), dim=-1)[0]  # (L-1, V)
    start = len(prompt) - 1
    targets = tokens[0, 1:]
    return logp[start:, :].gather(1, targets[start:, None]).sum()


def reference_objective(
    name: str,
    policy: nn.Module,
    reference: nn.Module | None,
    groups: list[Group],
    beta: float,
    *,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """The objective of the whole batch of ``groups`` in float64, written longhand from the papers' formulas."""

    def lp(model: nn.Module, prompt: list[int], answer: list[int]) -> torch.Tensor:
        return answer_logp(model, prompt, answer)

    if name == "kto":
        assert reference is not None
        with torch.no_grad():
            kl = [lp(policy, g.prompt, g.answers[1]) - lp(reference, g.prompt, g.answers[1]) for g in groups]
        z = max(0.0, float(torch.stack(kl).mean()))
        losses = []
        for g in groups:
            with torch.no_grad():
                ref = lp(reference, g.prompt, g.answers[0])
            r = lp(policy, g.prompt, g.answers[0]) - ref
            if g.roles[0] == ROLE_DESIRABLE:
                losses.append(desirable_weight * (1 - torch.sigmoid(beta * (r - z))))
            else:
                losses.append(undesirable_weight * (1 - torch.sigmoid(beta * (z - r))))
        return torch.stack(losses).mean()
    per_pair, nll_sum, nll_tokens = [], torch.zeros((), dtype=torch.float64), 0
    for g in groups:
        c, r = g.answers
        pc, pr = lp(policy, g.prompt, c), lp(policy, g.prompt, r)
        if name == "simpo":
            per_pair.append(-F.logsigmoid(beta * (pc / len(c) - pr / len(r)) - gamma))
            continue
        if name == "orpo":
            mc, mr = pc / len(c), pr / len(r)
            odds = (mc - torch.log1p(-torch.exp(mc))) - (mr - torch.log1p(-torch.exp(mr)))
            per_pair.append(-F.logsigmoid(odds))
            nll_sum = nll_sum - pc
            nll_tokens += len(c)
            continue
        assert reference is not None
        with torch.no_grad():
            rc, rr = lp(reference, g.prompt, c), lp(reference, g.prompt, r)
        if name == "ipo":
            h = (pc / len(c) - rc / len(c)) - (pr / len(r) - rr / len(r))
            per_pair.append((h - 1 / (2 * beta)) ** 2)
            continue
        logits = beta * ((pc - rc) - (pr - rr))
        per_pair.append(-(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits))
    mean = torch.stack(per_pair).mean()
    if name == "orpo":
        return nll_sum / nll_tokens + beta * mean
    return mean


def gradient_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), math.ulp(1.0)))
