"""The differential fuzzer (tests/fuzz.py) on its fixed seeds, and proof that it catches planted bugs.

Each seed is a random setting trained through ``bigbatch train``'s code path and replayed by a naive
float64 reference (one forward/backward over every sample of the global step, clip, AdamW, schedule);
see tests/fuzz_reference.py for what is compared and how exactly-zero gradients are handled.
``make fuzz N=200`` runs random seeds.
"""

from __future__ import annotations

from pathlib import Path

import fuzz
import pytest
from fuzz_reference import Outcome, _valid, expected_steps
from fuzz_settings import CLIPS, LAST_WINDOWS, MODES, PARALLELS, draw

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


def test_fixed_seeds_cover_every_drawn_choice() -> None:
    settings = [draw(seed) for seed in fuzz.FIXED_SEEDS]
    for world in (1, 2):
        mine = [s for s in settings if s.world == world]
        assert {s.mode for s in mine} == set(MODES)
        assert {bool(s.k) for s in mine} == {True, False}
        assert {s.last_window for s in mine} == set(LAST_WINDOWS)
        assert {s.clip for s in mine} == set(CLIPS)
    assert {s.parallel for s in settings} == set(PARALLELS)
    assert any(s.sync_every_micro_step for s in settings) and any(s.activation_checkpointing for s in settings)
    events = set().union(*(step_events(seed) for seed in fuzz.FIXED_SEEDS))
    assert events >= {"no valid target", "short last window", "partial budget step", "K varies", "dropped"}


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
    ],
)
def test_the_fuzzer_catches_a_planted_bug(sabotage: str, caught: str, tmp_path: Path) -> None:
    setting = draw(PLANTED_SEED)
    assert setting.mode == "documents" and setting.k == 4 and setting.clip == "tight"
    outcome = fuzz.run_one_rank(setting, tmp_path, sabotage=sabotage)
    assert not outcome.ok
    assert any(caught in problem for problem in outcome.problems), outcome.problems
