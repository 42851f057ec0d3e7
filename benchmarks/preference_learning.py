"""DPO learns a preference whose right answer is known, exactly accumulated against the micro-batch-mean variant.

    python benchmarks/preference_learning.py            # 5 seeds, about a minute on 2 CPU cores
    python benchmarks/preference_learning.py --seeds 2 --steps 30

The task (built here, so the preferred answer is known): a prompt is 4 tokens drawn from 0..15; the chosen answer
is the prompt shifted by 16 (token t -> t + 16), the rejected one 4 tokens drawn from 16..31 (plausible, wrong).
A tiny GPT (2 layers, 32 wide) is trained with DPO (beta 0.5, reference: the starting model, frozen) for 60 AdamW
steps of 16 pairs, cut into K 4 micro-batches of uneven sizes drawn anew each step (as packed rows of pairs of
different lengths make them). Two ways of accumulating the same pairs:

* ``exact``: bigbatch's, each micro-batch's summed pair losses over the step's pairs;
* ``micro-mean``: each micro-batch's mean over its own pairs, divided by K (what TRL's DPOTrainer does; exact only
  when every micro-batch holds as many pairs).

Printed per variant, over the seeds: the held-out preference accuracy (share of 256 unseen pairs whose implicit
reward margin is positive), the held-out DPO loss, and the first step's gradient distance from the one-big-batch
gradient (the exact one is at rounding; the micro-mean one is not).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
from typing import Any

import torch
import torch.nn as nn

from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import ROLE_CHOSEN, ROLE_REJECTED
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.engine.preference import PreferenceObjective, PreferenceSettings, ReferencePolicy, answer_losses
from bigbatch.models import GPT, GPTConfig
from bigbatch.verify.answer_batches import Group, answer_micro_batch

VOCAB, SEQ, BETA = 32, 16, 0.5


class MicroMeanDPO(PreferenceObjective):
    """DPO averaged over each micro-batch's own pairs and then over the K micro-batches."""

    def begin_step(self, step: Any) -> None:
        super().begin_step(step)
        self.k, self.pairs = len(step.micro_batches), step.totals.of("pair")

    def sums(self, model: nn.Module, batch: Any, index: int) -> dict[str, torch.Tensor]:
        sums = super().sums(model, batch, index)
        held = max(1.0, self.units(batch)["pair"])
        sums["dpo"] = sums["dpo"] / held * (self.pairs / self.k)
        return sums


def task(n: int, gen: random.Random) -> list[Group]:
    groups = []
    for _ in range(n):
        prompt = [gen.randrange(16) for _ in range(4)]
        chosen = [t + 16 for t in prompt]
        rejected = [16 + gen.randrange(16) for _ in range(4)]
        groups.append(Group(prompt, [chosen, rejected], [ROLE_CHOSEN, ROLE_REJECTED]))
    return groups


def uneven_sizes(n: int, k: int, gen: random.Random) -> list[int]:
    cuts = sorted(gen.sample(range(1, n), k - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]


def held_out(model: nn.Module, reference: nn.Module, groups: list[Group]) -> tuple[float, float]:
    """(accuracy, DPO loss) over ``groups``."""
    batch = answer_micro_batch(groups, SEQ, packed=True, rows=8)
    with torch.no_grad():
        policy = -answer_losses(model, batch)
        ref = -answer_losses(reference, batch)
    ratio = (policy - ref).view(-1, 2)  # (pairs, [chosen, rejected]): documents in group order
    margin = BETA * (ratio[:, 0] - ratio[:, 1])
    return float((margin > 0).double().mean()), float(-torch.nn.functional.logsigmoid(margin).mean())


def gradient(model: nn.Module, objective: PreferenceObjective, batches: list[Any]) -> torch.Tensor:
    replica = copy.deepcopy(model)
    engine = AccumulationEngine(
        replica, torch.optim.SGD(replica.parameters(), lr=1.0), constant_schedule(1.0), objective=objective
    )
    replica.zero_grad(set_to_none=True)
    engine.accumulate(batches)
    return torch.cat([p.grad.reshape(-1) for p in replica.parameters()])


def run(variant: str, seed: int, steps: int) -> dict[str, float]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB, dropout=0.0))
    reference = copy.deepcopy(model)
    cls = MicroMeanDPO if variant == "micro-mean" else PreferenceObjective
    objective = cls(PreferenceSettings("dpo", beta=BETA), ReferencePolicy(copy.deepcopy(reference)))
    exact = PreferenceObjective(PreferenceSettings("dpo", beta=BETA), ReferencePolicy(copy.deepcopy(reference)))
    engine = AccumulationEngine(model, build_adamw(model, 3e-3, 0.0), constant_schedule(3e-3), objective=objective)
    data = random.Random(seed)
    test = task(256, random.Random(10_000 + seed))
    first_distance = 0.0
    for step in range(steps):
        groups = task(16, data)
        batches = _cut(groups, uneven_sizes(16, 4, data))
        if step == 0:
            whole = gradient(model, exact, [answer_micro_batch(groups, SEQ, packed=True, rows=8)])
            got = gradient(model, objective, batches)
            first_distance = float((got - whole).norm() / whole.norm())
        engine.step(batches)
    accuracy, loss = held_out(model, reference, test)
    return {"accuracy": accuracy, "loss": loss, "first_step_rel_l2": first_distance}


def _cut(groups: list[Group], sizes: list[int]) -> list[Any]:
    parts, at = [], 0
    for size in sizes:
        parts.append(answer_micro_batch(groups[at : at + size], SEQ, packed=True, rows=2))
        at += size
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    results: dict[str, list[dict[str, float]]] = {"exact": [], "micro-mean": []}
    for seed in range(args.seeds):
        for variant in results:
            results[variant].append(run(variant, seed, args.steps))
    print(f"DPO on a known preference: {args.seeds} seeds x {args.steps} steps of 16 pairs, K 4 uneven micro-batches")
    print(f"{'variant':<11} {'held-out accuracy':>22} {'held-out DPO loss':>22} {'first step rel L2':>18}")
    for variant, runs in results.items():
        acc = [r["accuracy"] for r in runs]
        loss = [r["loss"] for r in runs]
        dist = [r["first_step_rel_l2"] for r in runs]
        spread = statistics.stdev(acc) if len(acc) > 1 else 0.0
        loss_spread = statistics.stdev(loss) if len(loss) > 1 else 0.0
        print(
            f"{variant:<11} {statistics.mean(acc):>14.3f} ± {spread:.3f} {statistics.mean(loss):>14.4f} ± "
            f"{loss_spread:.4f} {statistics.mean(dist):>18.2e}"
        )
    paired = [e["accuracy"] - m["accuracy"] for e, m in zip(results["exact"], results["micro-mean"], strict=True)]
    print(
        f"paired accuracy difference, exact - micro-mean: {statistics.mean(paired):+.3f} (per seed: "
        + ", ".join(f"{d:+.3f}" for d in paired)
        + ")"
    )


if __name__ == "__main__":
    main()
