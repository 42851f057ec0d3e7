"""``bigbatch sample``: generate text from a saved run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bigbatch.cli.common import CHECKPOINT_MEANING, add_config_flag, add_device, add_seed
from bigbatch.run.configuration.rewards_section import RewardsSection
from bigbatch.settings.ranges import POSITIVE_INT

HELP = "generate text from a saved run"
DESCRIPTION = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path, help=CHECKPOINT_MEANING)
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max-new-tokens", type=POSITIVE_INT.argtype(), default=200)
    add_config_flag(parser, RewardsSection, "temperature", default=0.8)
    add_config_flag(parser, RewardsSection, "top_k", default=50)
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
