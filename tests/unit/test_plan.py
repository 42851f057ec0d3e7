from __future__ import annotations

import pytest

from bigbatch.errors import PlanError
from bigbatch.sizing.plan import plan_batch, suggest_micro_batches


@pytest.mark.parametrize(
    ("total", "b", "t", "world", "k"),
    [
        (524_288, 16, 1024, 1, 32),
        (524_288, 16, 1024, 8, 4),
        (524_288, 64, 1024, 1, 8),
        (16_384, 16, 256, 1, 4),
        (2048, 16, 128, 1, 1),
    ],
)
def test_k_for_valid_settings(total: int, b: int, t: int, world: int, k: int) -> None:
    plan = plan_batch(total, b, t, world)
    assert plan.accumulation_steps == k
    assert plan.tokens_per_step == total
    assert plan.sequences_per_step == b * k * world


def test_non_divisible_total_suggests_nearest_totals_and_micro_batches() -> None:
    with pytest.raises(PlanError) as info:
        plan_batch(65_536, 12, 128, 1)
    message = str(info.value)
    assert "\n" not in message
    assert "12 x 128 x 1 = 1,536" in message
    assert "64,512 (K=42)" in message and "66,048 (K=43)" in message
    assert "micro_batch in {2, 4, 8, 16}" in message


def test_total_below_one_window_suggests_the_smallest_valid_total() -> None:
    with pytest.raises(PlanError, match=r"nearest valid totals: 2,048 \(K=1\)"):
        plan_batch(1000, 16, 128, 1)


def test_suggested_micro_batches_divide_the_total() -> None:
    for b in suggest_micro_batches(524_288, 1024, 8, near=12):
        assert 524_288 % (b * 1024 * 8) == 0
    assert suggest_micro_batches(1000, 128, 1, near=4) == []


@pytest.mark.parametrize("bad", [0, -4])
def test_non_positive_values_are_refused(bad: int) -> None:
    with pytest.raises(PlanError, match="micro_batch must be a positive integer"):
        plan_batch(1024, bad, 128, 1)


@pytest.mark.usefixtures("isolated")
def test_plan_without_a_model_plans_the_demo_at_byte_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    """No --model is the run `bigbatch train` makes with no flags: nano on the built-in corpus's byte tokens
    (vocabulary 256), said in a line; a named preset, nano included, keeps its own vocabulary (GPT-2's), as
    memory and verify read --vocab-size auto, and --vocab-size sets it."""
    import re

    from bigbatch.cli.app import main

    def plan(*argv: str) -> tuple[bool, str]:
        """Whether the plan says it is the demo's, and the model's size."""
        assert main(["plan", "--tokens-per-step", "16384", *argv]) == 0
        out = capsys.readouterr().out
        size = re.search(r"^model nano\s+(\S+) parameters$", out, re.MULTILINE)
        assert size is not None, out
        return "model nano at vocabulary 256: the demo" in out, size[1]

    said, demo = plan()
    assert said and demo.startswith("0.")  # under a million parameters, as the demo's header says
    assert plan("--model", "nano", "--vocab-size", "256") == (False, demo)
    assert plan("--model", "nano")[1].startswith("7.")  # the preset's 50,257-token head
