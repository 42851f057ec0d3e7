"""A 4x batch change in the middle of a ``--optimizer muon`` run: Muon's momentum moved with the tokens per step
(``--batch-change-momentum tokens``) against kept (``keep``), paired seeds, on CPU.

    python benchmarks/muon_batch_change.py            # 5 paired seeds x 200 steps, about 2.5 CPU-minutes (7.5 min wall, shared)
    python benchmarks/muon_batch_change.py --quick    # 2 seeds x 80 steps: a smoke check (about 2 minutes)

As benchmarks/batch_change.py's "change": pico at seq_len 64 on tiny Shakespeare (or its stand-in, said so), the
byte tokenizer, ``--optimizer muon`` at its defaults (Muon lr = --lr = 2e-3 with the rms scale, momentum 0.95),
warmup 5, cosine to 0.1x over all the steps (``decay_steps``). 100 steps of 1,024 tokens (8 x 64 x K 2), then the
run is resumed in its own directory with ``total_batch_tokens`` 4,096 and ``allow_batch_change`` for 100 more.
Both arms use the rule sqrt (lr x 2, AdamW's beta2 ** 4 for the embeddings, head, gains and biases); they differ
only in Muon's momentum at the change: ``tokens`` sets it to 0.95 ** 4 = 0.8145 (the momentum's half-life stays
the same number of tokens: 13.5 steps of 1,024 = 3.4 steps of 4,096), ``keep`` leaves it at 0.95 (a half-life
4x longer in tokens). Same seed: the same weights and windows, so the first halves are the same computation (the
script checks their losses at the change agree bitwise).

Reported: the mean training loss of the first 5 and 20 steps after the change (``metrics.jsonl``), the validation
loss at the end (the whole split), the mean paired difference tokens - keep with its 95% interval (Student's t).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_change import QUICK, Bench, Sizes, paired, run_change  # noqa: E402
from bench_config import bench_corpus  # noqa: E402

from bigbatch.run.configuration.train_config import TrainConfig  # noqa: E402

ARMS = ("keep", "tokens")


def bench_muon_change(b: Bench) -> None:
    steps, before = b.sizes.change_steps, 1024
    half = steps // 2
    print(
        f"muon change | pico, --optimizer muon, {half} steps of {before:,} tokens, then resumed at {4 * before:,} "
        f"(x4, --allow-batch-change) for {half} more; cosine over all {steps} (lr 2e-3, warmup 5); rule sqrt in both "
        f"arms; --batch-change-momentum tokens (0.95 -> {0.95**4:.4f}) vs keep, same seed"
    )

    def momentum(rule: str) -> Callable[[TrainConfig], None]:
        def apply(config: TrainConfig) -> None:
            config.optim.optimizer = "muon"
            config.optim.batch_change_rule = "sqrt"
            config.optim.batch_change_momentum = rule

        return apply

    runs = run_change(b, "muon_change", {arm: momentum(arm) for arm in ARMS})
    runs.report()
    first = b.sizes.after[0]
    early = statistics.fmean(runs.diffs(first))
    b.summary.append(
        f"muon change x4: tokens - keep, train loss over the {first} steps after the change {early:+.4f}, final val "
        f"loss {paired(runs.diffs())}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, help="paired seeds (default 5; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="2 seeds x 80 steps")
    parser.add_argument("--corpus", help="raw text (default: tiny Shakespeare beside the checkout, else its stand-in)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    torch.set_num_threads(args.threads)
    logging.getLogger("bigbatch").setLevel(logging.WARNING)
    sizes: Sizes = QUICK if args.quick else Sizes()
    seeds = list(range(args.seeds or (2 if args.quick else 5)))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bigbatch-muon-change-") as tmp:
        work = Path(tmp)
        corpus, line, _ = bench_corpus(args.corpus, work)
        print(f"{line} | {args.threads} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        bench = Bench(corpus, work, seeds, sizes)
        bench_muon_change(bench)
    print("summary")
    for line in bench.summary:
        print(f"  {line}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
