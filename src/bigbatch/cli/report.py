"""``bigbatch report``: plots and a summary of runs' metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "plot loss, learning rate, gradient norm and throughput of runs; print a summary"
DESCRIPTION = (
    "Read each run's metrics.jsonl and write PNG plots (runs overlaid) and summary.txt: steps, tokens, best "
    "validation loss, final train loss, tok/s (tokens / time of steps 2..N) and the MFU at it, the padding and "
    "masked-prompt shares of document runs, the noise scale (or why there is none), skipped steps. Each run is "
    "labelled by the name it was trained with (bigbatch train --name, kept in its config.toml), else by its "
    "directory's name (runs/nano-6771823094: nano-6771823094); where two runs would share a label, each adds its "
    "parent directory, then the next, until they differ (a/run, b/run)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
    parser.add_argument(
        "--out",
        type=Path,
        help="output directory (default: RUN_DIR/report for one run; for several, report in the directory that "
        "holds them all, e.g. runs/report, never the working directory itself)",
    )


def run(args: argparse.Namespace) -> int:
    from bigbatch.observe.report import make_report

    out, summaries, plots = make_report(args.runs, args.out)
    print("\n\n".join(s.format() for s in summaries))
    print(f"\nreport: {out} ({', '.join(p.name for p in plots)}, summary.txt)")
    return 0
