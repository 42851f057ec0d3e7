"""Data whose documents are *answers* for an objective that compares them: preference pairs (DPO, IPO, SimPO,
ORPO) and KTO rows. The vocabulary shared by preparing, loading and the objectives' check.

A row of such data becomes a *group* of documents that is never split between micro-batches or ranks:

* a **pair**: ``prompt + chosen`` (role chosen), then ``prompt + rejected`` (role rejected);
* a **KTO row**: ``prompt + completion`` (role desirable when ``label`` is true, else undesirable), then its *KL
  document*: the same prompt followed by the next row's completion (role KL, only the reference point of the KL
  estimate: see :mod:`bigbatch.data.answer_prepare`).

Every document's trained span (its targets that are not -100) is its answer: the prompt's targets are masked.
The roles are stored per document beside the shards (``*.roles.npy``, int8) and ``meta.json`` says which kind the
dataset holds (``extra["answers"]``: ``"pairs"`` or ``"kto"``; absent for ordinary data).

This module imports nothing heavy: ``bigbatch prepare`` reads it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigbatch.errors import ConfigError, DataError
from bigbatch.settings.choices import BAD_ROWS, LONG_CONVERSATIONS

PAIRS = "pairs"
KTO = "kto"
ANSWER_KINDS = (PAIRS, KTO)

# The engine's ROLE_* (bigbatch.engine.batch), the contract with the objectives. They are repeated here because
# that module imports torch, which preparing data must not (tests/unit/test_answer_rows.py checks they agree).
ROLE_CHOSEN, ROLE_REJECTED, ROLE_DESIRABLE, ROLE_UNDESIRABLE, ROLE_KL = 0, 1, 2, 3, 4
ROLE_NAMES = {
    ROLE_CHOSEN: "chosen",
    ROLE_REJECTED: "rejected",
    ROLE_DESIRABLE: "desirable",
    ROLE_UNDESIRABLE: "undesirable",
    ROLE_KL: "KL",
}
GROUP_ROLES: dict[str, tuple[tuple[int, ...], ...]] = {
    PAIRS: ((ROLE_CHOSEN,), (ROLE_REJECTED,)),
    KTO: ((ROLE_DESIRABLE, ROLE_UNDESIRABLE), (ROLE_KL,)),
}
"""The roles each document of a group may have, in order: a group's documents are stored back to back."""
GROUP_SIZE = 2
"""Documents per group, for both kinds."""


PAIR_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
KTO_OBJECTIVES = ("kto",)


@dataclass(frozen=True)
class AnswerSettings:
    """How rows of answers become groups: what becomes of a bad row, and of a group with a document longer than a
    row of ``max_tokens`` (``seq_len + 1``; 0: no limit when preparing, the loader then refuses what does not fit).
    ``long_rows``: ``drop-oldest-turns`` (a conversational prompt loses its oldest rounds, the system prompt
    stays; a text prompt cannot, so the row is dropped), ``drop`` or ``refuse``."""

    bad_rows: str = "refuse"
    long_rows: str = "drop-oldest-turns"
    max_tokens: int = 0

    def __post_init__(self) -> None:
        BAD_ROWS.check(self.bad_rows)
        LONG_CONVERSATIONS.check(self.long_rows, "long_conversations")
        if self.max_tokens < 0:
            raise ConfigError(f"max_tokens must be 0 (no limit) or positive, not {self.max_tokens}")

    def key(self) -> str:
        """What goes into the cache key of raw rows of answers prepared with these settings (``v1``: the reader;
        a later change to how rows become documents bumps it)."""
        return f"answers=v1,bad_rows={self.bad_rows},long={self.long_rows},max_tokens={self.max_tokens}"


def answer_kind(record: object) -> str:
    """``pairs`` for a row with ``chosen`` or ``rejected``, ``kto`` for one with ``completion`` and ``label``, else
    ``""`` (an ordinary row: text, prompt/completion, a conversation). A row of a kind that misses a field is still
    of that kind: preparing it says what is missing. ``label`` alone (classification rows beside ``text``) is not
    KTO."""
    if not isinstance(record, dict):
        return ""
    if "chosen" in record or "rejected" in record:
        return PAIRS
    if "completion" in record and "label" in record:
        return KTO
    return ""


def objective_reads(objective: str) -> str:
    """The kind of answers ``objective`` trains on: ``pairs``, ``kto``, or ``""`` (``lm`` and anything else that
    reads ordinary documents)."""
    if objective in PAIR_OBJECTIVES:
        return PAIRS
    if objective in KTO_OBJECTIVES:
        return KTO
    return ""


def check_answers_for_objective(answers: str, objective: str) -> None:
    """Refuse, in one line naming the fix, data whose answers ``objective`` does not read: pairs for anything but
    dpo, ipo, simpo and orpo; KTO rows for anything but kto; ordinary documents for any of those. ``answers``:
    the dataset's (``dataset.answers``: ``""``, ``pairs`` or ``kto``)."""
    wanted = objective_reads(objective)
    if answers == wanted:
        return
    pair_flags = " | ".join(f"--objective {name}" for name in PAIR_OBJECTIVES)
    if answers == PAIRS:
        raise DataError(
            f"the data holds preference pairs (prompt, chosen, rejected), which --objective {objective} does not read; "
            f"train them with {pair_flags}"
        )
    if answers == KTO:
        raise DataError(
            f"the data holds KTO rows (prompt, completion, label), which --objective {objective} does not read; train "
            "them with --objective kto (or drop 'label' to train the completions with --objective lm)"
        )
    shape = "prompt, chosen and rejected" if wanted == PAIRS else "prompt, completion and a true/false label"
    raise DataError(
        f"--objective {objective} trains on rows of {shape}, and the data holds ordinary documents; give such rows "
        "(.jsonl or hf:), or train with --objective lm"
    )
