"""The batch-change rule (bigbatch.engine.batch_change): how the learning rate, AdamW's betas and the weight decay
follow a change of the tokens per step, the records a change leaves, the follower's state across a resume, and the
engine setting every param group from it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch_change import BatchChange, BatchChangeRule, BatchFollower, OptimSettings
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.errors import ConfigError

BASE = OptimSettings(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1)
REF = 2048  # reference tokens per step: the size the base settings were chosen for
RATIOS = (0.25, 0.5, 2.0, 4.0, 8.0)


def half_life_steps(beta: float) -> float:
    """Steps an EMA with factor ``beta`` takes to forget half of what it holds."""
    return math.log(0.5) / math.log(beta)


# -- the rule's arithmetic -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", RATIOS)
def test_sqrt_scales_lr_by_sqrt_and_beta2_by_power(ratio: float) -> None:
    after = BatchChangeRule("sqrt", "beta2").follow(BASE, ratio)
    assert after.lr == pytest.approx(BASE.lr * math.sqrt(ratio), rel=1e-12)
    assert after.beta2 == pytest.approx(BASE.beta2**ratio, rel=1e-12)
    assert after.beta1 == BASE.beta1  # beta1 only moves with betas="both"
    assert after.weight_decay == BASE.weight_decay  # "keep" is the default


@pytest.mark.parametrize("ratio", RATIOS)
def test_both_betas_keep_their_half_life(ratio: float) -> None:
    after = BatchChangeRule("sqrt", "both").follow(BASE, ratio)
    assert after.beta1 == pytest.approx(BASE.beta1**ratio, rel=1e-12)
    assert after.beta2 == pytest.approx(BASE.beta2**ratio, rel=1e-12)


@pytest.mark.parametrize("ratio", RATIOS)
def test_linear_scales_lr_by_ratio_and_none_keeps_it(ratio: float) -> None:
    assert BatchChangeRule("linear").follow(BASE, ratio).lr == pytest.approx(BASE.lr * ratio, rel=1e-12)
    kept = BatchChangeRule("none", "none").follow(BASE, ratio)
    assert kept == BASE  # rule none with betas none changes nothing at all


@pytest.mark.parametrize("rule", ["none", "sqrt", "linear"])
@pytest.mark.parametrize("betas", ["none", "beta2", "both"])
@pytest.mark.parametrize("weight_decay", ["keep", "timescale"])
def test_ratio_one_returns_the_base_exactly(rule: str, betas: str, weight_decay: str) -> None:
    """At the reference size every rule is the identity, bit for bit: a run that never changes size trains with
    exactly the configured values."""
    assert BatchChangeRule(rule, betas, weight_decay).follow(BASE, 1.0) == BASE


@pytest.mark.parametrize("ratio", [0.25, 2.0, 4.0])
def test_beta2_half_life_in_tokens_is_invariant(ratio: float) -> None:
    """beta2 ** r over steps of r x B tokens forgets half in as many tokens as beta2 over steps of B."""
    beta2, tokens = 0.95, 1024
    after = BatchChangeRule("sqrt", "beta2").follow(OptimSettings(1e-3, 0.9, beta2, 0.1), ratio)
    assert half_life_steps(after.beta2) * (ratio * tokens) == pytest.approx(half_life_steps(beta2) * tokens, rel=1e-9)


@pytest.mark.parametrize("rule", ["sqrt", "linear"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_timescale_keeps_tokens_over_lr_times_weight_decay(rule: str, ratio: float) -> None:
    """AdamW shrinks the weights by lr x wd per step: B / (lr x wd) tokens is the timescale the rule keeps."""
    after = BatchChangeRule(rule, "beta2", "timescale").follow(BASE, ratio)
    before_scale = REF / (BASE.lr * BASE.weight_decay)
    after_scale = ratio * REF / (after.lr * after.weight_decay)
    assert after_scale == pytest.approx(before_scale, rel=1e-9)


@pytest.mark.parametrize("rule", ["none", "sqrt", "linear"])
def test_keep_leaves_the_weight_decay(rule: str) -> None:
    assert BatchChangeRule(rule, "beta2", "keep").follow(BASE, 4.0).weight_decay == BASE.weight_decay


def test_lr_factor_per_rule() -> None:
    assert BatchChangeRule("sqrt").lr_factor(4.0) == pytest.approx(2.0)
    assert BatchChangeRule("linear").lr_factor(4.0) == pytest.approx(4.0)
    assert BatchChangeRule("none").lr_factor(4.0) == 1.0


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan, math.inf])
def test_follow_refuses_a_ratio_that_is_not_positive_and_finite(ratio: float) -> None:
    with pytest.raises(ValueError, match="positive finite ratio"):
        BatchChangeRule().follow(BASE, ratio)


# -- resolving the settings ------------------------------------------------------------------------------------


def test_resolve_auto_is_sqrt_with_beta2() -> None:
    rule = BatchChangeRule.resolve("auto")
    assert rule == BatchChangeRule("sqrt", "beta2", "keep", "tokens")
    assert rule.changes_anything


def test_resolve_none_with_auto_betas_changes_nothing() -> None:
    rule = BatchChangeRule.resolve("none", "auto")
    assert rule.betas == "none"
    assert not rule.changes_anything
    # A timescale weight decay still changes something, even with the lr rule none.
    assert BatchChangeRule.resolve("none", "auto", "timescale").changes_anything
    assert BatchChangeRule.resolve("none", "beta2").changes_anything


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("cubic",), "--batch-change-rule"),
        (("sqrt", "all"), "--batch-change-betas"),
        (("sqrt", "beta2", "halve"), "--batch-change-weight-decay"),
    ],
)
def test_bad_names_raise_config_error_naming_the_flag(args: tuple[str, ...], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag) as info:
        BatchChangeRule.resolve(*args)
    assert repr(args[-1]) in str(info.value)  # the offending value is shown too


def test_label_and_describe() -> None:
    assert BatchChangeRule("sqrt", "beta2").label() == "sqrt-beta2"
    assert BatchChangeRule("none", "none").label() == "none"
    assert BatchChangeRule("linear", "both", "timescale").label() == "linear-both-timescale"
    assert BatchChangeRule("sqrt", "beta2").describe() == "sqrt: lr x sqrt(B/B0), beta2 ** (B/B0)"
    assert BatchChangeRule("none", "none").describe() == "none: lr kept"
    text = BatchChangeRule("linear", "both", "timescale").describe()
    assert text.startswith("linear: lr x B/B0") and "beta1 and beta2" in text and "B/(lr x wd)" in text


# -- the follower and its records ------------------------------------------------------------------------------


def make_follower(requested: str = "auto", rule: BatchChangeRule | None = None) -> BatchFollower:
    return BatchFollower(rule or BatchChangeRule.resolve(requested), BASE, REF, requested=requested)


def test_settings_at_the_reference_are_the_base_with_the_schedules_lr() -> None:
    follower = make_follower()
    assert follower.settings(5e-4, REF) == OptimSettings(5e-4, BASE.beta1, BASE.beta2, BASE.weight_decay)
    at_four = follower.settings(5e-4, 4 * REF)
    assert at_four.lr == pytest.approx(1e-3) and at_four.beta2 == pytest.approx(0.95**4)


def test_change_is_none_at_the_same_size() -> None:
    follower = make_follower()
    assert follower.change(1, 0, 1e-3, REF, "ramp") is None  # fresh: compared with the reference
    follower.last_tokens = 4 * REF
    assert follower.change(5, 1000, 1e-3, 4 * REF, "ramp") is None


def test_change_to_a_new_size_carries_the_settings_at_each_size() -> None:
    follower = make_follower()
    follower.last_tokens = 2 * REF
    change = follower.change(7, 123_456, 8e-4, 4 * REF, "seesaw")
    assert isinstance(change, BatchChange)
    assert (change.step, change.tokens_seen, change.cause) == (7, 123_456, "seesaw")
    assert (change.tokens_before, change.tokens_after) == (2 * REF, 4 * REF)
    assert change.before == follower.settings(8e-4, 2 * REF)
    assert change.after == follower.settings(8e-4, 4 * REF)


def test_a_fresh_follower_compares_with_the_reference() -> None:
    follower = make_follower()
    assert follower.last_tokens is None
    change = follower.change(1, 0, 1e-3, REF // 2, "ramp")
    assert change is not None
    assert change.tokens_before == REF
    assert change.before == follower.settings(1e-3, REF)


def test_line_names_the_step_sizes_and_learning_rates() -> None:
    change = make_follower().change(3, 4096, 1e-3, 2560, "batch ramp")
    assert change is not None
    line = change.line()
    assert line.startswith("batch change at step 3 (batch ramp, 4,096 tokens seen)")
    assert "2,048 -> 2,560 tokens/step" in line
    assert f"lr {1e-3:.3e} -> {1e-3 * math.sqrt(2560 / 2048):.3e}" in line
    assert "beta1 0.9 |" in line  # unchanged: one value
    assert f"beta2 {0.95:.5g} -> {0.95 ** (2560 / 2048):.5g}" in line
    assert line.endswith("weight decay 0.1")
    assert "\n" not in line


def test_record_has_every_key_and_round_trips_through_json() -> None:
    change = make_follower().change(3, 4096, 1e-3, 4 * REF, "resume")
    assert change is not None
    record = change.record()
    expected = {"step", "tokens_seen", "cause", "tokens_per_step_before", "tokens_per_step_after"} | {
        f"{name}_{when}" for name in ("lr", "beta1", "beta2", "weight_decay") for when in ("before", "after")
    }
    assert set(record) == expected
    assert record["lr_after"] == pytest.approx(2e-3) and record["beta2_after"] == pytest.approx(0.95**4)
    assert (record["tokens_per_step_before"], record["tokens_per_step_after"]) == (REF, 4 * REF)
    assert json.loads(json.dumps(record)) == record


# -- state across a resume -------------------------------------------------------------------------------------


def test_state_dict_round_trip_keeps_reference_and_last_size() -> None:
    saved = make_follower()
    saved.reference_tokens, saved.last_tokens = 4096, 16384
    state = json.loads(json.dumps(saved.state_dict()))  # as a checkpoint stores it
    resumed = BatchFollower(BatchChangeRule(), BASE, reference_tokens=8192, requested="auto")  # a new size
    resumed.load_state_dict(state)
    assert (resumed.reference_tokens, resumed.last_tokens) == (4096, 16384)
    assert resumed.rule == BatchChangeRule("sqrt", "beta2")


def test_state_before_any_step_keeps_last_tokens_none() -> None:
    resumed = make_follower()
    resumed.load_state_dict(make_follower().state_dict())
    assert resumed.last_tokens is None


def test_an_old_checkpoint_turns_auto_off_but_keeps_a_named_rule() -> None:
    """A checkpoint from before the rule trained every size alike: ``auto`` goes on doing so, ``sqrt`` asked by
    name is applied."""
    auto = make_follower("auto")
    auto.load_state_dict(None)
    assert auto.rule == BatchChangeRule("none", "none", "keep", "keep")
    assert not auto.rule.changes_anything
    assert auto.settings(1e-3, 4 * REF) == OptimSettings(1e-3, BASE.beta1, BASE.beta2, BASE.weight_decay)

    named = make_follower("sqrt")
    named.load_state_dict(None)
    assert named.rule == BatchChangeRule("sqrt", "beta2", "keep", "tokens")
    assert named.reference_tokens == REF


# -- the engine ------------------------------------------------------------------------------------------------


def square_loss_sum(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """A sum over the outputs, as the engine's loss_fn contract wants (not a mean)."""
    return model(batch).pow(2).sum()


