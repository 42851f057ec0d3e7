"""bigbatch's ``bigbatch train`` path (the Trainer) against a minimal reference GPT loop, side by side, on CPU.

    python benchmarks/speed_vs_reference.py [--quick] [--rounds N] [--steps N] [--shuffle off|on] [--corpus PATH]

The nano shape (4 layers, 4 heads, 128 wide) on tiny Shakespeare (``--corpus`` another text; without either, the
tests' generated English-like text of the same size, and the script says so) with the demo's byte tokenizer
(vocabulary 256 for both), the same optimizer settings (AdamW lr 2e-3, betas (0.9, 0.95), weight decay 0.1 on matrices,
clip 1.0, warmup + cosine), at three settings: (T=64, B=12, K=1), (T=64, B=12, K=4) and (T=256, B=16, K=4).

Each round builds a Trainer exactly as ``bigbatch train`` does (prepared data, run directory, metrics.jsonl,
step lines logged at INFO into a discarded stream, the noise-scale meter at its default, the final checkpoint;
evaluation and sampling off, as the reference has none) and a :class:`reference_gpt.ReferenceGPT` starting from
the Trainer's initial parameters, reading the same windows in the same (sequential) order (bigbatch with
``--shuffle off``; ``--shuffle on`` times bigbatch's default shuffled windows against random offsets instead).
The two run one after the other, which goes first swapping every round; in each, tokens/s is taken from the end of step 1 to
the end of the last step, by the wall clock and by this process's CPU time (all threads; the steadier measure
on a shared machine, where other processes take the cores). The script prints the median over rounds of each,
their ratio against the goal (bigbatch >= 1.02x the reference), and the largest parameter difference after the same steps. The reference
uses torch's default AdamW kernel (the for-loop one on CPU), bigbatch the fused one, which rounds differently;
a short extra run with the reference on the fused kernel too does the same arithmetic (every target is valid,
so the reference's ``mean / K`` equals bigbatch's ``sum / N``): its parameters are expected bitwise identical.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import bench_corpus, cpu_run_config  # noqa: E402
from reference_gpt import ReferenceGPT, train_reference  # noqa: E402

from bigbatch.data.cache import ensure_prepared  # noqa: E402
from bigbatch.data.shards import TokenDataset  # noqa: E402
from bigbatch.run.configuration.train_config import TrainConfig  # noqa: E402
from bigbatch.run.loop.trainer import Trainer  # noqa: E402

SETTINGS = [(64, 12, 1), (64, 12, 4), (256, 16, 4)]  # (T, B, K)
GOAL = 1.02
STEP_BUDGET_S = 4.0  # CPU seconds of training per side and round: steps per round follow from it


def make_config(dataset: Path, out: Path, T: int, B: int, K: int, steps: int, shuffle: str = "off") -> TrainConfig:
    config = cpu_run_config(dataset, out, B, T, K, steps)
    config.data.shuffle = shuffle  # off: the reference's sequential windows, the same data and arithmetic
    return config


def now() -> tuple[float, float]:
    """Wall-clock and CPU time of this process (all its threads)."""
    return time.perf_counter(), time.process_time()


def stamp(step: Callable[..., Any], ends: list[tuple[float, float]]) -> Callable[..., Any]:
    """``engine.step`` noting when each step ends (a measuring hook, not a change of behaviour)."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        record = step(*args, **kwargs)
        ends.append(now())
        return record

    return timed


def rates(ends: list[tuple[float, float]], tokens_per_step: int) -> tuple[float, float]:
    """Tokens per wall-clock second and per CPU second, from the end of step 1 to the end of the last."""
    tokens = (len(ends) - 1) * tokens_per_step
    return tokens / (ends[-1][0] - ends[0][0]), tokens / (ends[-1][1] - ends[0][1])


