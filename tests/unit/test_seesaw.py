"""Seesaw (bigbatch.sizing.seesaw): the batch doubles where the cosine halves the learning rate, for the same
tokens in fewer steps; and the batch ramp that follows a critical batch measured over another run
(``--batch-ramp from:RUN``, bigbatch.sizing.ramp with bigbatch.critical_batch.over_run), with the two-line
trade-off a run's measurements give (bigbatch.sizing.tradeoff)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bigbatch.critical_batch.over_run import checkpoints_every, write_over_run
from bigbatch.engine.optim import CosineSchedule
from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.sizing.critical_curve import CriticalBatchOverRun, CriticalPoint, read_over_run
from bigbatch.sizing.plan import plan_batch
from bigbatch.sizing.ramp import BatchRamp, critical_batch_curve, parse_ramp
from bigbatch.sizing.seesaw import SeesawSchedule
from bigbatch.sizing.tradeoff import tradeoff_lines

COSINE = CosineSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=0, decay_steps=1000)
BASE_K, MAX_STEPS, UNIT = 4, 1000, 64


def seesaw(max_k: int = 32, schedule: CosineSchedule = COSINE) -> SeesawSchedule:
    return SeesawSchedule(schedule, base_k=BASE_K, max_k=max_k, max_steps=MAX_STEPS)


def first_step_at_most(schedule: CosineSchedule, target: float) -> int:
    """Brute force: the first starting-size step after the warmup at which the schedule is at most ``target``."""
    return next(s for s in range(schedule.warmup_steps, MAX_STEPS) if schedule(s) <= target)


def doubling_steps(plan: SeesawSchedule) -> list[int]:
    """The 0-based steps at which K grows."""
    return [s for s in range(1, plan.total_steps) if plan.size_k(s) > plan.size_k(s - 1)]


# -- Seesaw ----------------------------------------------------------------------------------------------------


def test_three_doublings_in_fewer_steps_for_the_same_tokens() -> None:
    plan = seesaw()
    assert [p.k for p in plan.phases] == [4, 8, 16, 32]
    assert [p.multiple for p in plan.phases] == [1, 2, 4, 8]
    # The last step is shortened so the run trains exactly the cosine run's tokens.
    assert sum(plan.k(s) for s in range(plan.total_steps)) == MAX_STEPS * BASE_K
    assert plan.total_steps <= 0.7 * MAX_STEPS
    assert all(plan.k(s) >= 1 for s in range(plan.total_steps))


@pytest.mark.parametrize("warmup", [0, 50])
def test_halvings_are_where_the_schedule_first_falls_to_each_power_of_two(warmup: int) -> None:
    """The binary search finds what a scan of every step finds (0.1 floors the cosine: 1/16 is never reached)."""
    schedule = CosineSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=warmup, decay_steps=1000)
    plan = seesaw(schedule=schedule)
    assert plan.halvings == [first_step_at_most(schedule, 2.0**-j) for j in (1, 2, 3)]


def test_each_doubling_starts_at_the_first_step_past_its_halving() -> None:
    """A doubling starts at the first step whose tokens seen (in starting-size steps) reach the cosine's halving.

    Steps are whole, so where the tokens between two halvings are not a whole number of the previous size's steps,
    the doubling lands up to ``multiple - 1`` starting-size steps after the halving (here 734 for 733); the step
    before it always starts before the halving."""
    plan = seesaw()
    doublings = doubling_steps(plan)
    assert doublings == [p.first_step for p in plan.phases[1:]]
    for j, step in enumerate(doublings, start=1):
        halving = first_step_at_most(COSINE, 2.0**-j)
        previous_multiple = plan.phases[j - 1].multiple
        assert halving <= plan.equivalent_step(step) < halving + previous_multiple
        assert plan.equivalent_step(step - 1) < halving
        assert plan.size_k(step) == BASE_K * 2**j
    # Where the gap divides evenly the doubling is exactly at the halving.
    assert plan.equivalent_step(doublings[0]) == first_step_at_most(COSINE, 0.5)
    assert plan.equivalent_step(doublings[2]) == first_step_at_most(COSINE, 0.125)


def test_the_lr_trained_with_at_each_doubling_moves_by_one_over_sqrt_two() -> None:
    """schedule(e) has halved j times by the j-th doubling and sqrt(2**j) scales it back by half as much: the lr
    the run trains with there is max_lr x 2**(-j/2) (the cosine is continuous: a step off is a small error)."""
    plan = seesaw()
    starts = [0, *doubling_steps(plan)]
    for j, step in enumerate(starts):
        trained = plan(step) * math.sqrt(plan.size_k(step) / BASE_K)
        assert trained == pytest.approx(COSINE.max_lr * 2 ** (-j / 2), rel=1e-2)


def test_the_schedule_reads_the_cosine_at_the_tokens_seen() -> None:
    plan = seesaw()
    for step in (0, 100, plan.phases[1].first_step + 3, plan.total_steps - 1):
        assert plan(step) == COSINE(min(plan.equivalent_step(step), MAX_STEPS - 1))
    assert plan.equivalent_step(plan.total_steps - 1) < MAX_STEPS


def test_the_last_step_is_a_partial_step_of_its_size() -> None:
    plan = seesaw()
    last = plan.total_steps - 1
    assert plan.size_k(last) == 32
    assert plan.k(last) == (MAX_STEPS - plan.equivalent_step(last)) * BASE_K
    assert 0 < plan.k(last) <= 32


def test_a_cap_stops_the_doublings_with_a_note() -> None:
    plan = seesaw(max_k=8)
    assert [p.k for p in plan.phases] == [4, 8]
    assert max(plan.size_k(s) for s in range(plan.total_steps)) == 8
    assert sum(plan.k(s) for s in range(plan.total_steps)) == MAX_STEPS * BASE_K
    note = plan.stop_note(UNIT)
    assert note is not None
    assert "stops doubling" in note and "--max-batch-tokens" in note
    assert f"{8 * UNIT:,} tokens/step" in note and "2 later halvings" in note
    assert "\n" not in note


def test_the_default_cap_cuts_no_doubling() -> None:
    """auto: --max-batch-tokens is 8 x total_batch_tokens, K 32 for K 4, room for all three halvings."""
    plan = seesaw(max_k=8 * BASE_K)
    assert plan.stop_note(UNIT) is None
    text = plan.describe(UNIT)
    assert "K 4" in text and "K 32" in text and f"{plan.total_steps:,} optimizer steps" in text


def test_a_cap_below_the_starting_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--max-batch-tokens"):
        seesaw(max_k=BASE_K - 1)


def test_k_is_a_pure_function_of_the_step() -> None:
    """A resumed run builds its own schedule: it must take the same sizes and learning rates at every step."""
    first, second = seesaw(), seesaw()
    assert first.total_steps == second.total_steps
    for step in range(first.total_steps):
        assert first.k(step) == second.k(step)
        assert first.size_k(step) == second.size_k(step)
        assert first(step) == second(step)


def test_set_schedule_lays_the_phases_out_again() -> None:
    plan = seesaw()
    extended = CosineSchedule(max_lr=1.0, min_lr=0.01, warmup_steps=0, decay_steps=800)
    plan.set_schedule(extended)
    fresh = seesaw(schedule=extended)
    assert plan.phases == fresh.phases != seesaw().phases
    assert plan.halvings == fresh.halvings
    assert plan.total_steps == fresh.total_steps
    assert sum(plan.k(s) for s in range(plan.total_steps)) == MAX_STEPS * BASE_K


# -- --batch-ramp from:RUN -------------------------------------------------------------------------------------

PLAN = plan_batch(1024, micro_batch=2, seq_len=32)  # a micro-batch is 64 tokens; K 16 at most


def point(step: int, tokens_seen: int, low: int) -> CriticalPoint:
    return CriticalPoint(
        step=step,
        tokens_seen=tokens_seen,
        critical_tokens_per_step=low,
        bound="between",
        low=low,
        high=2 * low,
        noise_scale=None,
    )


def write_curve(run_dir: Path, points: list[tuple[int, int]], rule: str = "sqrt-beta2") -> Path:
    """An over-run file as ``bigbatch critical-batch RUN --every N`` writes it (without the plot)."""
    (run_dir / "critical-batch").mkdir(parents=True, exist_ok=True)
    result = CriticalBatchOverRun(
        run=str(run_dir),
        batch_change_rule=rule,
        tokens_per_step_tried=[128, 256, 512, 1024],
        budget=65_536,
        tolerance=0.01,
        points=[point(100 * (i + 1), seen, low) for i, (seen, low) in enumerate(points)],
    )
    return write_over_run(result, run_dir, plot=False)


def test_parse_from_run() -> None:
    spec = parse_ramp("from:runs/x")
    assert spec is not None and spec.source == "runs/x" and not spec.auto
    assert str(spec) == "from:runs/x"


@pytest.mark.parametrize("text", ["from:", "from:   "])
def test_parse_from_without_a_run_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="from:RUN needs the run directory"):
        parse_ramp(text)


def test_over_run_file_round_trips(tmp_path: Path) -> None:
    path = write_curve(tmp_path, [(1000, 128), (5000, 512)])
    assert path == tmp_path / "critical-batch" / "over-run-sqrt-beta2.json"
    read = read_over_run(tmp_path)
    assert [(p.tokens_seen, p.low) for p in read.points] == [(1000, 128), (5000, 512)]
    assert read_over_run(path) == read  # the file itself reads the same


def test_the_ramp_follows_the_curve_never_shrinking_and_capped(tmp_path: Path) -> None:
    # 512 then a smaller 256 (never shrink: stays 512), then 4,096, above the plan's 1,024 (capped at K 16).
    write_curve(tmp_path, [(1000, 128), (5000, 512), (9000, 256), (20_000, 4096)])
    ramp = BatchRamp(parse_ramp(f"from:{tmp_path}"), PLAN)
    assert (ramp.unit, ramp.k_max) == (64, 16)
    assert ramp.curve == [(1000, 128), (5000, 512), (9000, 512), (20_000, 4096)]
    expected = {
        0: 2,  # before the first point: the first point's size (128 / 64)
        999: 2,
        1000: 2,
        4999: 2,
        5000: 8,
        8999: 8,
        9000: 8,  # the measured 256 would be K 4: it does not shrink
        19_999: 8,
        20_000: PLAN.accumulation_steps,  # 4,096 tokens would be K 64
        10**9: PLAN.accumulation_steps,
    }
    assert {seen: ramp.k(seen) for seen in expected} == expected
    assert ramp.start_k == 2
    ks = [ramp.k(seen) for seen in range(0, 25_000, 250)]
    assert ks == sorted(ks)


def test_the_curve_is_sorted_and_sizes_round_down_to_whole_micro_batches(tmp_path: Path) -> None:
    write_curve(tmp_path, [(5000, 200), (1000, 10)])  # written out of order; 10 is below one micro-batch
    ramp = BatchRamp(parse_ramp(f"from:{tmp_path}"), PLAN)
    assert critical_batch_curve(str(tmp_path)) == [(1000, 10), (5000, 200)]
    assert ramp.k(0) == 1  # at least one micro-batch
    assert ramp.k(5000) == 3  # 200 // 64


def test_a_resume_keeps_the_curve_it_started_with(tmp_path: Path) -> None:
    write_curve(tmp_path, [(1000, 128), (5000, 512)])
    spec = parse_ramp(f"from:{tmp_path}")
    state = json.loads(json.dumps(BatchRamp(spec, PLAN).state_dict()))  # as a checkpoint stores it
    write_curve(tmp_path, [(1000, 1024)])  # the measurement is redone afterwards
    resumed = BatchRamp(spec, PLAN)
    assert resumed.k(0) == 16  # a new run reads the new file
    resumed.load_state_dict(state)
    assert resumed.curve == [(1000, 128), (5000, 512)]
    assert (resumed.k(0), resumed.k(5000)) == (2, 8)


def test_the_saved_curve_of_another_source_is_not_taken(tmp_path: Path) -> None:
    write_curve(tmp_path / "a", [(1000, 128)])
    write_curve(tmp_path / "b", [(1000, 512)])
    state = BatchRamp(parse_ramp(f"from:{tmp_path / 'a'}"), PLAN).state_dict()
    other = BatchRamp(parse_ramp(f"from:{tmp_path / 'b'}"), PLAN)
    other.load_state_dict(state)
    assert other.curve == [(1000, 512)]


def test_a_run_without_a_measured_curve_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        BatchRamp(parse_ramp(f"from:{tmp_path}"), PLAN)
    message = str(info.value)
    assert "critical-batch" in message and "--every" in message and "\n" not in message


def test_a_missing_source_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such run or file"):
        read_over_run(tmp_path / "nowhere.json")


# -- checkpoints to measure at, and the trade-off ---------------------------------------------------------------


def test_checkpoints_every_keeps_the_multiples(tmp_path: Path) -> None:
    assert checkpoints_every([4, 8, 12, 13], 4, tmp_path) == [4, 8, 12]
    assert checkpoints_every([12, 4, 8], 4, tmp_path) == [4, 8, 12]  # sorted


@pytest.mark.parametrize("steps", [[], [4], [3, 4, 5]])
def test_checkpoints_every_needs_two(tmp_path: Path, steps: list[int]) -> None:
    with pytest.raises(CheckpointError, match="--keep-checkpoints 0") as info:
        checkpoints_every(steps, 4, tmp_path)
    assert "--every 4" in str(info.value)


def test_tradeoff_without_a_measurement_uses_the_noise_scale_model(tmp_path: Path) -> None:
    lines = tradeoff_lines(tmp_path, 5000.0)
    assert len(lines) == 2
    assert lines[0].startswith("fewest steps: about 50,000 tokens/step") and "10x the noise scale" in lines[0]
    assert lines[1].startswith("fewest tokens: about 500 tokens/step") and "noise scale / 10" in lines[1]
    assert "ratio 100x" in lines[1]


def write_result(run_dir: Path, parent_step: int, critical: int, bound: str = "between") -> None:
    """A critical-batch measurement's result.json, with the keys the trade-off reads."""
    folder = run_dir / "critical-batch" / f"step_{parent_step:06d}"
    folder.mkdir(parents=True)
    branches = [
        {"tokens_per_step": 1024, "val_loss": 3.0},
        {"tokens_per_step": 2048, "val_loss": 2.9},  # the lowest loss: fewest tokens
        {"tokens_per_step": 4096, "val_loss": 2.95},
        {"tokens_per_step": 8192, "val_loss": 3.2},
    ]
    result = {
        "parent_step": parent_step,
        "branches": branches,
        "critical_tokens_per_step": critical,
        "tolerance": 0.02,
        "budget": 65_536,
        "bound": bound,
    }
    (folder / "result.json").write_text(json.dumps(result))


