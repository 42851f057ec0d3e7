"""The engine's per-step host work: fused AdamW on CPU, no walk of the module tree per step, same results."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from tiny import random_batch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule, fused_adamw_supported
from bigbatch.models import GPT, GPTConfig


def batches(k: int = 2) -> list[MicroBatch]:
    return [MicroBatch(*random_batch(2, 16, seed=i)) for i in range(k)]


def test_adamw_is_fused_on_the_cpu(tiny_model: GPT) -> None:
    assert fused_adamw_supported(tiny_model)
    optimizer = build_adamw(tiny_model, 1e-3)
    assert optimizer.defaults["fused"] is True
    assert build_adamw(tiny_model, 1e-3, fused=False).defaults["fused"] is None  # asked off: the for-loop kernel
    assert not fused_adamw_supported(nn.Linear(2, 2).to(torch.float64).to("meta"))


def test_fused_adamw_trains_like_the_for_loop_within_rounding(tiny_model: GPT) -> None:
    models = [tiny_model, copy.deepcopy(tiny_model)]
    engines = [
        AccumulationEngine(m, build_adamw(m, 1e-2, fused=fused), constant_schedule(1e-2))
        for m, fused in zip(models, (True, False), strict=True)
    ]
    for _ in range(3):
        losses = [engine.step(batches()).loss for engine in engines]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        # Each step moves a parameter by up to lr = 1e-2; the kernels round differently (a few ulp), and Adam
        # magnifies that where a gradient is near eps: far below one step's move.
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_a_step_neither_walks_the_module_tree_nor_resets_training_flags(
    tiny_model: GPT, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = AccumulationEngine(tiny_model, build_adamw(tiny_model, 1e-3), constant_schedule(1e-3))
    engine.step(batches())
    calls = {"train": 0, "parameters": 0}
    train, parameters = nn.Module.train, nn.Module.parameters

    def counting_train(self: nn.Module, mode: bool = True) -> nn.Module:
        calls["train"] += 1
        return train(self, mode)

    def counting_parameters(self: nn.Module, recurse: bool = True):  # type: ignore[no-untyped-def]
        calls["parameters"] += 1
        return parameters(self, recurse)

    monkeypatch.setattr(nn.Module, "train", counting_train)
    monkeypatch.setattr(nn.Module, "parameters", counting_parameters)
    engine.step(batches())
    assert calls == {"train": 0, "parameters": 0}


def test_a_step_after_an_evaluation_trains_with_dropout_again() -> None:
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=61, dropout=0.5))
    engine = AccumulationEngine(model, build_adamw(model, 1e-3), constant_schedule(1e-3))
    engine.step(batches())
    model.transformer.h[1].eval()  # e.g. an evaluation of the inner model that left a block in eval mode
    engine.step(batches())
    assert all(module.training for module in model.modules())


def test_gradients_left_over_before_a_step_do_not_leak_into_it(tiny_model: GPT) -> None:
    clean, dirty = tiny_model, copy.deepcopy(tiny_model)
    engines = [AccumulationEngine(m, build_adamw(m, 1e-2), constant_schedule(1e-2)) for m in (clean, dirty)]
    for p in dirty.parameters():
        p.grad = torch.full_like(p, 3.0)
    for engine in engines:
        engine.step(batches())
    for a, b in zip(clean.parameters(), dirty.parameters(), strict=True):
        assert torch.equal(a, b)


def same_to_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to fp32 rounding, relative to the tensor's scale: matmuls of 61 and of 64 vocabulary rows need not
    add their products in the same order (the BLAS picks kernels and blocking by shape, CPU and thread count), so
    bitwise equality is one machine's outcome, not a property. A wrong row or a lost gradient is far larger."""
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max())


def test_padded_vocabulary_logits_on_cpu_are_contiguous_and_the_same_numbers(tiny_model: GPT) -> None:
    """The head multiplies by its first vocab_size rows only: no slice of padded logits to copy, same values and
    gradients (to rounding) as the padded matmul cut back."""
    assert tiny_model.config.padded_vocab_size > tiny_model.config.vocab_size  # 61 -> 64
    inputs, targets = random_batch(3, 16)
    logits = tiny_model(inputs)
    assert logits.shape == (3, 16, tiny_model.config.vocab_size) and logits.is_contiguous()
    logits.sum().backward()
    grads = {name: p.grad.clone() for name, p in tiny_model.named_parameters()}  # type: ignore[union-attr]
    tiny_model.zero_grad(set_to_none=True)
    h = tiny_model.transformer.wte(inputs) + tiny_model.transformer.wpe(torch.arange(16))
    for block in tiny_model.transformer.h:
        h = block(h)
    padded = tiny_model.lm_head(tiny_model.transformer.ln_f(h))[..., : tiny_model.config.vocab_size]
    assert same_to_rounding(padded, logits)
    padded.sum().backward()
    for name, p in tiny_model.named_parameters():
        assert same_to_rounding(p.grad, grads[name]), name  # type: ignore[arg-type]
    assert not tiny_model.transformer.wte.weight.grad[tiny_model.config.vocab_size :].any()  # type: ignore[index]