def count_outputs(batch: torch.Tensor) -> int:
    return batch.numel()


def make_engine(follower: BatchFollower | None, lr: float = 1e-3) -> AccumulationEngine:
    model = nn.Linear(4, 4)  # a weight (decayed group) and a bias (no-decay group)
    optimizer = build_adamw(model, lr, weight_decay=0.1, betas=(0.9, 0.95), fused=False)
    return AccumulationEngine(
        model,
        optimizer,
        constant_schedule(lr),
        loss_fn=square_loss_sum,
        count_fn=count_outputs,
        follower=follower,
    )


def one_step(engine: AccumulationEngine, tokens_per_step: int | None) -> float:
    batches = [torch.randn(2, 4), torch.randn(2, 4)]
    return engine.step(batches, n_valid=16, tokens_per_step=tokens_per_step).lr


def test_engine_sets_every_group_from_the_follower() -> None:
    engine = make_engine(make_follower())
    record_lr = one_step(engine, 4 * REF)
    decay, no_decay = engine.optimizer.param_groups
    assert record_lr == pytest.approx(2e-3)  # the StepRecord holds the scaled lr
    for group in (decay, no_decay):
        assert group["lr"] == pytest.approx(2e-3)
        assert group["betas"][0] == 0.9
        assert group["betas"][1] == pytest.approx(0.95**4)
    assert decay["weight_decay"] == pytest.approx(0.1)  # keep
    assert no_decay["weight_decay"] == 0.0


