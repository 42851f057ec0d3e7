from __future__ import annotations

import itertools
import math

import pytest
import torch

from bigbatch.engine.optim import CosineSchedule, build_adamw, param_groups
from bigbatch.models import GPT


def test_schedule_warmup_peak_midpoint_and_floor() -> None:
    s = CosineSchedule(max_lr=6e-4, min_lr=6e-5, warmup_steps=10, decay_steps=110)
    assert s(0) == pytest.approx(6e-5)  # (0 + 1) / 10 of the peak
    assert s(4) == pytest.approx(3e-4)
    assert s(9) == pytest.approx(6e-4)
    assert s(10) == pytest.approx(6e-4)  # peak at the end of warmup
    assert s(60) == pytest.approx((6e-4 + 6e-5) / 2)  # cosine midpoint
    assert s(110) == pytest.approx(6e-5)
    assert s(10_000) == pytest.approx(6e-5)  # floor after decay
    values = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))  # monotone decay


def test_schedule_is_a_pure_function_of_the_step() -> None:
    s = CosineSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=3, decay_steps=20)
    assert [s(i) for i in range(20)] == [s(i) for i in range(20)]
    assert s(7) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 4 / 17)) * 0.9)


def test_schedule_rejects_inconsistent_settings() -> None:
    with pytest.raises(ValueError):
        CosineSchedule(max_lr=1.0, min_lr=2.0, warmup_steps=0, decay_steps=1)
    with pytest.raises(ValueError):
        CosineSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=5, decay_steps=2)


def test_weight_decay_only_on_matrices(tiny_model: GPT) -> None:
    decay, no_decay = param_groups(tiny_model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    counted = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert counted == tiny_model.num_params(non_embedding=False)  # the tied weight appears once


def test_adamw_hyperparameters(tiny_model: GPT) -> None:
    opt = build_adamw(tiny_model, lr=3e-4)
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-8 and group["lr"] == 3e-4
    assert group.get("fused") is True  # CPU parameters take the fused kernel too (one pass per tensor)


def test_saving_an_optimizer_that_has_not_stepped_changes_no_later_step() -> None:
    """torch.distributed.checkpoint makes the moments of a fresh optimizer by a zero-gradient step, which AdamW
    counts: saved before the first step (a rewind's step 0, a stop before step 1), the first real step must stay
    the first, live and after a reload."""
    from bigbatch.run.checkpoints.state import _OptimizerState

    def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)

    def first_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        model(torch.ones(2, 4)).square().sum().backward()
        optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    expected = first_step(*model_and_optimizer())
    model, optimizer = model_and_optimizer()
    saved = _OptimizerState(model, optimizer).state_dict()
    assert all(torch.equal(a, b) for a, b in zip(first_step(model, optimizer), expected, strict=True))
    model, optimizer = model_and_optimizer()
    _OptimizerState(model, optimizer).load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(first_step(model, optimizer), expected, strict=True))
