"""The differential fuzzer (tests/support/fuzz.py) on its fixed seeds, and proof that it catches planted bugs.

Each seed is a random setting trained through ``bigbatch train``'s code path and replayed by a naive
float64 reference (one forward/backward over every sample of the global step, clip, AdamW, schedule);
see tests/support/fuzz_reference.py for what is compared and how exactly-zero gradients are handled.
``make fuzz N=200`` runs random seeds.
"""

from __future__ import annotations

from pathlib import Path

import fuzz
import pytest
from fuzz_reference import IGNORE, Outcome, _valid, document_rows, expected_steps
from fuzz_settings import CLIPS, LAST_WINDOWS, LONG_DOCUMENTS, MODES, PARALLELS, draw

ONE_RANK = [seed for seed in fuzz.FIXED_SEEDS if draw(seed).world == 1]
TWO_RANKS = [seed for seed in fuzz.FIXED_SEEDS if draw(seed).world == 2]
PLANTED_SEED = 453  # documents, ragged, K 4 with a short last window, a decaying lr, clipping that bites


def explain(outcome: Outcome) -> str:
    return "\n".join([*outcome.problems, f"reproduce: {fuzz.repro(outcome.seed)}"])


def step_events(seed: int) -> set[str]:
    s = draw(seed)
    events: set[str] = set()
    steps = expected_steps(s, s.max_steps, events)
    for step in steps:
        total = sum(_valid(micro) for micro in step)
        if total == 0:
            events.add("no valid target")
        if s.k and len(step) < s.k:
            events.add("short last window")
        if not s.k and total < s.token_budget:
            events.add("partial budget step")
    if not s.k and len({len(step) for step in steps}) > 1:
        events.add("K varies")
    return events


LONG_DOCUMENT_EVENTS = {
    "split: long document",  # a second or later window of a document longer than seq_len + 1 tokens
    "split: long document with a masked prompt",
    "split: a later window starts inside the prompt",  # the prompt's mask carries over a window boundary
    "truncate: long document",  # the cut row of a document longer than seq_len + 1 tokens
    "truncate: long document with a masked prompt",
}


SHUFFLE_EVENTS = {
    "shuffle: a shifted epoch",  # packed: an epoch after the first, every window moved 1 .. T - 1 tokens
    "shuffle: the last window moved",  # the corpus's last window, moved: the shift still fits
    "shuffle: the last window kept in place",  # ... kept: the shift would run past the corpus's end
    "shuffle: a micro-batch straddles the epoch's end",  # one micro-batch: the end of an epoch, the next's start
    "shuffle: documents of a later epoch",  # documents: a second epoch, in its own permutation
}


def test_fixed_seeds_cover_every_drawn_choice() -> None:
    settings = [draw(seed) for seed in fuzz.FIXED_SEEDS]
    for world in (1, 2):
        mine = [s for s in settings if s.world == world]
        assert {s.mode for s in mine} == set(MODES)
        assert {s.shuffle for s in mine} == {True, False}
        # packed windows shuffled and then shifted in a later epoch, on one and two ranks
        assert "shuffle: a shifted epoch" in set().union(*(step_events(s.seed) for s in mine))
        assert {bool(s.k) for s in mine} == {True, False}
        assert {s.last_window for s in mine} == set(LAST_WINDOWS)
        assert {s.clip for s in mine} == set(CLIPS)
        assert {s.long_documents for s in mine if s.mode == "documents"} == set(LONG_DOCUMENTS)
        # documents longer than seq_len + 1 are actually read under split on one and two ranks
        assert "split: long document" in set().union(*(step_events(s.seed) for s in mine))
    assert {s.parallel for s in settings} == set(PARALLELS)
    assert any(s.sync_every_micro_step for s in settings) and any(s.activation_checkpointing for s in settings)
    events = set().union(*(step_events(seed) for seed in fuzz.FIXED_SEEDS))
    assert events >= {"no valid target", "short last window", "partial budget step", "K varies", "dropped"}
    assert events >= LONG_DOCUMENT_EVENTS
    assert events >= SHUFFLE_EVENTS


def test_the_reference_reads_long_documents_as_the_readme_says() -> None:
    """The reference's own rows for one 8-token document with T = 3, worked out by hand."""
    def rows(prompt: str, policy: str) -> list[tuple[list[int], list[int]]]:
        return [(x.tolist(), y.tolist()) for x, y, _ in document_rows(prompt.encode(), b"abcdefgh", 3, policy)]

    def row(inputs: str, targets: str) -> tuple[list[int], list[int]]:  # "_": padding, or a masked target
        pad = lambda text, fill: [fill if c == "_" else ord(c) for c in text]  # noqa: E731
        return pad(inputs, 0), pad(targets, IGNORE)

    # split: targets 1..7 in runs of 3; each row's inputs are the tokens just before its targets
    assert rows("ab", "split") == [row("abc", "_cd"), row("def", "efg"), row("g__", "h__")]
    assert rows("abcde", "split") == [row("abc", "___"), row("def", "_fg"), row("g__", "h__")]  # mask crosses a window
    assert rows("", "split") == [row("abc", "bcd"), row("def", "efg"), row("g__", "h__")]
    # truncate: the first T + 1 tokens only
    assert rows("ab", "truncate") == [row("abc", "_cd")]
    assert rows("abcdefgh", "truncate") == [row("abc", "___")]
    # a single token has no target: one empty row either way; T + 1 tokens are one full row either way
    for policy in ("split", "truncate"):
        assert [(x.tolist(), y.tolist()) for x, y, _ in document_rows(b"", b"a", 3, policy)] == [row("___", "___")]
        assert [(x.tolist(), y.tolist()) for x, y, _ in document_rows(b"", b"abcd", 3, policy)] == [row("abc", "bcd")]


@pytest.mark.parametrize("seed", ONE_RANK)
def test_one_rank_matches_the_naive_giant_batch(seed: int, tmp_path: Path) -> None:
    outcome = fuzz.run_one_rank(draw(seed), tmp_path)
    assert outcome.ok, explain(outcome)
    assert outcome.steps == draw(seed).max_steps


@pytest.fixture(scope="module")
def two_rank_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Outcome]:
    """All two-rank seeds in one torchrun job (its start-up is most of the cost)."""
    return fuzz.torchrun_results([draw(seed) for seed in TWO_RANKS], tmp_path_factory.mktemp("fuzz"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", TWO_RANKS)
def test_two_ranks_match_the_naive_giant_batch(seed: int, two_rank_outcomes: dict[int, Outcome]) -> None:
    outcome = two_rank_outcomes[seed]
    assert outcome.ok, explain(outcome)
    assert outcome.steps == draw(seed).max_steps


@pytest.mark.parametrize(
    ("sabotage", "caught"),
    [
        ("mean_over_k", "the parameters:"),
        ("schedule_off_by_one", "learning rate"),
        ("no_clip", "the parameters:"),
        ("drop_last_micro_batch", "K=3 per rank, expected 4"),
        ("other_long_documents", "bigbatch's samples differ from the reference's assembly"),
    ],
)
def test_the_fuzzer_catches_a_planted_bug(sabotage: str, caught: str, tmp_path: Path) -> None:
    setting = draw(PLANTED_SEED)
    assert setting.mode == "documents" and setting.k == 4 and setting.clip == "tight"
    outcome = fuzz.run_one_rank(setting, tmp_path, sabotage=sabotage)
    assert not outcome.ok
    assert any(caught in problem for problem in outcome.problems), outcome.problems
