"""Every ``--bad-step`` mode in fp32, bf16 and fp16 (autocast on CPU; fp16 with its GradScaler), one process: each
mode's promise, bitwise. A step computed again or skipped as bad must leave fp16's loss scale as the step found it:
GradScaler allows one ``unscale_`` per ``update()``, and the retry without a bad micro-batch once unscaled twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bad_step_runs import NanLossOnce, random_steps, same_state, scale_gradient_of, train
from reliability_runs import assert_same_final_model, cli_args, run_cli
from text_corpus import text_corpus

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.bad_steps import BadStepSettings
from bigbatch.engine.hooks import StepHook
from bigbatch.engine.step_guard import ACTIONS

PRECISIONS = ("fp32", "bf16", "fp16")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(text_corpus(60_000))
    return path


@pytest.mark.parametrize("precision", PRECISIONS)
def test_skip_micro_is_the_run_that_never_read_the_micro_batch_in_every_precision(precision: str) -> None:
    """A NaN loss in micro-batch 1 of step 2, and a step whose first try drops two: parameters, moments, step count
    and loss scale bitwise those of the run whose data left them out."""
    skipped = train(BadStepSettings(), (0, 1, 2), hooks=[NanLossOnce(2, 1)], precision=precision)
    assert same_state(skipped, train(BadStepSettings(), (0, 1, 2), drop={1: {1}}, precision=precision))
    (bad,) = skipped.bad
    assert bad.bad is not None and bad.bad.action == "skipped micro-batch" and not bad.skipped
    twice = train(BadStepSettings(), (0, 1, 2), hooks=[NanLossOnce(2, 0), NanLossOnce(2, 3)], precision=precision)
    assert same_state(twice, train(BadStepSettings(), (0, 1, 2), drop={1: {0, 3}}, precision=precision))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", ["skip-step", "stop", "rewind"])
def test_modes_that_apply_nothing_leave_the_state_as_the_run_without_the_step(precision: str, mode: str) -> None:
    """skip-step, stop and rewind apply no update (the loop then stops or goes back to a checkpoint): parameters,
    moments, step count, loss scale and generators as if the data had gone from step 1 to step 3."""
    run = train(BadStepSettings(mode=mode), (0, 1, 2, 3), hooks=[NanLossOnce(2, 1)], precision=precision)
    without = train(None, (0, 2, 3), precision=precision)
    assert same_state(run, without)
    (bad,) = run.bad
    assert bad.skipped and bad.bad is not None and bad.bad.action == ACTIONS[mode]
    assert run.engine.skipped_steps == 1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_spike_and_a_replay_mismatch_compute_the_step_again_in_every_precision(precision: str) -> None:
    """The other paths that compute a step again: a gradient spike (micro-batch 2 of step 8, the detector judging
    from 4 steps on) and a replay that differs (a gradient corrupted in the first pass of step 5 only): no error,
    and the step applied is the one without the micro-batch named."""
    guard = BadStepSettings(spike_min_steps=4)
    steps = tuple(range(9))
    spike = train(guard, steps, precision=precision, model_hook=scale_gradient_of(random_steps(7)[2].inputs, 1e4))
    (bad,) = spike.bad
    assert bad.bad is not None and [(s.micro, s.cause) for s in bad.bad.suspects] == [(2, "gradient-norm spike")]
    assert same_state(spike, train(guard, steps, precision=precision, drop={7: {2}}))
    replayed = train(BadStepSettings(replay_every=1), range(6), hooks=[FirstPassOnly(5)], precision=precision)
    (bad,) = replayed.bad
    assert bad.bad is not None and bad.bad.cause == "replay mismatch" and not bad.skipped
    micro = bad.bad.suspects[0].micro
    assert same_state(
        replayed, train(BadStepSettings(replay_every=1), range(6), precision=precision, drop={4: {micro}})
    )


class FirstPassOnly(StepHook):
    """A device computing a wrong value once: in the first accumulation of optimizer step ``step``, every
    micro-batch's gradient of one weight is 1.5 times what it is, and a re-run computes it right."""

    def __init__(self, step: int) -> None:
        self.step, self.k, self.done = step, 0, False
        self.handle: Any = None

    def before_step(self, engine: AccumulationEngine, step: int, k: int) -> None:
        self.k = k

    def before_forward(self, engine: AccumulationEngine, index: int, micro_batch: Any) -> None:
        if engine.step_count + 1 == self.step and not self.done and self.handle is None:
            weight = engine.model.transformer.h[1].mlp.c_proj.weight
            self.handle = weight.register_hook(lambda grad: grad * 1.5)

    def after_backward(self, engine: AccumulationEngine, index: int, micro_batch: Any) -> None:
        if self.handle is not None and index == self.k - 1:  # before the replay re-runs the drawn micro-batch
            self.handle.remove()
            self.handle, self.done = None, True


@pytest.mark.parametrize(
    "precision", ["fp16", pytest.param("bf16", marks=pytest.mark.slow), pytest.param("fp32", marks=pytest.mark.slow)]
)
def test_rewind_ends_where_skip_micro_ends_in_every_precision(corpus: Path, tmp_path: Path, precision: str) -> None:
    """Real runs (``nan-input`` in micro-batch 2 of step 4): skip-micro trains on (fp16 once crashed here), and
    rewind, back to step 2 and replaying without the micro-batch, ends bitwise where skip-micro ends."""
    fault = "nan-input:step=4,micro=2"
    for mode in ("skip-micro", "rewind"):
        args = cli_args(corpus, tmp_path / mode, "--bad-step", mode, "--save-every", "2", "--precision", precision)
        done = run_cli(args, fault=fault)
        assert done.returncode == 0, done.stderr[-2000:]
        records = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2, 3, 4, 5, 6]
    assert_same_final_model(tmp_path / "rewind", tmp_path / "skip-micro")