def one_round(
    dataset: Path,
    tokens: np.ndarray,
    out: Path,
    T: int,
    B: int,
    K: int,
    steps: int,
    bigbatch_first: bool,
    same_kernels: bool = False,
    shuffle: str = "off",
) -> tuple[tuple[float, float], tuple[float, float], float]:
    """Tokens per second and per CPU second of the Trainer and of the reference, and their largest absolute
    parameter difference after. ``same_kernels``: the reference uses the AdamW kernel the Trainer's optimizer
    uses (fused or not), so that the two do the same arithmetic. ``shuffle`` on: bigbatch's default shuffled
    windows against the reference's random offsets (other windows: the parameters differ)."""
    trainer = Trainer(make_config(dataset, out, T, B, K, steps, shuffle))
    cfg = trainer.model_config
    reference = ReferenceGPT(cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size)
    reference.load_state_dict(trainer.model.state_dict())  # the same initial parameters
    trainer_ends: list[tuple[float, float]] = []
    trainer.engine.step = stamp(trainer.engine.step, trainer_ends)
    reference_ends: list[tuple[float, float]] = []
    opt = trainer.config.optim

    def run_reference() -> None:
        train_reference(
            reference,
            tokens,
            steps=steps,
            micro_batch=B,
            seq_len=T,
            accum=K,
            order="random" if shuffle == "on" else "sequential",
            lr=opt.lr,
            min_lr_ratio=opt.min_lr_ratio,
            warmup_steps=opt.warmup_steps,
            weight_decay=opt.weight_decay,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            grad_clip=opt.grad_clip,
            fused=bool(trainer.parts.optimizer.defaults.get("fused")) if same_kernels else None,
            on_step=lambda step, loss: reference_ends.append(now()),
        )

    runs = [trainer.train, run_reference]
    for run in runs if bigbatch_first else reversed(runs):
        run()
    ours, theirs = trainer.model.state_dict(), reference.state_dict()
    diff = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
    tokens_per_step = B * T * K
    return rates(trainer_ends, tokens_per_step), rates(reference_ends, tokens_per_step), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per setting")
    parser.add_argument("--steps", type=int, default=0, help="steps per round (0: about 4 CPU-s of training)")
    parser.add_argument("--quick", action="store_true", help="2 rounds per setting")
    parser.add_argument(
        "--shuffle",
        choices=["off", "on"],
        default="off",
        help="off (default): both read the same windows in order, and their parameters are compared; "
        "on: bigbatch's default shuffled windows against the reference's random offsets",
    )
    parser.add_argument("--corpus", help="the text to train on (default: tiny Shakespeare beside the checkout)")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    # Step lines go where the CLI sends them (INFO), into a discarded stream: formatting them is part of the path.
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    ratios: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="bigbatch-speed-") as tmp:
        root = Path(tmp)
        corpus, corpus_line, _ = bench_corpus(args.corpus, root)
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; nano, byte tokenizer; {corpus_line}",
            flush=True,
        )
        dataset = ensure_prepared(str(corpus), "byte", 0.1, root / "cache")  # once, before timing
        shards = TokenDataset(dataset).shard_arrays("train")
        if len(shards) != 1:
            raise SystemExit("expected one training shard (the reference reads one token array)")
        tokens = np.asarray(shards[0])
        for T, B, K in SETTINGS:
            steps = args.steps
            if not steps:  # calibrate: about STEP_BUDGET_S of CPU time per side (steadier than the wall clock)
                probe = one_round(dataset, tokens, root / f"probe-{T}-{B}-{K}", T, B, K, 4, True)
                steps = max(5, min(40, int(STEP_BUDGET_S * probe[1][1] / (B * T * K))))
            ours: list[tuple[float, float]] = []
            theirs: list[tuple[float, float]] = []
            diffs: list[float] = []
            for r in range(rounds):
                a, b, d = one_round(
                    dataset, tokens, root / f"run-{T}-{B}-{K}-{r}", T, B, K, steps, r % 2 == 0, shuffle=args.shuffle
                )
                ours.append(a)
                theirs.append(b)
                diffs.append(d)
            same_diff = math.nan  # other windows: nothing to compare
            if args.shuffle == "off":
                _, _, same_diff = one_round(dataset, tokens, root / f"same-{T}-{B}-{K}", T, B, K, 5, True, True)
            wall = statistics.median(x[0] for x in ours), statistics.median(x[0] for x in theirs)
            cpu = statistics.median(x[1] for x in ours), statistics.median(x[1] for x in theirs)
            ratio, cpu_ratio = wall[0] / wall[1], cpu[0] / cpu[1]
            ratios.append((ratio, cpu_ratio))
            verdict = "met" if ratio >= GOAL else "NOT met"
            compared = (
                f"    max |parameter difference| after the same steps: {max(diffs):.1e} (the reference's AdamW "
                f"kernel, torch's default); {same_diff:.1e} after 5 steps with the Trainer's AdamW kernel"
                + (" (bitwise identical)" if same_diff == 0 else "")
                if args.shuffle == "off"
                else "    (shuffled: other windows on each side, parameters not compared)"
            )
            print(
                f"T={T:<3} B={B:<2} K={K}  ({B * T * K:>6,} tokens/step, {rounds} rounds x {steps} steps)\n"
                f"    tokens/s      bigbatch {wall[0]:8,.0f}  reference {wall[1]:8,.0f}  ratio {ratio:.3f} "
                f"(goal >= {GOAL}: {verdict})\n"
                f"    tokens/CPU-s  bigbatch {cpu[0]:8,.0f}  reference {cpu[1]:8,.0f}  ratio {cpu_ratio:.3f}\n"
                + compared,
                flush=True,
            )
    print("ratios (tokens/s; tokens/CPU-s): " + ", ".join(f"{r:.3f}; {c:.3f}" for r, c in ratios))


if __name__ == "__main__":
    main()
