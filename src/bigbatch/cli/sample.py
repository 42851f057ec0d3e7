"""``bigbatch sample``: generate text from a saved run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bigbatch.cli.common import CHECKPOINT_MEANING, add_device, add_seed
from bigbatch.settings.ranges import NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE_INT

HELP = "generate text from a saved run"
DESCRIPTION = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path, help=CHECKPOINT_MEANING)
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max-new-tokens", type=POSITIVE_INT.argtype(), default=200)
    parser.add_argument(
        "--temperature", type=NON_NEGATIVE.argtype(), default=0.8, help="0 samples greedily (default: 0.8)"
    )
    parser.add_argument(
        "--top-k",
        type=NON_NEGATIVE_INT.argtype(),
        default=50,
        help="keep the k most likely tokens; 0 disables top-k filtering (default: 50)",
    )
    parser.add_argument("--num-samples", type=POSITIVE_INT.argtype(), default=1)
    add_seed(parser)
    add_device(parser)


def run(args: argparse.Namespace) -> int:
    from bigbatch.artifacts.sample import sample_checkpoint

    sample_checkpoint(
        args.checkpoint,
        args.prompt,
        sys.stdout,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        num_samples=args.num_samples,
        seed=args.seed,
        device_name=args.device,
    )
    return 0
