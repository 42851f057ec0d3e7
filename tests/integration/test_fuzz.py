"""The differential fuzzer (tests/support/fuzz.py) on its fixed seeds, and proof that it catches planted bugs.

Each seed is a random setting (a GPT-2, a Llama, transformers' Llama through hf:DIR or a mixture of experts with
its balancing loss over the step among its choices) trained through ``bigbatch train``'s code
path and replayed by a naive float64 reference (one forward/backward over every sample of the global step, clip,
AdamW, schedule); see tests/support/fuzz_reference.py for what is compared, how exactly-zero gradients are
handled and the shuffled window order (``--shuffle on``) the reference replays. ``make fuzz N=200`` runs random
seeds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import fuzz
import pytest
import torch
from fuzz_reference import IGNORE, Outcome, _valid, document_rows, expected_steps, permutation, shift, shifted_window
from fuzz_settings import CLIPS, FAMILIES, LAST_WINDOWS, LONG_DOCUMENTS, MODES, PARALLELS, draw

ONE_RANK = [seed for seed in fuzz.FIXED_SEEDS if draw(seed).world == 1]
TWO_RANKS = [seed for seed in fuzz.FIXED_SEEDS if draw(seed).world == 2]
PLANTED_ONE_RANK = [seed for seed in fuzz.PLANTED_ROUTER_SEEDS if draw(seed).world == 1]
PLANTED_TWO_RANKS = [seed for seed in fuzz.PLANTED_ROUTER_SEEDS if draw(seed).world == 2]
PLANTED_SEED = 453  # documents, ragged, K 4 with a short last window, a decaying lr, clipping that bites
SHUFFLED_PACKED_SEED = 2  # packed, shuffled, B 1 x T 13, 5 windows, K 3 x 4 steps: epochs 0, 1 and 2 are read


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
    "shuffle: the last window moved onto the corpus's last token",  # ... exactly: the boundary case
    "shuffle: the last window kept in place",  # ... kept: the shift would run past the corpus's end
    "shuffle: a micro-batch straddles an epoch end",  # one micro-batch: the end of an epoch, the next's start
    "shuffle: documents of a later epoch",  # documents: a second epoch, in its own permutation
}


def test_fixed_seeds_cover_every_drawn_choice() -> None:
    settings = [draw(seed) for seed in fuzz.FIXED_SEEDS]
    for world in (1, 2):
        mine = [s for s in settings if s.world == world]
        assert {s.family for s in mine} == set(FAMILIES)  # GPT-2's pico, llama-pico and transformers' Llama
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
        # documents packed several to a row (and one per row) on one and two ranks
        assert {s.pack for s in mine if s.mode == "documents"} == {True, False}
        assert "pack: a row holds several documents" in set().union(*(step_events(s.seed) for s in mine))
    assert {s.parallel for s in settings} == set(PARALLELS)
    assert {s.parallel for s in settings if s.family == "llama" and s.world == 2} == {"ddp", "fsdp"}
    assert {s.parallel for s in settings if s.family == "hf" and s.world == 2} == {"ddp", "fsdp"}
    assert {s.parallel for s in settings if s.family == "moe" and s.world == 2} == {"ddp", "fsdp"}
    moe = [s for s in settings if s.family == "moe"]
    assert {s.router_balance for s in moe} == {"exact"}  # the fixed seeds must match; the planted ones differ
    assert any(s.pack for s in moe) and any(s.activation_checkpointing for s in moe) and any(s.k > 1 for s in moe)
    planted = [draw(seed) for seed in fuzz.PLANTED_ROUTER_SEEDS]
    assert {s.router_balance for s in planted} == {"running", "micro"} and all(s.expect_difference for s in planted)
    assert any(s.family == "hf" and s.pack for s in settings)  # transformers' attention from position_ids
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


def test_the_reference_reads_shuffled_windows_as_the_readme_says() -> None:
    """The reference's shuffled packed windows, worked out by hand on 11 tokens with T = 3 (3 windows)."""
    tokens = torch.tensor(list(b"abcdefghijk"))

    def window(w: int, moved: int) -> str:
        inputs, targets = shifted_window(tokens, 3, w, moved)
        assert inputs[1:].tolist() == targets[:-1].tolist()  # targets are the inputs moved by one token
        return bytes(inputs.tolist() + targets[-1:].tolist()).decode()

    assert [window(w, 0) for w in range(3)] == ["abcd", "defg", "ghij"]  # the tail "k" is never read unmoved
    assert [window(w, 1) for w in range(3)] == ["bcde", "efgh", "hijk"]  # the last window fits moved by one
    assert [window(w, 2) for w in range(3)] == ["cdef", "fghi", "ghij"]  # ... not by two: it stays in place
    # epoch 0 is never moved; later epochs by 1 .. T - 1, drawn per epoch; every epoch a permutation of its own
    assert [shift(13, 7, 0), shift(1, 7, 5)] == [0, 0]
    assert all(1 <= shift(13, 7, e) < 13 for e in range(1, 50)) and len({shift(13, 7, e) for e in range(1, 50)}) > 1
    orders = [permutation(20, 7, e) for e in range(3)]
    assert all(sorted(order) == list(range(20)) for order in orders) and len({tuple(o) for o in orders}) == 3
    # Two ranks of B = 1 over those 3 windows, K = 2: global micro-batch m is rows 2m (rank 0) and 2m + 1 (rank
    # 1) of the endless stream; row 3 is the first of epoch 1, read in epoch 1's order and moved by its shift.
    setting = replace(
        draw(SHUFFLED_PACKED_SEED), world=2, parallel="ddp", micro_batch=1, seq_len=3, k=2, corpus="abcdefghijk"
    )
    seed = setting.init_seed
    first, second = permutation(3, seed, 0), permutation(3, seed, 1)
    events: set[str] = set()
    step = expected_steps(setting, 1, events)[0]
    got = [[bytes(x[0].tolist() + y[0, -1:].tolist()).decode() for x, y in micro] for micro in step]
    assert got == [
        [window(first[0], 0), window(first[1], 0)],
        [window(first[2], 0), window(second[0], shift(3, seed, 1))],
    ]
    assert "shuffle: a micro-batch straddles an epoch end" in events and "shuffle: a shifted epoch" in events


