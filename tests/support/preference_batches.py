"""Hand-built preference micro-batches and an independent float64 reference of every preference objective.

A *group* here is a prompt with its answers: a pair (chosen, rejected) or a KTO row (completion with its label,
then a KL answer: the prompt followed by another row's completion). Groups are made of random token ids; micro-
batches hold whole groups, one document a row (unpacked) or documents back to back in rows (packed, positions
restarting per document). The reference scores every answer alone (its own forward, no padding, no neighbour),
in float64, and writes each objective's formula out longhand: nothing of it comes from the engine's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.engine.batch import (
    IGNORE_INDEX,
    ROLE_CHOSEN,
    ROLE_DESIRABLE,
    ROLE_KL,
    ROLE_REJECTED,
    ROLE_UNDESIRABLE,
    Answers,
    MicroBatch,
)


@dataclass(frozen=True)
class Group:
    prompt: list[int]
    answers: list[list[int]]  # pair: [chosen, rejected]; KTO: [completion, KL completion]
    roles: list[int]


def random_pairs(n: int, vocab: int, seed: int, prompt_max: int = 5, answer_max: int = 6) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)

    def tokens(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high + 1, (1,), generator=gen))
        return torch.randint(0, vocab, (length,), generator=gen).tolist()

    return [
        Group(tokens(1, prompt_max), [tokens(1, answer_max), tokens(1, answer_max)], [ROLE_CHOSEN, ROLE_REJECTED])
        for _ in range(n)
    ]


def random_kto_rows(n: int, vocab: int, seed: int) -> list[Group]:
    """KTO rows, labels mixed, each with its KL answer: row i's prompt with row i+1's completion."""
    pairs = random_pairs(n, vocab, seed)
    completions = [g.answers[0] for g in pairs]
    rows = []
    for i, g in enumerate(pairs):
        label = ROLE_DESIRABLE if i % 3 != 1 else ROLE_UNDESIRABLE
        rows.append(Group(g.prompt, [completions[i], completions[(i + 1) % n]], [label, ROLE_KL]))
    return rows


def documents(group: Group) -> list[tuple[list[int], list[bool]]]:
    """Each answer's document: prompt + answer tokens, and which tokens are trained (the answer's)."""
    return [(group.prompt + a, [False] * len(group.prompt) + [True] * len(a)) for a in group.answers]


def micro_batch(groups: list[Group], seq_len: int, packed: bool, rows: int | None = None) -> MicroBatch:
    """The groups in one micro-batch: unpacked, one document a row; packed, documents back to back (first fit
    in order), positions restarting per document. Targets of answer tokens are the next tokens, -100 elsewhere."""
    docs = [(doc, gi, role) for gi, g in enumerate(groups) for doc, role in zip(documents(g), g.roles, strict=True)]
    layout: list[list[tuple[int, int]]] = []  # per row: (doc index, start column)
    if not packed:
        layout = [[(d, 0)] for d in range(len(docs))]
    else:
        fill: list[int] = []
        for d, ((tokens, _), _, _) in enumerate(docs):
            need = len(tokens)
            for r, used in enumerate(fill):
                if used + need <= seq_len + 1:
                    layout[r].append((d, used))
                    fill[r] += need
                    break
            else:
                layout.append([(d, 0)])
                fill.append(need)
    n_rows = max(rows or 0, len(layout), 1)
    width = seq_len + 1
    tokens_t = torch.zeros(n_rows, width, dtype=torch.long)
    trained = torch.zeros(n_rows, width, dtype=torch.bool)
    owner = torch.full((n_rows, width), -1, dtype=torch.long)
    positions = torch.zeros(n_rows, width, dtype=torch.long)
    for r, row in enumerate(layout):
        end = 0
        for d, start in row:
            (toks, mask), _, _ = docs[d]
            assert start + len(toks) <= width, "a document longer than a row"
            tokens_t[r, start : start + len(toks)] = torch.tensor(toks)
            trained[r, start : start + len(toks)] = torch.tensor(mask)
            owner[r, start : start + len(toks)] = d
            positions[r, start : start + len(toks)] = torch.arange(len(toks))
            end = start + len(toks)
        positions[r, end:] = torch.arange(width - end)  # padding: a segment of its own
    inputs, targets = tokens_t[:, :-1], tokens_t[:, 1:].clone()
    # a target counts when its token is trained and belongs to the same document as its input
    same_doc = (owner[:, 1:] == owner[:, :-1]) & (owner[:, 1:] >= 0)
    keep = trained[:, 1:] & same_doc
    targets[~keep] = IGNORE_INDEX
    segment = torch.where(keep, owner[:, 1:], torch.full_like(targets, -1))
    answers = Answers(
        segment,
        torch.tensor([gi for _, gi, _ in docs], dtype=torch.long),
        torch.tensor([role for _, _, role in docs], dtype=torch.long),
    )
    return MicroBatch(inputs, targets, positions[:, :-1] if packed else None, answers=answers)


def split_groups(groups: list[Group], sizes: list[int]) -> list[list[Group]]:
    out, at = [], 0
    for size in sizes:
        out.append(groups[at : at + size])
        at += size
    assert at == len(groups)
    return out


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
