"""Step time versus K at a fixed micro-batch, against the model ``K x micro-step + optimizer step``, on CPU.

    python benchmarks/step_time_vs_k.py

One model and engine. Each round measures, interleaved: ``engine.step`` for
K = 1, 2, 4, 8 (the order rotates every round), one micro-step alone (forward
and backward of one micro-batch, ``engine.accumulate``) and the optimizer step
alone (``clip_grad_norm_`` + AdamW ``step``, on the gradients that micro-step
left). The script prints, per K, the median step time, the optimizer's share
of it, the predicted time and the prediction error, against the goal "within
10%".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import GPT, preset

PRESET, B, T = "nano", 8, 128
KS = (1, 2, 4, 8)
GRAD_CLIP = 1.0
ROUNDS, MIN_ROUNDS, BUDGET_S = 12, 3, 20.0  # fewer rounds when a busy machine makes them slow
GOAL = 0.10  # |predicted - measured| / measured


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    torch.manual_seed(0)
    model = GPT(preset(PRESET, vocab_size=256))
    optimizer = build_adamw(model, 1e-3)
    engine = AccumulationEngine(model, optimizer, constant_schedule(1e-3), grad_clip=GRAD_CLIP)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (max(KS), B, T + 1), generator=gen)
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]

    def micro_step() -> None:
        model.zero_grad(set_to_none=True)  # like the first micro-step of a step
        engine.accumulate(batches[:1], n_valid=B * T)

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()

    times: dict[str, list[float]] = {f"K={k}": [] for k in KS} | {"micro-step": [], "optimizer": []}
    rounds, deadline = 0, float("inf")
    for r in range(ROUNDS + 1):  # round 0 is warm-up
        if r == 1:
            deadline = time.perf_counter() + BUDGET_S
        if r > MIN_ROUNDS and time.perf_counter() > deadline:
            break
        shift = r % len(KS)
        for k in KS[shift:] + KS[:shift]:
            t = timed(lambda k=k: engine.step(batches[:k], n_valid=k * B * T))
            if r:
                times[f"K={k}"].append(t)
        t_micro = timed(micro_step)
        t_opt = timed(optimizer_step)  # uses the gradients micro_step() just left
        if r:
            times["micro-step"].append(t_micro)
            times["optimizer"].append(t_opt)
            rounds += 1

    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"{PRESET} model, micro_batch {B} x seq_len {T}, {rounds} rounds (after 1 warm-up), interleaved, medians")
    print(f"  micro-step (forward + backward) {med['micro-step'] * 1000:7.1f} ms")
    print(f"  optimizer step (clip + AdamW)   {med['optimizer'] * 1000:7.1f} ms")
    print(f"  {'K':>3} {'step ms':>9} {'optimizer %':>12} {'predicted ms':>13} {'error %':>8}")
    worst = 0.0
    for k in KS:
        measured = med[f"K={k}"]
        predicted = k * med["micro-step"] + med["optimizer"]
        error = (predicted - measured) / measured
        worst = max(worst, abs(error))
        share = med["optimizer"] / measured
        print(f"  {k:>3} {measured * 1000:9.1f} {share * 100:11.1f}% {predicted * 1000:13.1f} {error * 100:+7.1f}%")
    verdict = "met" if worst <= GOAL else "NOT met"
    print(
        f"prediction K x micro-step + optimizer step: worst error {worst * 100:.1f}% "
        f"(goal within {GOAL * 100:.0f}%: {verdict})"
    )


if __name__ == "__main__":
    main()
