"""In-process training runs for the bad-step tests: a tiny GPT (dropout on, so the generators matter), four
micro-batches a step of data drawn from the step's index, and faults made outside bigbatch's injector (hooks a
test puts on the model itself)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tiny import random_batch

from bigbatch.engine.accumulate import AccumulationEngine, StepRecord
from bigbatch.engine.bad_steps import BadStepSettings
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.hooks import StepHook
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import GPT, GPTConfig

VOCAB = 64
SEQ = 16
K = 4

Batches = Callable[[int], list[MicroBatch]]
"""The micro-batches of the data's step ``i`` (0-based)."""


def random_steps(step: int) -> list[MicroBatch]:
    """Four micro-batches of 2 random sequences each, from ``step`` alone (each named by where it is); the last
    two token ids never occur (a test's bad data may use them)."""
    x, y = random_batch(2 * K, SEQ, vocab=VOCAB - 2, seed=step)
    return [
        MicroBatch(a, b, origin=((0, 1000 * step + 100 * i),))
        for i, (a, b) in enumerate(zip(x.chunk(K), y.chunk(K), strict=True))
    ]


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ, vocab_size=VOCAB, dropout=0.1))


@dataclass
class Run:
    """A finished run: its model, engine and every step's record."""

    model: GPT
    engine: AccumulationEngine
    records: list[StepRecord] = field(default_factory=list)

    @property
    def bad(self) -> list[StepRecord]:
        return [r for r in self.records if r.bad is not None]


def train(
    guard: BadStepSettings | None,
    steps: Sequence[int],
    *,
    hooks: Sequence[StepHook] = (),
    precision: str = "fp32",
    batches: Batches = random_steps,
    drop: dict[int, set[int]] | None = None,
    model_hook: Callable[[GPT], None] | None = None,
    excluded: set[str] | None = None,
    lr: float = 1e-3,
) -> Run:
    """The data's steps ``steps`` in order; ``drop``: micro-batches left out of the data, by data step;
    ``model_hook`` puts a fault on the model before the first step; ``excluded``: a rewind's exclusions, given
    from the start."""
    model = tiny_gpt()
    if model_hook is not None:
        model_hook(model)
    engine = AccumulationEngine(
        model,
        build_adamw(model, lr),
        constant_schedule(lr),
        hooks=list(hooks),
        bad_steps=guard,
        precision=precision,
    )
    if excluded is not None:
        assert engine.guard is not None
        engine.guard.excluded = set(excluded)
    run = Run(model, engine)
    for step in steps:
        micro = batches(step)
        left_out = (drop or {}).get(step, set())
        run.records.append(engine.step([b for i, b in enumerate(micro) if i not in left_out]))
    return run


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def same_state(a: Run, b: Run) -> bool:
    """Parameters, Adam moments, step counts and (fp16) the GradScaler's scale and growth count, bitwise."""
    ours, theirs = a.engine.optimizer.state_dict()["state"], b.engine.optimizer.state_dict()["state"]
    moments = ours.keys() == theirs.keys() and all(
        torch.equal(ours[i][name], value) for i, state in theirs.items() for name, value in state.items()
    )
    counts = (a.engine.step_count, a.engine.scaler.state_dict()) == (b.engine.step_count, b.engine.scaler.state_dict())
    return same_parameters(a.model, b.model) and moments and counts


class NanLossOnce(StepHook):
    """A transient fault: micro-batch ``micro`` of optimizer step ``step`` computes a NaN loss once."""

    def __init__(self, step: int, micro: int) -> None:
        self.step, self.micro, self.fired = step, micro, False

    def after_forward(self, engine: AccumulationEngine, index: int, loss_sum: torch.Tensor) -> torch.Tensor:
        if not self.fired and engine.step_count + 1 == self.step and index == self.micro:
            self.fired = True
            return loss_sum * float("nan")
        return loss_sum


def scale_gradient_of(inputs: torch.Tensor, factor: float) -> Callable[[GPT], None]:
    """A gradient-only fault made outside bigbatch's injector: whenever the model reads exactly ``inputs``, a hook
    on its first block's MLP weight multiplies that weight's gradient by ``factor``; the loss is untouched."""

    def install(model: GPT) -> None:
        armed = [False]

        def watch_inputs(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            armed[0] = args[0].shape == inputs.shape and bool(torch.equal(args[0], inputs))

        def scale(grad: torch.Tensor) -> torch.Tensor | None:
            return grad * factor if armed[0] else None

        model.register_forward_pre_hook(watch_inputs)
        model.transformer.h[0].mlp.c_fc.weight.register_hook(scale)

    return install


def confident_on(token: int, factor: float = 100.0) -> Callable[[GPT], None]:
    """Bad data made outside bigbatch's injector: wherever the input is ``token``, the final hidden state is scaled
    by ``factor``, so the model is confidently wrong there (a loss per token far above the rest)."""

    def install(model: GPT) -> None:
        where: list[torch.Tensor] = []

        def remember(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            where[:] = [args[0] == token]

        def amplify(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
            return torch.where(where[0].unsqueeze(-1), output * factor, output)

        model.register_forward_pre_hook(remember)
        model.transformer.ln_f.register_forward_hook(amplify)

    return install