@pytest.mark.parametrize("seed", ONE_RANK)
def test_one_rank_matches_the_naive_giant_batch(seed: int, tmp_path: Path) -> None:
    outcome = fuzz.run_one_rank(draw(seed), tmp_path)
    assert outcome.ok, explain(outcome)
    assert outcome.steps == draw(seed).max_steps


@pytest.fixture(scope="module")
def two_rank_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Outcome]:
    """All two-rank seeds in one torchrun job (its start-up is most of the cost)."""
    seeds = [*TWO_RANKS, *PLANTED_TWO_RANKS]
    return fuzz.torchrun_results([draw(seed) for seed in seeds], tmp_path_factory.mktemp("fuzz"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", TWO_RANKS)
def test_two_ranks_match_the_naive_giant_batch(seed: int, two_rank_outcomes: dict[int, Outcome]) -> None:
    outcome = two_rank_outcomes[seed]
    assert outcome.ok, explain(outcome)
    assert outcome.steps == draw(seed).max_steps


@pytest.mark.parametrize("seed", PLANTED_ONE_RANK)
def test_the_fuzzer_catches_a_balancing_loss_per_micro_batch_on_one_rank(seed: int, tmp_path: Path) -> None:
    outcome = fuzz.run_one_rank(draw(seed), tmp_path)
    assert outcome.ok and outcome.caught, explain(outcome)
    assert any("the parameters:" in caught for caught in outcome.caught), outcome.caught


@pytest.mark.slow
@pytest.mark.parametrize("seed", PLANTED_TWO_RANKS)
def test_the_fuzzer_catches_a_balancing_loss_per_micro_batch_on_two_ranks(
    seed: int, two_rank_outcomes: dict[int, Outcome]
) -> None:
    outcome = two_rank_outcomes[seed]
    assert outcome.ok and outcome.caught, explain(outcome)
    assert any("the parameters:" in caught for caught in outcome.caught), outcome.caught


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
    setting = replace(draw(PLANTED_SEED), pack=False)  # one document per row: a K of 4 is read whole
    assert setting.mode == "documents" and setting.k == 4 and setting.clip == "tight"
    outcome = fuzz.run_one_rank(setting, tmp_path, sabotage=sabotage)
    assert not outcome.ok
    assert any(caught in problem for problem in outcome.problems), outcome.problems


@pytest.mark.parametrize(
    ("seed", "sabotage", "first_wrong_call"),
    [
        (SHUFFLED_PACKED_SEED, "shuffle_off", 0),  # bigbatch reads in the order of the data
        (SHUFFLED_PACKED_SEED, "shuffle_no_shift", 1),  # epoch 1 not moved: epoch 0 (call 0) is still right
        # every epoch in epoch 0's order: epoch 1 (rows 5-9) happens to begin with epoch 0's first window, so
        # call 1 (rows 3-5) is still right
        (SHUFFLED_PACKED_SEED, "shuffle_first_order", 2),
        (PLANTED_SEED, "shuffle_first_order", 2),  # documents: the second epoch in the first one's order
    ],
)
def test_the_fuzzer_catches_a_wrong_window_order(
    seed: int, sabotage: str, first_wrong_call: int, tmp_path: Path
) -> None:
    """The reference's shuffled order is bigbatch's to the sample: a loader that drops the shift or reuses the
    first epoch's order differs exactly from the first step that reads a later epoch, not before."""
    setting = replace(draw(seed), pack=False)
    assert setting.shuffle and setting.world == 1
    outcome = fuzz.run_one_rank(setting, tmp_path, sabotage=sabotage)
    assert not outcome.ok
    differ = f"call {first_wrong_call}: bigbatch's samples differ from the reference's assembly of the step"
    assert outcome.problems[0] == differ, outcome.problems


def test_the_fuzzer_catches_packed_documents_that_see_each_other(tmp_path: Path) -> None:
    """Packed rows trained without their positions (one causal sequence per row, learned or rotary positions
    running on across documents) take the same samples but another gradient than each document on its own."""
    setting = draw(PLANTED_SEED)
    assert setting.mode == "documents" and setting.pack
    outcome = fuzz.run_one_rank(setting, tmp_path, sabotage="pack_without_positions")
    assert not outcome.ok
    assert not any("samples differ" in problem for problem in outcome.problems), outcome.problems
    assert any("the parameters:" in problem or "logged loss" in problem for problem in outcome.problems)
