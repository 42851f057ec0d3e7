"""``bigbatch critical-batch``: measure the critical batch by branching short runs from a run's checkpoint."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bigbatch.cli.common import add_config_flag, add_device, add_micro_batch
from bigbatch.critical_batch.rules import DEFAULT_LOSS_TOLERANCE, parse_sizes
from bigbatch.errors import BigBatchError, ConfigError
from bigbatch.run.configuration.train_config import OptimSection, RunSection
from bigbatch.settings.ranges import NON_NEGATIVE, POSITIVE_INT
from bigbatch.sizing.plan import parse_count

HELP = "measure the critical batch: branch short runs from a run's checkpoint at several tokens per step"
DESCRIPTION = (
    "Branch RUN's latest checkpoint at each tokens per step (exact: whole micro-batches, K derived), train each "
    "branch for the same number of tokens with constant optimizer settings (the run's at the branch point, moved "
    "to the branch's size by --batch-change-rule and --batch-change-betas), evaluate every branch on the same "
    "validation windows, and report the largest tokens per step whose loss stays within --tolerance of the "
    "smallest size's. Branches live in RUN/critical-batch/step_SSSSSSS-RULE/tps_N/ (ordinary run directories); "
    "running the command again continues unfinished branches and reuses finished ones. Writes result.json and "
    "critical-batch.png there. With --every N, does so at every checkpoint of RUN at a multiple of N steps and "
    "writes the critical batch against tokens seen, beside the run's noise scale (over-run-RULE.json and .png), "
    "which --batch-ramp from:RUN follows in a new run."
)


def _sizes(text: str) -> list[int]:
    """``--tokens-per-step``: at least two positive counts, refused at parse time like every other flag."""
    try:
        return parse_sizes(text)
    except BigBatchError as exc:
        message = str(exc).removeprefix("--tokens-per-step").lstrip(": ")  # argparse names the flag itself
        raise argparse.ArgumentTypeError(message) from None


def _budget(text: str) -> int:
    """``--budget``: a positive count such as 512Ki."""
    try:
        return parse_count(text)
    except BigBatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", type=Path, metavar="RUN", help="the run directory to branch from (its newest checkpoint)"
    )
    parser.add_argument(
        "--tokens-per-step",
        required=True,
        metavar="N,N,...",
        type=_sizes,
        help="comma-separated tokens per step, e.g. 16Ki,32Ki,64Ki,128Ki (Ki = 1,024; K = 1,000)",
    )
    parser.add_argument(
        "--budget",
        required=True,
        metavar="TOKENS",
        type=_budget,
        help="tokens each branch trains on (e.g. 512Ki); a whole number of steps at every size",
    )
    parser.add_argument(
        "--tolerance",
        type=NON_NEGATIVE.argtype(),
        default=DEFAULT_LOSS_TOLERANCE,
        help="a size is as good as the smallest when its loss is at most (1 + tolerance) times the "
        f"smallest's; 0: no higher at all (default: {DEFAULT_LOSS_TOLERANCE}, i.e. "
        f"{DEFAULT_LOSS_TOLERANCE * 100:g}%%)",
    )
    for name in ("batch_change_rule", "batch_change_betas", "batch_change_weight_decay", "batch_change_momentum"):
        add_config_flag(parser, OptimSection, name, note="; critical-batch: from the run's size to each branch's")
    parser.add_argument("--lr-rule", help=argparse.SUPPRESS)  # renamed: refused in one line below
    add_micro_batch(
        parser,
        default=None,
        note="; critical-batch: every branch's and evaluation's, the run's unless given",
        allow_auto=False,
    )
    add_config_flag(
        parser,
        RunSection,
        "eval_batches",
        default=None,
        allow_auto=False,
        note="; critical-batch: per branch, the run's unless given",
    )
    parser.add_argument(
        "--step", type=POSITIVE_INT.argtype(), help="branch from RUN's checkpoint at this step (default: its newest)"
    )
    parser.add_argument(
        "--every",
        type=POSITIVE_INT.argtype(),
        metavar="N",
        help="measure at every checkpoint of RUN at a multiple of N steps (two or more: train with --save-every "
        "and --keep-checkpoints 0) and write the critical batch against tokens seen",
    )
    add_device(parser)
    parser.add_argument("--no-plot", action="store_true", help="skip critical-batch.png")


def run(args: argparse.Namespace) -> int:
    from bigbatch.critical_batch.measure import RESULT_FILE, Interrupted, measure_critical_batch, measure_over_run
    from bigbatch.engine.batch_change import BatchChangeRule

    if args.lr_rule is not None:
        raise ConfigError(
            "--lr-rule is now --batch-change-rule (none, sqrt or linear; constant is none), which also moves beta2 "
            "(--batch-change-betas) as train's batch changes do"
        )
    if args.every is not None and args.step is not None:
        raise ConfigError("--every measures at several checkpoints and --step at one; give one of them")
    if args.batch_change_momentum != "auto":
        _check_muon_run(Path(args.run), args.batch_change_momentum)
    rule = BatchChangeRule.resolve(
        args.batch_change_rule, args.batch_change_betas, args.batch_change_weight_decay, args.batch_change_momentum
    )
    common = {
        "tolerance": args.tolerance,
        "rule": rule,
        "micro_batch": args.micro_batch,
        "eval_batches": args.eval_batches,
        "device": args.device,
        "plot": not args.no_plot,
    }
    try:
        if args.every is not None:
            over_run, path = measure_over_run(args.run, args.every, args.tokens_per_step, args.budget, **common)
            print(over_run.format())
            print(f"wrote {path}" + ("" if args.no_plot else f" and {path.with_suffix('.png')}"))
            return 0
        result = measure_critical_batch(args.run, args.tokens_per_step, args.budget, step=args.step, **common)
    except Interrupted as stop:
        logging.getLogger(__name__).warning(
            "critical-batch stopped; the branch's checkpoint is saved: run the same command to continue"
        )
        return 128 + stop.signum
    print(result.format())
    base = Path(result.branches[0].run_dir).parent
    print(f"wrote {base / RESULT_FILE}" + ("" if args.no_plot else f" and {base / 'critical-batch.png'}"))
    return 0


def _check_muon_run(run: Path, momentum: str) -> None:
    """``--batch-change-momentum`` moves Muon's momentum: refused in one line for a run that trains without Muon."""
    import tomllib

    try:
        optimizer = tomllib.loads((run / "config.toml").read_text()).get("optim", {}).get("optimizer", "adamw")
    except (OSError, tomllib.TOMLDecodeError):
        return  # no readable run here: the measurement says so in its own line
    if optimizer != "muon":
        raise ConfigError(
            f"--batch-change-momentum {momentum} applies to a run trained with --optimizer muon, and {run} trains "
            f"with {optimizer}; leave it out"
        )
