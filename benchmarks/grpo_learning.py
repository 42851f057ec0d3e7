"""Learning from rewards on the demo task: two named aggregations, and exact accumulation against the
micro-batch-mean variant, over several seeds.

    python benchmarks/grpo_learning.py                 # 5 seeds x 3 variants x 150 steps: about 25 minutes, 2 cores
    python benchmarks/grpo_learning.py --seeds 2 --steps 40

The demo task (bigbatch.rewards.demo_task): two-number addition, "23+58=" -> "81\\n". A nano GPT (0.8M parameters,
byte tokens) is trained on 4,000 supervised rows for ``--sft-steps`` steps (once, kept in ``--work``), exported,
then trained by rewards alone with ``bigbatch train --objective grpo`` on 64 prompts: 8 prompts x 8 completions a step,
exact-answer reward plus 0.2 x format, AdamW, micro-batches of 8 rows (K 8 a step: the aggregation's split
matters). Variants, each from the same start and with the same seeds:

* ``token-mean``: bigbatch's, every completion token of the step weighted alike;
* ``seq-mean-token-mean``: bigbatch's, each completion's token mean, then the completions' mean;
* ``token-mean, micro-mean``: each micro-batch's own token mean, averaged over the K micro-batches (what a trainer
  that normalises per micro-batch computes; kept here only, by a subclass of the objective in a child process).

Printed per variant over the seeds: the mean reward of the first and last 20 steps and their difference with a 95%
interval (t over seeds). The reward is the training reward (temperature 1, on-policy) on the 64 prompts the run
learns from: the policy's accuracy on them as it samples, not a held-out accuracy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
VARIANTS = {
    "token-mean": ("token-mean", False),
    "seq-mean-token-mean": ("seq-mean-token-mean", False),
    "token-mean, micro-mean": ("token-mean", True),
}


def bigbatch(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "bigbatch", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bigbatch {' '.join(args[:2])} failed:\n{done.stderr[-3000:]}")


def supervised_start(work: Path, sft_steps: int) -> Path:
    """The exported supervised model the reward runs start from (trained once)."""
    from bigbatch.rewards.demo_task import write_task

    exported = work / f"sft{sft_steps}-hf"
    if (exported / "config.json").is_file():
        return exported
    write_task(work, n_prompts=64)
    run = work / f"sft{sft_steps}"
    bigbatch(
        *data_args(work),
        *("--model", "nano", "--seq-len", "16", "--micro-batch", "64", "--total-batch-tokens", "1024"),
        *("--max-steps", str(sft_steps), "--lr", "3e-3", "--warmup-steps", "20", "--eval-every", "0"),
        *("--sample-tokens", "0", "--noise-scale-every", "0", "--out", str(run), "--overwrite"),
    )
    bigbatch("export", str(run), "--format", "hf", str(exported))
    return exported


def data_args(work: Path) -> list[str]:
    return ["train", "--data", str(work / "sft.jsonl"), "--data-mode", "documents", "--tokenizer", "byte"]


def reward_run(work: Path, start: Path, variant: str, seed: int, steps: int, lr: float) -> list[float]:
    aggregation, micro_mean = VARIANTS[variant]
    out = work / f"grpo-{variant.replace(', ', '-')}-{seed}"
    args = [
        *data_args(work),
        *(
            "--seq-len",
            "16",
            "--init-from",
            str(start),
            "--objective",
            "grpo",
            "--prompts",
            str(work / "prompts.jsonl"),
        ),
        *("--reward", "builtin:exact-answer,builtin:format=0.2", "--stop", "\\n", "--group-size", "8"),
        *("--prompts-per-step", "8", "--max-completion-tokens", "5", "--micro-batch", "8", "--pack", "off"),
        *("--max-steps", str(steps), "--lr", str(lr), "--warmup-steps", "10", "--sample-tokens", "0"),
        *("--loss-aggregation", aggregation, "--seed", str(seed), "--out", str(out), "--overwrite"),
    ]
    child = [sys.executable, __file__, "--child", "micro-mean" if micro_mean else "exact", *args]
    done = subprocess.run(child, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} seed {seed} failed:\n{done.stderr[-3000:]}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [float(r["reward/mean"]) for r in map(json.loads, lines) if r["kind"] == "step" and not r["skipped"]]


def child(kind: str, argv: list[str]) -> int:
    """Run ``bigbatch`` in this process, with the micro-batch-mean objective patched in for ``micro-mean``."""
    from bigbatch.cli.app import main

    if kind == "micro-mean":
        import torch.nn as nn

        import bigbatch.run.build.rollout_phase as phase
        from bigbatch.engine.policy_gradient import RewardObjective

        class MicroMeanObjective(RewardObjective):
            """Each micro-batch's own mean over its units, then the mean of the micro-batches."""

            def begin_step(self, step: Any) -> None:
                super().begin_step(step)
                self.k = len(step.micro_batches) * step.dist.world_size
                self.total = step.totals.of(self.settings.unit)

            def sums(self, model: nn.Module, batch: Any, index: int) -> dict[str, Any]:
                sums = super().sums(model, batch, index)
                held = max(1.0, self.units(batch)[self.settings.unit])
                return {name: value / held * (self.total / self.k) for name, value in sums.items()}

        phase.RewardObjective = MicroMeanObjective  # type: ignore[misc]
    return main(argv)


def interval(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:+.3f}"
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return f"{mean:+.3f} ({mean - half:+.3f} to {mean + half:+.3f})"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        raise SystemExit(child(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--work", type=Path, default=Path(".bench/grpo-learning"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    start = supervised_start(args.work, args.sft_steps)
    window = min(20, max(1, args.steps // 3))
    print(
        f"GRPO on the demo task: {args.seeds} seeds x {args.steps} steps of 8 prompts x 8 completions, K 8, lr "
        f"{args.lr:g}, from {args.sft_steps} supervised steps; reward = exact answer + 0.2 format"
    )
    print(f"{'variant':<24} {'first ' + str(window):>12} {'last ' + str(window):>10}  last - first (95% interval)")
    for variant in VARIANTS:
        firsts, lasts = [], []
        for seed in range(args.seeds):
            rewards = reward_run(args.work, start, variant, seed, args.steps, args.lr)
            firsts.append(statistics.fmean(rewards[:window]))
            lasts.append(statistics.fmean(rewards[-window:]))
        gains = [b - a for a, b in zip(firsts, lasts, strict=True)]
        print(f"{variant:<24} {statistics.fmean(firsts):>12.3f} {statistics.fmean(lasts):>10.3f}  {interval(gains)}")


if __name__ == "__main__":
    main()
