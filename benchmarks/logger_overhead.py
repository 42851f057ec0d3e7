"""What the optional loggers cost the demo's training step: none, TensorBoard, W&B (offline), both, side by side.

    python benchmarks/logger_overhead.py [--steps 12]

Each setting trains the demo (``bigbatch train``'s defaults: nano on the built-in corpus, 16,384 tokens per step)
for ``--steps`` steps in its own process, the settings in rounds, the order turning every round. Per setting it
prints the median optimizer-step time (the engine's ``dt``), the median time per step spent in the metrics sinks
(``write_step`` and ``write_eval`` of all loggers, timed around the calls), the ratio (step + loggers) / step,
and the logger's one-off start-up (``open_metrics``: TensorBoard's writer, ``wandb.init``). W&B runs offline
(``WANDB_MODE=offline``, its default console capture and system stats on, as a user gets them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "none": [],
    "tensorboard": ["--tensorboard"],
    "wandb": ["--wandb", "bench"],
    "both": ["--tensorboard", "--wandb", "bench"],
}


def one(out: Path, steps: int, flags: list[str]) -> dict[str, float]:
    """In this process: train the demo with ``flags``, timing the metrics sinks."""
    import bigbatch.observe.metrics as metrics
    from bigbatch.cli.app import main

    spent = {"sinks": 0.0, "open": 0.0}
    open_metrics = metrics.open_metrics

    def timed(name: str, method):  # type: ignore[no-untyped-def]
        def call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started

        return call

    def opened(*args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return open_metrics(*args, **kwargs)
        finally:
            spent["open"] += time.perf_counter() - started

    metrics.MetricsFanout.write_step = timed("sinks", metrics.MetricsFanout.write_step)  # type: ignore[method-assign]
    metrics.MetricsFanout.write_eval = timed("sinks", metrics.MetricsFanout.write_eval)  # type: ignore[method-assign]
    import bigbatch.run.loop.step_log as step_log

    step_log.open_metrics = opened  # type: ignore[attr-defined]
    code = main(
        ["train", "--max-steps", str(steps), "--sample-tokens", "0", "--eval-every", "0", "--out", str(out), *flags]
    )
    assert code == 0, code
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dts = [r["dt"] for r in records if r["kind"] == "step"][1:]  # the first step warms up
    return {"dt": statistics.median(dts), "sinks": spent["sinks"] / steps, "open": spent["open"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = one(Path(args.one), args.steps, json.loads(os.environ["BENCH_FLAGS"]))
        print("RESULT " + json.dumps(result))
        return 0
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": tmp,
            "WANDB_CONFIG_DIR": f"{tmp}/wandb-config",
            "WANDB_CACHE_DIR": f"{tmp}/wandb-cache",
            "BIGBATCH_CACHE": f"{tmp}/cache",
        }
        names = list(SETTINGS)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                out = Path(tmp) / f"{name}-{round_}"
                done = subprocess.run(
                    [sys.executable, __file__, "--steps", str(args.steps), "--one", str(out)],
                    env={**env, "BENCH_FLAGS": json.dumps(SETTINGS[name])},
                    capture_output=True,
                    text=True,
                )
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if done.returncode or line is None:
                    print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
                    return 1
                results[name].append(json.loads(line[len("RESULT ") :]))
    print(f"{'logger':<12} {'step (median)':>14} {'loggers/step':>13} {'ratio':>7} {'start-up':>9}")
    for name, runs in results.items():
        dt = statistics.median(r["dt"] for r in runs)
        sinks = statistics.median(r["sinks"] for r in runs)
        start = statistics.median(r["open"] for r in runs)
        print(f"{name:<12} {dt * 1000:>11.0f} ms {sinks * 1000:>10.2f} ms {(dt + sinks) / dt:>7.4f} {start:>7.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
