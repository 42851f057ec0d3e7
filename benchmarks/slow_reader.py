"""Data loading off the critical path: the Trainer's step time with an artificially slow reader, on CPU.

    python benchmarks/slow_reader.py [--corpus PATH]

The nano model on tiny Shakespeare (byte tokenizer; ``--corpus`` another text; without either, the tests' generated
English-like text of the same size, and the script says so), T=64, B=12, K=2. First the compute time per step is
measured with the ordinary reader; then every micro-batch read is made to wait ``SLOW`` x the compute time of
one micro-batch (a sleep, which like real file or network I/O leaves the processor to the training thread).
The Trainer runs with its read-ahead thread (the default) and with ``prefetch=False``; each round runs the three
(compute only, read ahead, read inline) one after the other, order rotating, and the script prints the median
over rounds of each one's step time over the same round's compute time. With reading off the critical path
the ratio stays near 1; read inline it is about ``1 + SLOW``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigbatch.data.cache import ensure_prepared
from bigbatch.engine.batch import MicroBatch
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import bench_corpus, cpu_run_config  # noqa: E402

T, B, K = 64, 12, 2
STEPS, ROUNDS = 12, 4  # steps per run (the first not timed); rounds
SLOW = 0.8  # a read takes this share of one micro-batch's compute


def make_config(dataset: Path, out: Path) -> TrainConfig:
    config = cpu_run_config(dataset, out, B, T, K, STEPS)
    config.run.noise_scale_every = 0
    config.optim.warmup_steps = 2
    return config


def slowed(read: Callable[[], MicroBatch], delay: float) -> Callable[[], MicroBatch]:
    def slow_read() -> MicroBatch:
        time.sleep(delay)
        return read()

    return slow_read


def step_time(dataset: Path, out: Path, delay: float, prefetch: bool) -> float:
    """Median seconds between step ends (steps 2..STEPS) of one Trainer run."""
    trainer = Trainer(make_config(dataset, out), prefetch=prefetch)
    loader: Any = trainer.parts.train_loader  # the reader itself, under the read-ahead thread when there is one
    if delay:
        loader.next_micro_batch = slowed(loader.next_micro_batch, delay)
    ends: list[float] = []
    step = trainer.engine.step

    def timed(*args: Any, **kwargs: Any) -> Any:
        record = step(*args, **kwargs)
        ends.append(time.perf_counter())
        return record

    trainer.engine.step = timed  # type: ignore[method-assign]
    trainer.train()
    return statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="the text to train on (default: tiny Shakespeare beside the checkout)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bigbatch-slow-reader-") as tmp:
        root = Path(tmp)
        corpus, corpus_line, _ = bench_corpus(args.corpus, root)
        print(corpus_line, flush=True)
        dataset = ensure_prepared(str(corpus), "byte", 0.1, root / "cache")
        runs = 0

        def run(delay: float, prefetch: bool) -> float:
            nonlocal runs
            runs += 1
            return step_time(dataset, root / f"run-{runs}", delay, prefetch)

        delay = SLOW * run(0.0, True) / K  # calibrated once; then every round measures all three, rotating
        modes = {"compute only": (0.0, True), "read ahead": (delay, True), "read inline": (delay, False)}
        times: dict[str, list[float]] = {name: [] for name in modes}
        for r in range(ROUNDS):
            names = list(modes)[r % 3 :] + list(modes)[: r % 3]
            for name in names:
                times[name].append(run(*modes[name]))
    compute = statistics.median(times["compute only"])
    print(
        f"nano, T={T} B={B} K={K}: compute {compute * 1000:.1f} ms per step; each micro-batch read made to wait "
        f"{delay * 1000:.1f} ms ({SLOW:.0%} of a micro-batch's compute); {ROUNDS} rounds, the three runs of a "
        "round one after the other (order rotating)"
    )
    per_round = {
        name: statistics.median(t / c for t, c in zip(values, times["compute only"], strict=True))
        for name, values in times.items()
        if name != "compute only"
    }
    for name, values in times.items():
        if name in per_round:
            print(
                f"  {name:<12} {statistics.median(values) * 1000:7.1f} ms per step = {per_round[name]:.2f} x compute "
                "(median over rounds of the ratio to the same round's compute)"
            )
    ratio = per_round["read inline"] / per_round["read ahead"]
    print(
        f"ratio: step time read inline / read ahead = {ratio:.2f} (read ahead: {per_round['read ahead']:.2f} x "
        "compute, goal <= 1.10)"
    )


if __name__ == "__main__":
    main()
