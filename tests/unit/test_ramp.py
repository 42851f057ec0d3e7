"""Batch-size ramp-up (bigbatch.sizing.ramp): parsing, validation, the K schedule, its table, auto growth, resume checks."""

from __future__ import annotations

import math

import pytest
from helpers import assert_one_line_error, run_main

from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.run.configuration.config_sources import apply_mapping
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.sizing.plan import BatchPlan
from bigbatch.sizing.ramp import BatchRamp, RampSpec, check_ramp_change, format_ramp_table, parse_ramp

PLAN = BatchPlan(micro_batch=2, seq_len=32, accumulation_steps=8)  # 64 tokens per micro-batch, 512 per step


def test_parse_accepts_counts_with_suffixes_and_auto() -> None:
    assert parse_ramp("") is None
    assert parse_ramp("32K:10M") == RampSpec(32_000, 10_000_000)
    assert parse_ramp("32Ki:1_000") == RampSpec(32_768, 1000)
    assert parse_ramp(" auto ") == RampSpec(auto=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32K", "must be START_TOKENS:RAMP_TOKENS"),
        ("1:2:3", "must be START_TOKENS:RAMP_TOKENS"),
        (":10M", "must be START_TOKENS:RAMP_TOKENS"),
        ("x:10M", "START_TOKENS 'x' is not a count"),
        ("32K:0", "RAMP_TOKENS '0' must be positive"),
        ("32K:-5", "RAMP_TOKENS '-5' must be positive"),
    ],
)
def test_bad_syntax_is_one_clear_error(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=r"--batch-ramp \(batch.batch_ramp\)") as info:
        parse_ramp(text)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_config_validation_start_above_target_and_token_budget() -> None:
    config = TrainConfig()
    config.batch.batch_ramp = "32K:1M"  # above the default 16,384 tokens per step
    with pytest.raises(ConfigError, match="START_TOKENS 32,000 is above the tokens per step 16,384"):
        config.validate()
    config.batch.batch_ramp = "4096:1M"
    config.validate()
    config.batch.token_budget = 8000
    with pytest.raises(ConfigError, match="use one of them"):
        config.validate()


def test_toml_entry_is_read_and_checked() -> None:
    config = TrainConfig()
    apply_mapping(config, {"batch": {"batch_ramp": "4Ki:200K"}}, origin="my.toml")
    assert config.batch.batch_ramp == "4Ki:200K"
    config.validate()
    with pytest.raises(ConfigError, match="my.toml: batch.batch_ramp must be str"):
        apply_mapping(config, {"batch": {"batch_ramp": 4096}}, origin="my.toml")
    assert 'batch_ramp = "4Ki:200K"' in config.to_toml()


def test_start_below_one_micro_batch_per_process_is_refused() -> None:
    plan = BatchPlan(micro_batch=2, seq_len=32, accumulation_steps=4, world_size=2)  # 128 tokens per K
    with pytest.raises(ConfigError, match=r"below one micro-batch per process \(micro_batch 2 x seq_len 32 x world 2"):
        BatchRamp(RampSpec(100, 1000), plan)
    assert BatchRamp(RampSpec(128, 1000), plan).k(0) == 1


def test_k_grows_linearly_in_tokens_seen_in_whole_micro_batches() -> None:
    ramp = BatchRamp(RampSpec(128, 2000), PLAN)  # from 128 (K 2) to 512 (K 8) over 2,000 tokens
    assert ramp.k(0) == 2 and ramp.start_k == 2
    for seen in range(0, 2500, 7):
        wanted = 128 + (512 - 128) * min(seen, 2000) / 2000
        assert ramp.k(seen) == min(8, math.floor(wanted / 64 + 1e-9)), seen
    assert ramp.k(1999) == 7 and ramp.k(2000) == 8 and ramp.k(10**12) == 8
    ks = [ramp.k(s) for s in range(3000)]
    assert ks == sorted(ks)  # never shrinks


def test_start_not_a_multiple_rounds_down_and_equal_to_target_is_constant() -> None:
    assert BatchRamp(RampSpec(191, 1000), PLAN).k(0) == 2
    constant = BatchRamp(RampSpec(512, 1000), PLAN)
    assert {constant.k(s) for s in range(0, 3000, 13)} == {8}


