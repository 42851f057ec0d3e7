"""``bigbatch eval``: loss and perplexity of a saved run's model on a token set."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli.common import (
    CHECKPOINT_MEANING,
    add_config_flag,
    add_device,
    add_micro_batch,
    add_precision,
    add_seq_len,
)
from bigbatch.run.configuration.train_config import DataSection
from bigbatch.settings.ranges import NON_NEGATIVE_INT

HELP = "loss and perplexity of a saved run's model on a token set"
DESCRIPTION = (
    "Token-weighted mean loss over valid targets, on the windows training's validation pass reads (the whole "
    "split when small, else a fixed sample spread uniformly over it). Defaults come from the run: micro-batch, "
    "seq_len, eval_batches."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, metavar="RUN_DIR", help=CHECKPOINT_MEANING)
    add_config_flag(
        parser,
        DataSection,
        "data",
        default=None,
        note="; eval: with the checkpoint's tokenizer, the run's own unless given",
    )
    parser.add_argument("--split", default="val", choices=("val", "train"))
    parser.add_argument(
        "--batches",
        type=NON_NEGATIVE_INT.argtype(),
        help="micro-batches' worth of windows, spread uniformly over the split; 0: no limit, the "
        "whole split (default: the run's eval_batches, i.e. its own validation windows)",
    )
    add_micro_batch(parser, default=None, note="; eval: the run's unless given", allow_auto=False)
    add_seq_len(parser, default=None, note="; eval: the run's unless given", allow_auto=False)
    add_config_flag(parser, DataSection, "cache_dir", default=None, note="; eval: the run's cache if it exists")
    add_precision(parser, default="fp32")
    add_device(parser)


def run(args: argparse.Namespace) -> int:
    from bigbatch.artifacts.evaluate import evaluate_checkpoint
    from bigbatch.parallel.distributed import resolve_device

    result = evaluate_checkpoint(
        args.run,
        args.data,
        split=args.split,
        batches=args.batches,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        device=resolve_device(args.device),
        precision=args.precision,
        cache_dir=args.cache_dir,
    )
    print(result.format())
    return 0