def test_engine_timescale_scales_each_groups_own_weight_decay() -> None:
    rule = BatchChangeRule("sqrt", "beta2", "timescale")
    engine = make_engine(make_follower("sqrt", rule))
    one_step(engine, 4 * REF)
    decay, no_decay = engine.optimizer.param_groups
    assert decay["weight_decay"] == pytest.approx(0.1 * 4 / 2)  # wd x r / sqrt(r)
    assert no_decay["weight_decay"] == 0.0  # never decayed, whatever the size


def test_engine_without_tokens_per_step_trains_at_the_reference() -> None:
    engine = make_engine(make_follower())
    assert one_step(engine, None) == pytest.approx(1e-3)
    assert engine.follower is not None and engine.follower.last_tokens is None
    for group in engine.optimizer.param_groups:
        assert group["lr"] == pytest.approx(1e-3) and group["betas"] == (0.9, 0.95)


def test_engine_without_a_follower_sets_only_the_lr() -> None:
    engine = make_engine(None, lr=3e-4)
    assert one_step(engine, 4 * REF) == pytest.approx(3e-4)
    decay, no_decay = engine.optimizer.param_groups
    assert decay["lr"] == no_decay["lr"] == pytest.approx(3e-4)
    assert decay["betas"] == no_decay["betas"] == (0.9, 0.95)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_engine_keeps_the_size_until_told_another() -> None:
    """The settings follow the last step's size: a later step without a size keeps it (as the next step's lr
    after an update is set at that size too)."""
    engine = make_engine(make_follower())
    one_step(engine, 4 * REF)
    assert one_step(engine, None) == pytest.approx(2e-3)
    assert one_step(engine, REF) == pytest.approx(1e-3)
    assert engine.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