@pytest.mark.parametrize(
    ("start", "ramp_tokens", "micro_batch", "k"),
    [(128, 2000, 2, 8), (64, 100_000, 1, 50), (4096, 10**6, 16, 4), (40, 7, 1, 3)],
)
def test_the_table_is_what_the_steps_take(start: int, ramp_tokens: int, micro_batch: int, k: int) -> None:
    """Each row is the first step at its K, with the tokens seen after it, as step-by-step training gives."""
    ramp = BatchRamp(RampSpec(start, ramp_tokens), BatchPlan(micro_batch, 32, k))
    seen, step, firsts = 0, 1, []
    while True:
        current = ramp.k(seen)
        seen += current * ramp.unit
        if not firsts or firsts[-1][1] != current:
            firsts.append((step, current, current * ramp.unit, seen))
        if current == k:
            break
        step += 1
    assert [(r.step, r.k, r.tokens_per_step, r.cumulative_tokens) for r in ramp.table()] == firsts


def test_the_plan_command_prints_the_table() -> None:
    code, out, err = run_main(
        ["plan", "--tokens-per-step", "512", "--seq-len", "32", "--micro-batch", "2", "--batch-ramp", "128:2000"]
    )
    assert code == 0, err
    table = out[out.index("batch ramp:") :].splitlines()
    assert "128 -> 512 tokens/step over the first 2,000 tokens seen (K 2 -> 8" in table[0]
    assert table[1].split() == ["step", "K", "tokens/step", "cumulative", "tokens"]
    rows = [line.split() for line in table[2:-1]]
    assert rows[0] == ["1", "2", "128", "128"] and rows[-1][1:3] == ["8", "512"]
    assert [int(r[1]) for r in rows] == list(range(2, 9))
    assert table[-1].startswith(f"the ramp reaches K 8 at step {rows[-1][0]}")
    code, out, err = run_main(
        ["plan", "--tokens-per-step", "512", "--seq-len", "32", "--micro-batch", "2", "--batch-ramp", "32:2000"]
    )
    assert "START_TOKENS 32 is below one micro-batch" in assert_one_line_error(code, out, err)


def test_a_long_ramp_table_stays_compact() -> None:
    ramp = BatchRamp(RampSpec(32_768, 4 * 10**9), BatchPlan(1, 2048, 195, world_size=8))
    text = format_ramp_table(ramp)
    assert len(text.splitlines()) <= 30 and "every 9th change of K shown" in text
    assert text.splitlines()[-2].split()[1] == "195"


def test_auto_grows_toward_the_noise_scale_never_shrinks_at_most_doubles_capped() -> None:
    ramp = BatchRamp(RampSpec(auto=True), PLAN)  # unit 64, K from 2 up to 8
    assert ramp.k(0) == 2 and ramp.k(10**9) == 2  # auto does not follow the tokens seen
    assert ramp.grow(None) is None and ramp.grow(math.nan) is None and ramp.grow(-5.0) is None
    assert ramp.grow(100.0) is None  # 100 tokens is about K 2: no change
    assert ramp.grow(64 * 3.4) == (2, 3)
    assert ramp.grow(64 * 1.0) is None  # never shrinks
    assert ramp.grow(64 * 100.0) == (3, 6)  # at most doubles
    assert ramp.grow(64 * 100.0) == (6, 8)  # capped by the configured tokens per step
    assert ramp.grow(64 * 100.0) is None
    resumed = BatchRamp(RampSpec(auto=True), PLAN)
    resumed.load_state_dict(ramp.state_dict())
    assert resumed.k(0) == 8
    smaller = BatchRamp(RampSpec(auto=True), BatchPlan(1, 32, 16))  # a micro-batch change keeps the tokens
    smaller.load_state_dict(ramp.state_dict())
    assert smaller.k(0) == 16


def test_auto_with_k_of_one_is_constant() -> None:
    ramp = BatchRamp(RampSpec(auto=True), BatchPlan(2, 32, 1))
    assert ramp.k(0) == 1 and ramp.grow(1e9) is None


def test_a_changed_ramp_is_refused_unless_allowed() -> None:
    saved = {"batch": {"batch_ramp": "32K:1M"}}
    assert check_ramp_change(saved, "32000:1_000_000", False, "runs/x") is None  # the same ramp, spelled otherwise
    with pytest.raises(CheckpointError, match=r"batch.batch_ramp '32,000:1,000,000' -> 'auto'.*--allow-ramp-change"):
        check_ramp_change(saved, "auto", False, "runs/x")
    with pytest.raises(CheckpointError, match=r"batch.batch_ramp '32,000:1,000,000' -> none"):
        check_ramp_change(saved, "", False, "runs/x")
    with pytest.raises(CheckpointError, match=r"batch.batch_ramp none -> '4,096:1,000'"):
        check_ramp_change({"batch": {}}, "4096:1000", False, "runs/x")  # an older checkpoint: no ramp
    note = check_ramp_change(saved, "16K:1M", True, "runs/x")
    assert note is not None and "'32,000:1,000,000' -> '16,000:1,000,000' from the next step" in note
