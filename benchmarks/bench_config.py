"""The ``bigbatch train`` settings the benchmarks time the Trainer with, and the corpus they measure on (imported
by them, not a benchmark)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigbatch.run.configuration.train_config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
TINY_SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
"""Where CI keeps tiny Shakespeare, beside the checkout (never inside it): the corpus of docs/benchmarks.md's
numbers."""
TINY_SHAKESPEARE_BYTES = 1_115_394


def generated_corpus(directory: Path, n_bytes: int = TINY_SHAKESPEARE_BYTES) -> tuple[Path, str]:
    """The tests' deterministic English-like text (tests/support/text_corpus.py) written into ``directory``, and
    a line that says so."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from text_corpus import text_corpus

    path = directory / "generated.txt"
    path.write_bytes(text_corpus(n_bytes))
    return path, f"corpus: generated English-like text (tests/support/text_corpus.py), {n_bytes:,} bytes"


def bench_corpus(given: str | None, directory: Path) -> tuple[Path, str, bool]:
    """The corpus a benchmark measures on, a line saying which, and whether it is tiny Shakespeare's stand-in:
    ``given`` (``--corpus``) when there is one; else tiny Shakespeare beside the checkout when it is there; else
    the generated text of the same size, and the line says that its numbers are not docs/benchmarks.md's."""
    if given is not None:
        return Path(given), f"corpus: {given} (--corpus)", False
    if TINY_SHAKESPEARE.is_file():
        return TINY_SHAKESPEARE, f"corpus: tiny Shakespeare, {TINY_SHAKESPEARE}", False
    path, line = generated_corpus(directory)
    return path, f"{line}, as {TINY_SHAKESPEARE} is absent: not the README's corpus", True


def cpu_run_config(
    data: Path | str, out: Path | str, micro_batch: int, seq_len: int, k: int, steps: int
) -> TrainConfig:
    """The demo's defaults otherwise (nano, optimizer, noise scale, log every step): ``steps`` steps of ``k``
    micro-batches of ``micro_batch x seq_len`` on the CPU into ``out``, without evaluation or the end-of-run
    sample (the minimal loops they are compared with have neither)."""
    config = TrainConfig()
    config.data.data = str(data)
    config.batch.micro_batch, config.batch.seq_len = micro_batch, seq_len
    config.batch.total_batch_tokens = micro_batch * seq_len * k
    config.run.max_steps = steps
    config.run.out = str(out)
    config.run.device = "cpu"
    config.run.eval_every = 0
    config.run.sample_tokens = 0
    return config


def interleaved_seconds(
    runs: dict[str, Callable[[], object]], rounds: int, min_rounds: int, budget_s: float
) -> tuple[dict[str, list[float]], int]:
    """Seconds of each call of each run over interleaved rounds (one warm-up round first, untimed; the order flips
    every round so neither side always runs on a warmer cache), and the rounds timed: at least ``min_rounds``,
    fewer than ``rounds`` once ``budget_s`` is spent (a busy machine makes rounds slow)."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    timed, deadline = 0, float("inf")
    order = list(runs)
    for r in range(rounds + 1):  # round 0 is warm-up
        if r == 1:
            deadline = time.perf_counter() + budget_s
        if r > min_rounds and time.perf_counter() > deadline:
            break
        for name in order if r % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            runs[name]()
            if r:
                seconds[name].append(time.perf_counter() - started)
        timed += 1 if r else 0
    return seconds, timed


def interleaved_step_rates(
    engines: dict[str, Any], batches: list[Any], rounds: int, min_rounds: int, budget_s: float
) -> tuple[dict[str, float], int]:
    """Training tokens/s of each engine over :func:`interleaved_seconds`' rounds, one optimizer step of ``batches``
    per round: a step's tokens over the median round's seconds (every round trains the same tokens; the median
    keeps a round slowed by the machine's other work out), and the rounds timed."""
    tokens = sum(mb.inputs.numel() for mb in batches)
    runs = {name: (lambda engine=engine: engine.step(batches, n_valid=tokens)) for name, engine in engines.items()}
    seconds, timed = interleaved_seconds(runs, rounds, min_rounds, budget_s)
    return {name: tokens / statistics.median(values) for name, values in seconds.items()}, timed
