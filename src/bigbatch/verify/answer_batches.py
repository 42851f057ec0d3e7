"""Synthetic answers for checking an objective over answers: random groups (preference pairs, KTO rows with their
KL answers) and micro-batches that hold whole groups, one document a row or packed several to a row.

The verifier (:mod:`bigbatch.verify.objective_terms`) cuts the same groups into micro-batches every way a run
might (even, uneven, shuffled, with a micro-batch holding none) and compares each term's gradient with the one
of all the groups in a single micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """A prompt and its answers: a pair ``[chosen, rejected]`` or a KTO row ``[completion, KL completion]``."""

    prompt: list[int]
    answers: list[list[int]]
    roles: list[int]

    def documents(self) -> list[tuple[list[int], list[bool]]]:
        """Each answer's document (prompt + answer) and which of its tokens are trained (the answer's)."""
        return [(self.prompt + a, [False] * len(self.prompt) + [True] * len(a)) for a in self.answers]


def random_pairs(n: int, vocab: int, seed: int, prompt_max: int = 5, answer_max: int = 6) -> list[Group]:
    """``n`` preference pairs of random tokens, prompts of 1..``prompt_max`` and answers of 1..``answer_max``."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(high: int) -> list[int]:
        length = int(torch.randint(1, high + 1, (1,), generator=gen))
        return [int(t) for t in torch.randint(0, vocab, (length,), generator=gen)]

    return [
        Group(tokens(prompt_max), [tokens(answer_max), tokens(answer_max)], [ROLE_CHOSEN, ROLE_REJECTED])
        for _ in range(n)
    ]


def random_kto_rows(n: int, vocab: int, seed: int, prompt_max: int = 5, answer_max: int = 6) -> list[Group]:
    """``n`` KTO rows, a third of them undesirable, each with its KL answer: row i's prompt with row i+1's
    completion (as prepared data pairs them)."""
    pairs = random_pairs(n, vocab, seed, prompt_max, answer_max)
    completions = [g.answers[0] for g in pairs]
    return [
        Group(
            g.prompt,
            [completions[i], completions[(i + 1) % n]],
            [ROLE_DESIRABLE if i % 3 != 1 else ROLE_UNDESIRABLE, ROLE_KL],
        )
        for i, g in enumerate(pairs)
    ]


def answer_micro_batch(
    groups: list[Group], seq_len: int, packed: bool, rows: int = 1, isolated: bool = True
) -> MicroBatch:
    """The groups in one micro-batch of at least ``rows`` rows: one document a row, or (``packed``) documents back
    to back, first fit in order, positions restarting at each document. Answer tokens' targets are the next
    tokens; a prompt's, the padding's and a target across two documents are -100. ``isolated`` False drops the
    positions of a packed row (documents then attend to each other: the verifier's negative control)."""
    docs = [(doc, gi, role) for gi, g in enumerate(groups) for doc, role in zip(g.documents(), g.roles, strict=True)]
    width = seq_len + 1
    layout: list[list[tuple[int, int]]] = []  # per row: (document, its first column)
    fill: list[int] = []
    for d, ((tokens, _), _, _) in enumerate(docs):
        if len(tokens) > width:
            raise ValueError(f"a document of {len(tokens)} tokens does not fit a row of {width}")
        for r, used in enumerate(fill):
            if packed and used + len(tokens) <= width:
                layout[r].append((d, used))
                fill[r] += len(tokens)
                break
        else:
            layout.append([(d, 0)])
            fill.append(len(tokens))
    n_rows = max(rows, len(layout), 1)
    tokens_t = torch.zeros(n_rows, width, dtype=torch.long)
    trained = torch.zeros(n_rows, width, dtype=torch.bool)
    owner = torch.full((n_rows, width), -1, dtype=torch.long)
    positions = torch.zeros(n_rows, width, dtype=torch.long)
    for r, row in enumerate(layout):
        end = 0
        for d, start in row:
            (toks, mask), _, _ = docs[d]
            stop = start + len(toks)
            tokens_t[r, start:stop] = torch.tensor(toks)
            trained[r, start:stop] = torch.tensor(mask)
            owner[r, start:stop] = d
            positions[r, start:stop] = torch.arange(len(toks))
            end = stop
        positions[r, end:] = torch.arange(width - end)  # the padding: a segment of its own
    targets = tokens_t[:, 1:].clone()
    keep = trained[:, 1:] & (owner[:, 1:] == owner[:, :-1]) & (owner[:, 1:] >= 0)  # (rows, T)
    targets[~keep] = IGNORE_INDEX
    segment = torch.where(keep, owner[:, 1:], torch.full_like(targets, -1))
    answers = Answers(
        segment,
        torch.tensor([gi for _, gi, _ in docs], dtype=torch.long),
        torch.tensor([role for _, _, role in docs], dtype=torch.long),
    )
    packed_positions = positions[:, :-1] if packed and isolated else None
    return MicroBatch(tokens_t[:, :-1], targets, packed_positions, answers=answers)


def split_groups(groups: list[Group], sizes: list[int]) -> list[list[Group]]:
    """``groups`` cut in order into parts of ``sizes`` (which add up to all of them; a 0 is an empty part)."""
    if sum(sizes) != len(groups):
        raise ValueError(f"sizes {sizes} do not add up to {len(groups)} groups")
    parts, at = [], 0
    for size in sizes:
        parts.append(groups[at : at + size])
        at += size
    return parts
