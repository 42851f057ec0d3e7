"""The pure parts of ``bigbatch critical-batch``: sizes, budget, the critical batch (the branches' batch-change rule
is tests/unit/test_batch_change.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigbatch.critical_batch.result import BranchResult, CriticalBatchResult, noise_scale_series
from bigbatch.critical_batch.rules import check_budget, critical_batch_size, parse_sizes, plan_sizes
from bigbatch.errors import BigBatchError, ConfigError, PlanError


def test_sizes_parse_with_suffixes_sorted_and_deduplicated() -> None:
    assert parse_sizes("128Ki, 64Ki,64Ki,1Mi") == [65536, 131072, 1048576]
    assert parse_sizes("64K,128K") == [64000, 128000]  # K is 1,000, as everywhere in bigbatch
    with pytest.raises(ConfigError, match="at least two different sizes"):
        parse_sizes("64Ki,65536")
    with pytest.raises(ConfigError, match="--tokens-per-step: 'x' is not a count"):
        parse_sizes("64Ki,x")


def test_the_budget_is_a_whole_number_of_steps_at_every_size() -> None:
    check_budget(1 << 20, [1 << 16, 1 << 17, 1 << 18])
    with pytest.raises(ConfigError, match=r"smaller than one step of the largest size \(262,144 tokens\)"):
        check_budget(1 << 17, [1 << 16, 1 << 18])
    with pytest.raises(ConfigError, match="nearest budgets that do: 196,608 or 393,216$") as caught:
        check_budget(300_000, [65536, 196608])
    assert "each of 65,536, 196,608 must divide it" in str(caught.value)
    with pytest.raises(ConfigError, match="nearest budgets that do: 384$"):
        check_budget(260, [64, 96, 128])  # the multiple below (0) is no budget
    assert issubclass(ConfigError, BigBatchError)


def test_sizes_unreachable_with_whole_micro_batches_suggest_the_nearest() -> None:
    plans = plan_sizes([4096, 8192], micro_batch=4, seq_len=256)
    assert [p.accumulation_steps for p in plans] == [4, 8]
    with pytest.raises(PlanError, match=r"--tokens-per-step 5,000: .*nearest valid totals: 4,096 \(K=4\) or 5,120"):
        plan_sizes([4096, 5000], micro_batch=4, seq_len=256)
    with pytest.raises(PlanError, match=r"for 65,536 write 64Ki"):
        plan_sizes([64_000], micro_batch=16, seq_len=256)


def test_the_critical_batch_is_the_largest_size_before_the_first_one_out_of_tolerance() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert critical_batch_size(sizes, [2.00, 2.01, 2.02, 2.10, 2.30], 0.01) == (4, [True, True, True, False, False])
    assert critical_batch_size(sizes, [2.00, 2.01, 2.02, 2.10, 2.30], 0.20) == (16, [True] * 5)
    # a noisy size that passes after one that failed does not count: the run of passes from the smallest does
    assert critical_batch_size(sizes, [2.0, 2.5, 2.0, 2.0, 2.0], 0.01) == (1, [True, False, True, True, True])
    assert critical_batch_size(sizes, [2.0, 1.9, 1.8, 1.7, 1.6], 0.0)[0] == 16  # lower is always within


def test_the_noise_scale_series_comes_from_the_metrics_log(tmp_path: Path) -> None:
    records = [
        {"kind": "step", "step": 1, "tokens": 100, "noise_scale": 5.0},
        {"kind": "step", "step": 2, "tokens": 100},
        {"kind": "eval", "step": 2, "val_loss": 3.0},
        {"kind": "step", "step": 3, "tokens": 100, "noise_scale": float("nan")},
        {"kind": "step", "step": 4, "tokens": 100, "skipped": True, "noise_scale": 9.0},
        {"kind": "step", "step": 5, "tokens": 100, "noise_scale": 7.0},
        {"kind": "step", "step": 6, "tokens": 100, "noise_scale": -2.0},  # not usable yet: |G|^2 estimate <= 0
        {"kind": "step", "step": 7, "tokens": 100, "noise_scale": 8.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "{not json\n")
    # the series bigbatch report plots: applied steps only (the skipped step 4 trained nothing), usable values
    assert noise_scale_series(tmp_path) == [(1, 100, 5.0), (5, 400, 7.0), (7, 600, 8.0)]
    assert noise_scale_series(tmp_path, up_to_step=4) == [(1, 100, 5.0)]
    assert noise_scale_series(tmp_path, up_to_step=6)[-1] == (5, 400, 7.0)
    assert noise_scale_series(tmp_path / "missing") == []
    (tmp_path / "empty").mkdir()
    assert noise_scale_series(tmp_path / "empty") == []


def result_of(losses: list[float], tolerance: float = 0.01) -> CriticalBatchResult:
    sizes = [4096 << i for i in range(len(losses))]
    critical, within = critical_batch_size(sizes, losses, tolerance)
    branches = [
        BranchResult(size, size // 4096, 65536 // size, 1e-3, loss, ok, f"runs/x/tps_{size}", False, beta2=0.95)
        for size, loss, ok in zip(sizes, losses, within, strict=True)
    ]
    return CriticalBatchResult(
        run="runs/x",
        checkpoint="runs/x/checkpoints/step_0000040.pt",
        parent_step=40,
        parent_tokens_seen=655360,
        parent_tokens_per_step=16384,
        parent_lr=1e-3,
        parent_beta2=0.95,
        parent_val_loss=2.9,
        budget=65536,
        batch_change_rule="sqrt-beta2",
        tolerance=tolerance,
        micro_batch=16,
        seq_len=256,
        eval_batches=8,
        eval_tokens=32768,
        critical_tokens_per_step=critical,
        noise_scale=None,
        noise_scale_step=None,
        branches=branches,
    )


def test_the_answer_says_when_it_lies_beyond_the_sizes_tried() -> None:
    between = result_of([2.0, 2.01, 2.5])
    assert between.bound == "between" and between.to_dict()["bound"] == "between"
    assert "critical batch: 8,192 tokens per step (the largest size" in between.format()
    above = result_of([2.0, 2.01, 2.015])
    assert above.bound == "at least" and "critical batch: at least 16,384 tokens per step" in above.format()
    below = result_of([2.0, 2.5, 2.6])
    assert below.bound == "at most" and "critical batch: 4,096 tokens per step or less" in below.format()
    table = below.format().splitlines()
    assert table[2].split() == ["4,096", "1", "16", "1.00e-03", "0.95", "2.0000", "+0.00%", "yes"]
    assert table[3].split() == ["8,192", "2", "8", "1.00e-03", "0.95", "2.5000", "+25.00%", "no"]
    assert "holds no estimate" in table[-1]
    assert json.loads(json.dumps(below.to_dict()))["branches"][1]["within_tolerance"] is False


def test_a_branch_of_a_ramped_run_trains_at_its_own_fixed_size(tmp_path: Path) -> None:
    """The parent's batch ramp would resize the branch's steps: a branch drops it (and never allows a change); it
    holds the parent's settings at the branch point, which its batch-change rule moves to its size."""
    from bigbatch.critical_batch.measure import _Parent, branch_config
    from bigbatch.engine.batch_change import BatchChangeRule, OptimSettings
    from bigbatch.run.configuration.train_config import TrainConfig
    from bigbatch.sizing.plan import BatchPlan

    parent_config = TrainConfig()
    parent_config.batch.batch_ramp = "4096:500000"
    parent = _Parent(
        checkpoint=tmp_path / "ckpt.pt",
        document={"config": parent_config.to_dict()},
        step=40,
        tokens_seen=1,
        tokens_per_step=16384,
        settings=OptimSettings(1e-3, 0.9, 0.97, 0.05),
        micro_batch=16,
        seq_len=256,
        sha256="0" * 64,
    )
    plan = BatchPlan(micro_batch=16, seq_len=256, accumulation_steps=2)
    rule = BatchChangeRule("linear", "both", "timescale")
    config = branch_config(parent, tmp_path / "tps_8192", plan, rule, steps=4, eval_batches=2, device="cpu")
    assert config.batch.batch_ramp == ""
    opt = config.optim
    assert (opt.lr, opt.beta1, opt.beta2, opt.weight_decay, opt.min_lr_ratio) == (1e-3, 0.9, 0.97, 0.05, 1.0)
    assert (opt.batch_change_rule, opt.batch_change_betas, opt.batch_change_weight_decay) == (
        "linear",
        "both",
        "timescale",
    )
    assert config.batch.total_batch_tokens == 8192
    assert config.run.allow_ramp_change is False
    assert config.run.max_steps == 44