def test_tradeoff_from_a_measurement(tmp_path: Path) -> None:
    write_result(tmp_path, 100, critical=8192)
    steps, tokens = tradeoff_lines(tmp_path, 5000.0)
    assert steps.startswith("fewest steps: 8,192 tokens/step")
    assert "at step 100" in steps and "65,536 tokens" in steps and "2.0%" in steps
    assert tokens.startswith("fewest tokens: 2,048 tokens/step") and "(2.9000)" in tokens
    assert "ratio 4x" in tokens


def test_tradeoff_reads_the_latest_branch_point_and_its_bound(tmp_path: Path) -> None:
    write_result(tmp_path, 300, critical=4096, bound="at least")
    write_result(tmp_path, 100, critical=8192)
    steps, tokens = tradeoff_lines(tmp_path, 5000.0)
    assert steps.startswith("fewest steps: at least 4,096 tokens/step") and "at step 300" in steps
    assert "ratio 2x" in tokens


def test_tradeoff_skips_an_unreadable_result(tmp_path: Path) -> None:
    folder = tmp_path / "critical-batch" / "step_000200"
    folder.mkdir(parents=True)
    (folder / "result.json").write_text("{not json")
    lines = tradeoff_lines(tmp_path, 1000.0)
    assert lines[0].startswith("fewest steps: about 10,000 tokens/step")
