"""AccumulationEngine.step() versus the classic hand-written accumulation loop, on CPU.

    python benchmarks/engine_vs_handwritten.py

Two copies of the same model (same init) see the same full micro-batches (no
-100 targets, so ``mean / K`` is exact) with the same K, optimizer and schedule.
The hand-written loop is the textbook idiom::

    zero_grad; for each of K micro-batches: forward, loss / K, backward
    clip_grad_norm_; optimizer.step(); set the next learning rate

The two alternate step by step (which goes first swaps every step), and the
script prints median tokens/s of each, the throughput ratio engine/hand-written
against its goal, and the largest relative parameter difference after the run
(a sanity check that both trained the same model).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import CosineSchedule, build_adamw
from bigbatch.models import GPT, preset

K, B, T = 4, 8, 128
STEPS, WARMUP = 20, 2  # timed steps per alternative (at most), untimed steps first
BUDGET_S = 25.0  # stop timing earlier than STEPS when a busy machine makes steps slow
LR, GRAD_CLIP = 1e-3, 1.0
GOAL = 0.98  # engine tokens/s >= 98% of the hand-written loop's


def handwritten_step(
    model: GPT, optimizer: torch.optim.Optimizer, schedule: Callable[[int], float], step: int, batches: list[MicroBatch]
) -> None:
    """The classic idiom; exact here only because every micro-batch is full."""
    for group in optimizer.param_groups:
        group["lr"] = schedule(step)
    optimizer.zero_grad(set_to_none=True)
    for mb in batches:
        logits = model(mb.inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten())  # mean over the micro-batch's tokens
        (loss / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()


@torch.no_grad()
def max_relative_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest per-tensor relative L2 difference ||a - b|| / ||b|| over all parameters."""
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        worst = max(worst, float((pa - pb).norm() / pb.norm().clamp_min(1e-12)))
    return worst


def main() -> None:
    torch.manual_seed(0)
    base = GPT(preset("nano", vocab_size=256))
    schedule = CosineSchedule(max_lr=LR, min_lr=LR / 10, warmup_steps=2, decay_steps=STEPS + WARMUP)

    engine_model = copy.deepcopy(base)
    engine = AccumulationEngine(engine_model, build_adamw(engine_model, LR), schedule, grad_clip=GRAD_CLIP)
    hand_model = copy.deepcopy(base)
    hand_optimizer = build_adamw(hand_model, LR)
    hand_model.train()

    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"engine": [], "hand-written": []}
    step, deadline = 0, float("inf")
    while step < WARMUP + STEPS and time.perf_counter() < deadline:
        if step == WARMUP:
            deadline = time.perf_counter() + BUDGET_S
        tokens = torch.randint(0, 256, (K, B, T + 1), generator=gen)
        batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]
        runs: dict[str, Callable[[], object]] = {
            "engine": lambda batches=batches: engine.step(batches),
            "hand-written": lambda step=step, batches=batches: handwritten_step(
                hand_model, hand_optimizer, schedule, step, batches
            ),
        }
        order = list(runs) if step % 2 == 0 else list(reversed(runs))  # cancels any first/second bias
        for name in order:
            started = time.perf_counter()
            runs[name]()
            if step >= WARMUP:
                times[name].append(time.perf_counter() - started)
        step += 1

    tokens_per_step = K * B * T
    rate = {name: tokens_per_step / statistics.median(t) for name, t in times.items()}
    print(
        f"nano model, micro_batch {B} x seq_len {T} x K {K} = {tokens_per_step:,} tokens/step, "
        f"{len(times['engine'])} timed steps each (after {WARMUP} warm-up), interleaved, medians"
    )
    for name in times:
        print(f"  {name:<13} {statistics.median(times[name]) * 1000:8.1f} ms/step  {rate[name]:10,.0f} tokens/s")
    difference = max_relative_difference(engine_model, hand_model)
    # 0 is usual: both scale the same per-token gradients by one scalar, 1/N (engine) or
    # (1/K) / (B x T) (idiom), and these round to the same float here (always when B x T is a
    # power of two); otherwise expect differences at the level of float rounding (~1e-7).
    note = " (bitwise identical)" if difference == 0 else ""
    print(f"  max relative parameter difference after {step} steps: {difference:.2e}{note}")
    ratio = rate["engine"] / rate["hand-written"]
    verdict = "met" if ratio >= GOAL else "NOT met"
    print(f"ratio: engine / hand-written = {ratio:.3f} tokens/s (goal >= {GOAL}: {verdict})")


if __name__ == "__main__":
    main()
