"""Muon against AdamW at equal tokens, paired seeds, on CPU: does ``--optimizer muon`` learn faster?

    python benchmarks/muon_learning.py                       # both parts at the defaults below (long: see timing)
    python benchmarks/muon_learning.py --only recipe --steps 600
    python benchmarks/muon_learning.py --quick               # 2 seeds, 100 + 8 steps: a smoke check (about 6 CPU-min)

Every comparison trains both arms at the same seed (the same initial weights and the same window order: only the
optimizer differs), so the differences are paired; each table gives the per-seed numbers, then the mean paired
difference (Muon - AdamW) with its standard deviation and 95% interval (Student's t over seeds).

* recipe: the nanoGPT CPU recipe's shape: nano (4 layers x 128) on tiny Shakespeare (or its stand-in, said so)
  with the byte tokenizer, T=64, B=12, K=1 (768 tokens a step), ``--steps`` steps (default 2,000), lr 1e-3 for
  both (nanoGPT's CPU recipe; Muon's at the same rate under ``--muon-scale rms``, its default), bigbatch's
  defaults otherwise (20 warmup steps, cosine to 0.1x, weight decay 0.1, clip 1.0, shuffled windows). Validation
  loss on the same 48 micro-batches (36,864 tokens, a third of the split) 10 times in the run, the last at the end.
* demo: ``bigbatch train`` at its defaults (nano on the built-in corpus, 16,384 tokens a step, lr 2e-3) for
  ``--demo-steps`` steps (default 200), AdamW against ``--optimizer muon``; validation as the demo does it (auto
  batches) at half of the run and at the end.

Reported: the validation loss at a few points and at the end, the mean paired difference, and the steps each arm
needs to reach AdamW's final validation loss (the first evaluation at or below it on the same windows; "-" if
none).

Timing, one thread: a recipe step costs about 0.15 CPU-s and an evaluation of the 48 micro-batches about 2.5, so
2,000 steps x 10 runs is about 55 CPU-minutes, over the 20 minutes this benchmark should fit in: run ``--steps
600`` (about 20 CPU-minutes for 5 seeds) or fewer, and say so. A demo step is about 21 recipe steps (3 CPU-s) and
its evaluation is larger: 200 steps x 10 runs is well over 100 minutes; ``--demo-seeds`` and ``--demo-steps`` make
it smaller. Measured on a shared 2-core machine (wall clock): a 100-step recipe run 27-100 s, an 8-step demo run
130-160 s.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_change import evals, paired, quiet, spread, train  # noqa: E402
from bench_config import bench_corpus, cpu_run_config  # noqa: E402

from bigbatch.run.configuration.train_config import TrainConfig  # noqa: E402

ARMS = ("adamw", "muon")


@dataclass
class Arm:
    evals: list[tuple[int, float]]  # (step, val loss on the fixed windows) during the run
    final: float  # the final evaluation
    seconds: float

    def reached(self, target: float) -> int | None:
        return next((step for step, loss in self.evals if loss <= target), None)


def run_arm(config: TrainConfig, optimizer: str) -> Arm:
    config.optim.optimizer = optimizer
    with quiet():
        result, seconds = train(config)
    out = Path(config.run.out)
    found = [(step, loss) for step, _, loss in evals(out)]
    if result.val_loss is None:
        raise SystemExit(f"{out}: no validation loss")
    return Arm(found, float(result.val_loss), seconds)


def compare(name: str, configs: dict[int, dict[str, TrainConfig]], points: list[int], summary: list[str]) -> None:
    """Train both arms at each seed and print the table of one part."""
    head = " ".join(f"{f'@{p} adamw':>11} {f'@{p} muon':>10}" for p in points)
    print(f"  {'seed':>4} {head} {'steps to adamw final: adamw':>28} {'muon':>6} {'s adamw':>8} {'s muon':>7}")
    at: dict[str, dict[int, list[float]]] = {arm: {p: [] for p in points} for arm in ARMS}
    finals: dict[str, list[float]] = {arm: [] for arm in ARMS}
    reach: dict[str, list[int | None]] = {arm: [] for arm in ARMS}
    for seed, arms in configs.items():
        got = {arm: run_arm(config, arm) for arm, config in arms.items()}
        target = got["adamw"].evals[-1][1]  # AdamW's last evaluation on the fixed windows
        cells = []
        for p in points:
            for arm in ARMS:
                value = dict(got[arm].evals).get(p, float("nan"))
                at[arm][p].append(value)
            cells.append(f"{at['adamw'][p][-1]:>11.4f} {at['muon'][p][-1]:>10.4f}")
        for arm in ARMS:
            finals[arm].append(got[arm].final)
            reach[arm].append(got[arm].reached(target))
        shown = {arm: str(reach[arm][-1]) if reach[arm][-1] is not None else "-" for arm in ARMS}
        print(
            f"  {seed:>4} {' '.join(cells)} {shown['adamw']:>28} {shown['muon']:>6} "
            f"{got['adamw'].seconds:>8.0f} {got['muon'].seconds:>7.0f}",
            flush=True,
        )
    for p in points:
        diffs = [m - a for a, m in zip(at["adamw"][p], at["muon"][p], strict=True)]
        print(
            f"  val loss at step {p:>5} (fixed windows): adamw {spread(at['adamw'][p])}; muon {spread(at['muon'][p])}"
        )
        print(f"  {'':>42}muon - adamw {paired(diffs)}")
    diffs = [m - a for a, m in zip(finals["adamw"], finals["muon"], strict=True)]
    print(f"  final val loss: adamw {spread(finals['adamw'])}; muon {spread(finals['muon'])}")
    print(f"  {'':>42}muon - adamw {paired(diffs)}")
    ratios = [m / a for a, m in zip(reach["adamw"], reach["muon"], strict=True) if a and m]
    missing = sum(m is None for m in reach["muon"])
    ratio_text = f"{statistics.fmean(ratios):.3f}x (range {min(ratios):.3f}..{max(ratios):.3f})" if ratios else "n/a"
    print(
        f"  steps to AdamW's final val loss, muon / adamw: {ratio_text}"
        + (f"; muon did not reach it at {missing} seed(s)" if missing else "")
    )
    summary.append(f"{name}: final val loss muon - adamw {paired(diffs)}; steps to AdamW's final loss {ratio_text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["recipe", "demo"])
    parser.add_argument("--seeds", type=int, help="paired seeds of the recipe (default 5; --quick 2)")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="the first seed (two processes can split the seeds: 0 and 3)"
    )
    parser.add_argument("--steps", type=int, help="recipe steps (default 2,000; --quick 100)")
    parser.add_argument("--lr", type=float, default=1e-3, help="the recipe's lr, both arms (default 1e-3)")
    parser.add_argument("--demo-seeds", type=int, help="paired seeds of the demo (default --seeds)")
    parser.add_argument("--demo-steps", type=int, help="demo steps (default 200; --quick 8)")
    parser.add_argument("--quick", action="store_true", help="2 seeds, 100 recipe and 8 demo steps")
    parser.add_argument("--corpus", help="raw text (default: tiny Shakespeare beside the checkout, else its stand-in)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    torch.set_num_threads(args.threads)
    logging.getLogger("bigbatch").setLevel(logging.WARNING)
    seeds = list(range(args.first_seed, args.first_seed + (args.seeds or (2 if args.quick else 5))))
    demo_seeds = list(range(args.demo_seeds or len(seeds)))
    steps = args.steps or (100 if args.quick else 2000)
    demo_steps = args.demo_steps or (8 if args.quick else 200)
    started = time.perf_counter()
    summary: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bigbatch-muon-learning-") as tmp:
        work = Path(tmp)
        corpus, line, _ = bench_corpus(args.corpus, work)
        print(f"{line} | {args.threads} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        if args.only in (None, "recipe"):
            every = max(1, steps // 10)
            print(
                f"recipe | nano, byte tokenizer, T=64 B=12 K=1, {steps} steps ({steps * 768:,} tokens), lr {args.lr:g} "
                f"both (Muon: --muon-scale rms, momentum 0.95), warmup 20, cosine to 0.1x; {len(seeds)} paired seeds; "
                f"val loss every {every} steps and at the end on the same 48 micro-batches (36,864 tokens)"
            )
            configs: dict[int, dict[str, TrainConfig]] = {}
            for seed in seeds:
                configs[seed] = {}
                for arm in ARMS:
                    config = cpu_run_config(corpus, work / f"recipe_{arm}_{seed}", 12, 64, 1, steps)
                    config.data.tokenizer = "byte"
                    config.data.cache_dir = str(work / "cache")
                    config.run.seed, config.optim.lr = seed, args.lr
                    config.run.eval_every, config.run.eval_batches = every, 48
                    config.run.noise_scale_every = 0
                    configs[seed][arm] = config
            points = sorted({every * round(10 * f) for f in (0.2, 0.5)} | {steps})
            part_started = time.perf_counter()
            compare("recipe", configs, points, summary)
            print(f"  (recipe: {time.perf_counter() - part_started:.0f} s)")
        if args.only in (None, "demo"):
            every = max(1, demo_steps // 2)
            print(
                f"demo | bigbatch train defaults (nano, built-in corpus, 16,384 tokens a step, lr 2e-3) for "
                f"{demo_steps} steps, adamw vs muon; {len(demo_seeds)} paired seeds; val loss every {every} steps"
            )
            configs = {}
            for seed in demo_seeds:
                configs[seed] = {}
                for arm in ARMS:
                    config = TrainConfig()
                    config.data.cache_dir = str(work / "cache")
                    config.run.out = str(work / f"demo_{arm}_{seed}")
                    config.run.max_steps, config.run.seed = demo_steps, seed
                    config.run.eval_every, config.run.sample_tokens = every, 0
                    config.run.device = "cpu"
                    configs[seed][arm] = config
            points = sorted({every, demo_steps})
            part_started = time.perf_counter()
            compare("demo", configs, points, summary)
            print(f"  (demo: {time.perf_counter() - part_started:.0f} s)")
    print("summary")
    for line in summary:
        print(f"  {line}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
