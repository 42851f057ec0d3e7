"""Step hooks: where they are called in the engine's loop, what their measurements and state become, and the two
hooks bigbatch ships (the noise meter is tested in test_noise_*.py; fault injection here)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from tiny import random_batch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.hooks import StepHook, StepOutcome
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import GPT
from bigbatch.run.loop.faults import Fault, FaultInjection


class Recorder(StepHook):
    """Logs every call; measures the number of backward passes of each step; counts steps in its state."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.steps = 0
        self._backwards = 0

    def before_step(self, engine: AccumulationEngine, step: int, k: int) -> None:
        self.calls.append(("before_step", step, k))
        self._backwards = 0

    def after_forward(self, engine: AccumulationEngine, index: int, loss_sum: torch.Tensor) -> torch.Tensor:
        self.calls.append(("after_forward", index, loss_sum.requires_grad))
        return loss_sum

    def after_backward(self, engine: AccumulationEngine, index: int, micro_batch: Any) -> None:
        has_grad = all(p.grad is not None for p in engine.model.parameters() if p.requires_grad)
        self.calls.append(("after_backward", index, has_grad))
        self._backwards += 1

    def after_step(self, engine: AccumulationEngine, outcome: StepOutcome) -> Any:
        self.calls.append(("after_step", outcome.step, outcome.skipped, engine.step_count))
        self.steps += 1
        return {"backwards": self._backwards}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


def micro_batches(k: int, seed: int) -> list[MicroBatch]:
    return [MicroBatch(*random_batch(2, 16, seed=seed * 10 + i)) for i in range(k)]


def engine_with(model: GPT, hooks: list[StepHook]) -> AccumulationEngine:
    return AccumulationEngine(model, build_adamw(model, 1e-3), constant_schedule(1e-3), grad_clip=1.0, hooks=hooks)


def test_hooks_are_called_at_their_points_of_the_loop_in_order(tiny_model: GPT) -> None:
    recorder = Recorder()
    engine = engine_with(tiny_model, [recorder])
    record = engine.step(micro_batches(3, seed=0))
    assert recorder.calls == [
        ("before_step", 1, 3),
        ("after_forward", 0, True),
        ("after_backward", 0, True),
        ("after_forward", 1, True),
        ("after_backward", 1, True),
        ("after_forward", 2, True),
        ("after_backward", 2, True),
        ("after_step", 1, False, 1),  # after the optimizer step: the engine counts it already
    ]
    assert record.measurements == {"recorder": {"backwards": 3}}
    assert record.noise is None


def test_a_hook_never_changes_the_trajectory(tiny_model: GPT) -> None:
    """Parameters are bitwise identical after steps with a hook that only reads and without one."""
    finals = []
    for hooks in ([], [Recorder()]):
        model = copy.deepcopy(tiny_model)
        engine = engine_with(model, hooks)
        for seed in range(3):
            engine.step(micro_batches(2, seed))
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


def test_hook_state_travels_in_the_engine_state_under_its_name(tiny_model: GPT) -> None:
    recorder = Recorder()
    engine = engine_with(tiny_model, [recorder])
    for seed in range(2):
        engine.step(micro_batches(2, seed))
    state = engine.state_dict()
    assert state["recorder"] == {"steps": 2}
    restored = Recorder()
    engine_with(copy.deepcopy(tiny_model), [restored]).load_state_dict(state)
    assert restored.steps == 2


def test_hooks_need_distinct_names(tiny_model: GPT) -> None:
    with pytest.raises(ValueError, match="distinct names"):
        engine_with(tiny_model, [Recorder(), Recorder()])


def test_fault_injection_poisons_one_micro_batch_once(tiny_model: GPT) -> None:
    """``nan`` at step 2, micro-step 1: that step is skipped (a non-finite gradient), and its retry trains."""
    engine = engine_with(tiny_model, [FaultInjection(Fault("nan", step=2, micro=1), rank=0)])
    records = [engine.step(micro_batches(2, seed)) for seed in range(4)]
    assert [r.skipped for r in records] == [False, True, False, False]
    assert [r.step for r in records] == [1, 2, 2, 3]  # the skipped step is the 2nd tried; the next takes its number
    assert math.isnan(records[1].grad_norm) and engine.skipped_steps == 1


def test_fault_injection_waits_for_its_rank_and_attempt(tiny_model: GPT, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    hooks: list[StepHook] = [
        FaultInjection(Fault("nan", step=1, rank=1), rank=0),  # another rank's fault
        FaultInjection(Fault("nan", step=1, attempt=0), rank=0),  # the first attempt's, and this is the second
    ]
    engine = engine_with(tiny_model, hooks)
    assert not engine.step(micro_batches(2, seed=0)).skipped
