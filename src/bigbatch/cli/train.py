"""``bigbatch train``: train a GPT-2, Llama or mixture-of-experts model; every config field is a flag."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from bigbatch.run.configuration.config_sources import add_config_arguments

HELP = "train a GPT-2, Llama or mixture-of-experts model"
DESCRIPTION = (
    "Train a GPT-2, Llama or mixture-of-experts model (--model). With no flags, trains the nano demo on the built-in "
    "corpus."
)


REFUSED_FLAGS = {
    flag: "train sets the tokens per step with --total-batch-tokens N (K follows from it, the micro-batch, seq_len "
    "and processes, and varies per step under --token-budget, a ramp or Seesaw); plan and verify take " + flag
    for flag in ("--k", "--tokens-per-step")
}
"""Flags of plan and verify that train refuses with its own advice, rather than as unknown."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file; flags override it")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    add_config_arguments(parser)


def say(message: str, *args: Any, level: int = logging.INFO) -> None:
    logging.getLogger("bigbatch.train").log(level, message, *args)


def run(args: argparse.Namespace) -> int:
    from bigbatch.run.configuration.config_sources import file_settings

    with file_settings(args).naming_errors():  # an error about a --config file's value names its key, not a flag
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from bigbatch.parallel.distributed import distributed_session, launched_by_torchrun
    from bigbatch.parallel.launch import relaunch_under_torchrun
    from bigbatch.run.configuration.config_sources import config_from_args
    from bigbatch.run.loop.trainer import Trainer

    config = config_from_args(args)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    if config.run.nproc > 1 and not launched_by_torchrun():
        from bigbatch.run.build import chosen_run_dir
        from bigbatch.run.build.checks import check_before_launch
        from bigbatch.run.loop.run_dir_lock import held_for_workers

        check_before_launch(config, config.run.nproc)  # a user error is one line from here, not one per rank
        with held_for_workers(chosen_run_dir(config), config.run.wait_for_lock, say):  # for the whole job
            return relaunch_under_torchrun(config.run.nproc, "train", args.argv, config.run.max_restarts)
    with distributed_session(config.run.device, config.run.collective_timeout) as (dist, device):
        result = Trainer(config, dist, device).train()
    return 128 + result.stopped_by if result.stopped_by else 0  # the shell's convention for a signal
