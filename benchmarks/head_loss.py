"""The chunked LM head + cross-entropy against the plain one, for GPT-2's head on CPU: time and peak memory.

    python benchmarks/head_loss.py [--rows 1024,2048] [--chunk-rows 166,512] [--no-memory]

GPT-2's head (C 768, V 50257, fp32, no bias), rows of one and two sequences of T=1024, every target valid, and a
case with 30% of the targets IGNORE_INDEX (padding, masked prompts): the plain path,
``F.cross_entropy(F.linear(h, W).float(), targets, reduction="sum")``, computes logits for those rows anyway; the
chunked one (``bigbatch.models.head_loss.linear_cross_entropy_sum``) drops them before the head.

Time: forward + backward (with the rows' and the head's gradients) of each variant, in interleaved rounds (the
order flips every round; round 0 is an untimed warm-up), median seconds, and the median of the per-round ratios
chunked / plain (each ratio from two runs next to each other, which a busy machine disturbs least). ``--chunk-rows``
adds explicit chunk sizes beside the default.

Memory: each variant runs once in a fresh subprocess, which builds its inputs, resets the kernel's high-water mark
of its resident set (``echo 5 > /proc/self/clear_refs``), takes its resident set as the baseline, runs forward +
backward, and reports how far the high-water mark (``VmHWM`` in /proc/self/status, which no allocator can hide)
rose above that baseline: the loss's working memory, the gradients included (Linux only).
``getrusage(RUSAGE_SELF).ru_maxrss`` would not do: it survives fork + exec, so a child starts with the benchmark
process's own peak. No timed assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_config import interleaved_seconds

from bigbatch.engine.batch import IGNORE_INDEX
from bigbatch.models.head_loss import default_chunk_rows, linear_cross_entropy_sum

C, V, T = 768, 50257, 1024
PADDED = 0.3
ROUNDS, MIN_ROUNDS, BUDGET_S = 5, 3, 150.0  # per case; fewer rounds when a busy machine makes them slow


def build(rows: int, padded: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (rows, C) and the head (V, C), leaves wanting a gradient, and targets (rows,) with the first
    ``padded`` of every sequence's positions IGNORE_INDEX (a masked prompt)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, C, generator=g).requires_grad_()
    weight = (torch.randn(V, C, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, V, (rows,), generator=g)
    targets.view(-1, T)[:, : int(padded * T)] = IGNORE_INDEX
    return hidden, weight, targets


def variant(name: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> Callable[[], None]:
    """Forward + backward of ``plain`` or ``chunked:ROWS`` (``chunked:default`` for the default chunk)."""

    def plain() -> None:
        F.cross_entropy(
            F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
        ).backward()

    def chunked() -> None:
        chunk = None if name == "chunked:default" else int(name.split(":")[1])
        linear_cross_entropy_sum(hidden, weight, targets, chunk_rows=chunk).backward()

    def run() -> None:
        hidden.grad = weight.grad = None
        (plain if name == "plain" else chunked)()

    return run


def label(name: str) -> str:
    return f"chunked ({default_chunk_rows(V)} rows, default)" if name == "chunked:default" else name.replace(":", " ")


def times(rows: int, padded: float, names: list[str], rounds: int) -> tuple[dict[str, float], dict[str, float], int]:
    """Median seconds of each variant, median per-round ratio to plain, rounds timed."""
    hidden, weight, targets = build(rows, padded)
    runs = {name: variant(name, hidden, weight, targets) for name in names}
    seconds, timed = interleaved_seconds(runs, rounds, MIN_ROUNDS, BUDGET_S)
    ratio = {n: statistics.median(a / b for a, b in zip(s, seconds["plain"], strict=True)) for n, s in seconds.items()}
    return {name: statistics.median(s) for name, s in seconds.items()}, ratio, timed


def status_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, from /proc/self/status (in kB there)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measure_memory(rows: int, padded: float, name: str) -> int:
    """In this (fresh) process: how far the peak RSS rises above the RSS once the inputs are built."""
    run = variant(name, *build(rows, padded))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current resident set
    baseline = status_bytes("VmRSS")
    run()
    return max(0, status_bytes("VmHWM") - baseline)


def memory(rows: int, padded: float, name: str) -> int:
    """:func:`measure_memory` in a subprocess of its own, so that no earlier variant's peak is counted."""
    spec = json.dumps({"rows": rows, "padded": padded, "name": name})
    done = subprocess.run([sys.executable, __file__, "--measure", spec], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1024,2048", help="rows of the head per case, comma-separated")
    parser.add_argument("--chunk-rows", default="", help="explicit chunk sizes to time beside the default")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one memory measurement
    args = parser.parse_args()
    if args.measure:
        spec = json.loads(args.measure)
        print(measure_memory(spec["rows"], spec["padded"], spec["name"]))
        return

    if any(int(r) % T for r in args.rows.split(",")):
        parser.error(f"--rows: each a multiple of {T} (whole sequences of T = {T}), e.g. 1024,2048")
    names = ["plain", "chunked:default"] + [f"chunked:{c}" for c in args.chunk_rows.split(",") if c]
    cases = [(int(r), 0.0) for r in args.rows.split(",")] + [(int(args.rows.split(",")[-1]), PADDED)]
    print(
        f"GPT-2 head: C {C}, V {V:,}, fp32, CPU, {torch.get_num_threads()} threads; forward + backward, "
        f"medians of interleaved rounds; memory: peak RSS growth, one subprocess per variant"
    )
    print(f"{'rows':>5} {'ignored':>7}  {'variant':<30} {'seconds':>8} {'/ plain':>8} {'peak MB':>8}")
    for rows, padded in cases:
        seconds, ratio, rounds = times(rows, padded, names, args.rounds)
        for name in names:
            peak = "" if args.no_memory else f"{memory(rows, padded, name) / 1e6:8.0f}"
            print(f"{rows:>5} {padded:>7.0%}  {label(name):<30} {seconds[name]:>8.3f} {ratio[name]:>8.3f} {peak:>8}")
        print(f"      ({rounds} rounds)")


if __name__ == "__main__":
    main()
