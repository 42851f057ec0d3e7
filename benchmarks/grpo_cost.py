"""Where a step of learning from rewards spends its time: sampling (with and without the key-value cache) and
learning, and the statistics pass's share of the learning.

    python benchmarks/grpo_cost.py              # nano (0.8M), 8 prompts x 8 completions, 12 steps a run: ~2 min
    python benchmarks/grpo_cost.py --model gpt2 --steps 3

Each run is ``bigbatch train --objective grpo`` in this process on the demo task's prompts (random weights: the
completions run to --max-completion-tokens, the costliest case), with ``RewardObjective.begin_step`` (the statistics
pass: the old policy's log-probability of every completion token, one forward without gradients per micro-batch)
timed. Per step, from the step records and the timer: the generation time (sampling and scoring the rewards,
``time/generation_s``), the learning time (the engine's step: statistics pass, forwards and backwards, optimizer),
and the statistics pass alone. Step 1 is left out (warm-up). One thread, as the suite runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def run(work: Path, model: str, steps: int, use_cache: bool, max_tokens: int) -> dict[str, float]:
    import bigbatch.rewards.rollout_maker as maker
    from bigbatch.cli.app import main
    from bigbatch.engine.policy_gradient import RewardObjective

    seconds: list[float] = []
    original_begin = RewardObjective.begin_step
    original_make = maker.SampledRollouts.make

    def timed_begin(self: RewardObjective, step: Any) -> None:
        started = time.perf_counter()
        original_begin(self, step)
        seconds.append(time.perf_counter() - started)

    def make(self: Any, prompts: int) -> Any:
        self.use_cache = use_cache
        return original_make(self, prompts)

    RewardObjective.begin_step = timed_begin  # type: ignore[method-assign]
    maker.SampledRollouts.make = make  # type: ignore[method-assign]
    out = work / f"{model}-{'cache' if use_cache else 'nocache'}"
    try:
        code = main(
            [
                *("train", "--data", str(work / "sft.jsonl"), "--data-mode", "documents", "--tokenizer", "byte"),
                *("--model", model, "--seq-len", str(8 + max_tokens), "--objective", "grpo"),
                *("--prompts", str(work / "prompts.jsonl"), "--reward", "builtin:exact-answer,builtin:format=0.2"),
                *("--stop", "\\n", "--group-size", "8", "--prompts-per-step", "8", "--micro-batch", "16"),
                *("--max-completion-tokens", str(max_tokens), "--max-steps", str(steps), "--temperature", "1.0"),
                *("--sample-tokens", "0", "--eval-every", "0", "--out", str(out), "--overwrite"),
            ]
        )
    finally:
        RewardObjective.begin_step = original_begin  # type: ignore[method-assign]
        maker.SampledRollouts.make = original_make  # type: ignore[method-assign]
    if code != 0:
        raise SystemExit(f"the {model} run failed")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r["kind"] == "step"][1:]
    return {
        "generation": statistics.fmean(r["time/generation_s"] for r in steps_),
        "learning": statistics.fmean(r["dt"] for r in steps_),
        "statistics": statistics.fmean(seconds[1:]),
        "tokens": statistics.fmean(r["completion/tokens"] for r in steps_),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="nano")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-completion-tokens", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from bigbatch.rewards.demo_task import write_task

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_task(work, n_sft=200, n_prompts=400, n_test=10)
        print(
            f"--objective grpo, {args.model}, 8 prompts x 8 completions of up to {args.max_completion_tokens} tokens a "
            f"step, micro-batch 16, one thread; means over steps 2..{args.steps}"
        )
        print(f"{'sampler':<10} {'tokens':>7} {'generation s':>13} {'learning s':>11} {'statistics pass':>16}")
        for use_cache in (True, False):
            r = run(work, args.model, args.steps, use_cache, args.max_completion_tokens)
            share = r["statistics"] / r["learning"]
            print(
                f"{'KV cache' if use_cache else 'no cache':<10} {r['tokens']:>7.1f} {r['generation']:>13.3f} "
                f"{r['learning']:>11.3f} {r['statistics']:>8.3f} ({share:.0%})"
            )


if __name__ == "__main__":
    main()
