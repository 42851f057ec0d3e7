"""The full Trainer versus the AccumulationEngine alone, on CPU: what the loop around the engine costs.

    python benchmarks/trainer_vs_engine.py

The Trainer reads a prepared dataset (the tests' generated English-like text,
tests/support/text_corpus.py: byte-level windows cost the same whatever the
text, so the same corpus on every machine; written to a temporary directory
and prepared once, before timing), writes metrics.jsonl, formats its
step line (logging at WARNING, so nothing is printed) and saves a checkpoint at
the end; evaluation and sampling are off. The engine alone gets the same
model preset, optimizer, schedule and batch plan, fed with micro-batches built
before timing. The two run in short rounds, alternately (which goes first
swaps every round); in each round the first step (warm-up) is excluded and
tokens/s is taken from the end of step 1 to the end of the last step. The
script prints the median over rounds of each and the ratio trainer/engine
against its goal. Because this machine's speed drifts over seconds, it also
prints the Trainer's own cost per step measured inside its rounds (time
between step ends minus the engine's ``StepRecord.dt``), which that drift
does not affect.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.shards import TokenDataset
from bigbatch.data.stream import TokenStreamLoader
from bigbatch.engine.accumulate import AccumulationEngine, StepRecord
from bigbatch.engine.batch import MicroBatch
from bigbatch.engine.optim import CosineSchedule, build_adamw
from bigbatch.models import GPT, preset
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import cpu_run_config, generated_corpus  # noqa: E402

PRESET, B, T, K = "nano", 8, 128, 4
STEPS = 5  # optimizer steps per round; the first of each round is not timed
ROUNDS, MIN_ROUNDS, BUDGET_S = 8, 3, 25.0  # short rounds interleave finely; fewer when the machine is busy
GOAL = 0.97  # trainer tokens/s >= 97% of the engine's


def make_config(dataset: Path, out: Path) -> TrainConfig:
    config = cpu_run_config(dataset, out, B, T, K, STEPS)
    config.model.preset = PRESET
    config.data.cache_dir = str(out.parent / "cache")
    config.run.save_every = 0  # the last step is always saved
    return config


def time_engine_steps(
    step: Callable[..., StepRecord], ends: list[float], dts: list[float]
) -> Callable[..., StepRecord]:
    """Wraps ``engine.step`` to note when each step ends and how long the engine took
    (a measuring hook, not a change of behaviour)."""

    def timed(*args: Any, **kwargs: Any) -> StepRecord:
        record = step(*args, **kwargs)
        ends.append(time.perf_counter())
        dts.append(record.dt)
        return record

    return timed


def tokens_per_s(ends: list[float]) -> float:
    """Tokens/s from the end of step 1 to the end of the last step (steps 2..STEPS)."""
    return (len(ends) - 1) * B * T * K / (ends[-1] - ends[0])


def trainer_round(dataset: Path, out: Path, extra: dict[str, list[float]]) -> float:
    started = time.perf_counter()
    trainer = Trainer(make_config(dataset, out))
    built = time.perf_counter()
    ends: list[float] = []
    dts: list[float] = []
    trainer.engine.step = time_engine_steps(trainer.engine.step, ends, dts)  # type: ignore[method-assign]
    trainer.train()
    extra["construction"].append(built - started)
    extra["after last step"].append(time.perf_counter() - ends[-1])  # final checkpoint, closing files
    # Outside engine.step in steps 2..STEPS: loading, pinning, metrics, step line, stop check.
    timed = ends[-1] - ends[0]
    outside = timed - sum(dts[1:])
    extra["outside engine"].append(outside / (len(ends) - 1))
    extra["outside share"].append(outside / timed)
    return tokens_per_s(ends)


def engine_round(config: TrainConfig, batches: list[MicroBatch]) -> float:
    """The engine as the Trainer builds it (same seed, optimizer and schedule), fed pre-built micro-batches."""
    torch.manual_seed(config.run.seed)
    model = GPT(preset(PRESET, vocab_size=256))
    opt = config.optim
    optimizer = build_adamw(model, lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2), eps=opt.eps)
    schedule = CosineSchedule(
        max_lr=opt.lr, min_lr=opt.lr * opt.min_lr_ratio, warmup_steps=min(opt.warmup_steps, STEPS), decay_steps=STEPS
    )
    engine = AccumulationEngine(model, optimizer, schedule, grad_clip=opt.grad_clip)
    ends: list[float] = []
    for i in range(STEPS):
        engine.step(batches[i * K : (i + 1) * K], n_valid=B * T * K)  # packed: every target is valid
        ends.append(time.perf_counter())
    return tokens_per_s(ends)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="bigbatch-bench-") as tmp:
        root = Path(tmp)
        corpus, corpus_line = generated_corpus(root, 300_000)
        dataset = ensure_prepared(str(corpus), "byte", 0.1, root / "cache")  # once, before timing
        loader = TokenStreamLoader(TokenDataset(dataset).shard_arrays("train"), B, T)
        batches = [loader.next_micro_batch() for _ in range(STEPS * K)]  # the Trainer's first STEPS steps
        config = make_config(dataset, root / "unused")

        rates: dict[str, list[float]] = {"trainer": [], "engine alone": []}
        extra: dict[str, list[float]] = {
            key: [] for key in ("construction", "after last step", "outside engine", "outside share")
        }
        deadline = time.perf_counter() + BUDGET_S
        for r in range(ROUNDS):
            if r >= MIN_ROUNDS and time.perf_counter() > deadline:
                break
            runs: dict[str, Callable[[], float]] = {
                "trainer": lambda r=r: trainer_round(dataset, root / f"run-{r}", extra),
                "engine alone": lambda: engine_round(config, batches),
            }
            for name in runs if r % 2 == 0 else reversed(list(runs)):  # swap who goes first every round
                rates[name].append(runs[name]())

    n = len(rates["trainer"])
    print(
        f"{PRESET} model, micro_batch {B} x seq_len {T} x K {K} = {B * T * K:,} tokens/step, {n} rounds of "
        f"{STEPS} steps each (step 1 of a round not timed), interleaved, medians over rounds"
    )
    print(f"  {corpus_line}")
    for name, values in rates.items():
        spread = f"(rounds {min(values):,.0f} .. {max(values):,.0f})"
        print(f"  {name:<13} {statistics.median(values):10,.0f} tokens/s  {spread}")
    own_ms = statistics.median(extra["outside engine"]) * 1000
    own_share = statistics.median(extra["outside share"]) * 100
    print(f"  trainer's own cost per step (outside engine.step): {own_ms:.2f} ms = {own_share:.2f}% of its step time")
    print(
        f"  trainer, not in tokens/s: construction {statistics.median(extra['construction']) * 1000:.0f} ms, "
        f"after the last step (final checkpoint) {statistics.median(extra['after last step']) * 1000:.0f} ms"
    )
    ratio = statistics.median(rates["trainer"]) / statistics.median(rates["engine alone"])
    verdict = "met" if ratio >= GOAL else "NOT met"
    print(f"ratio: trainer / engine alone = {ratio:.3f} tokens/s (goal >= {GOAL}: {verdict})")


if __name__ == "__main__":
    main()
