"""``bigbatch plan``: the batch arithmetic, from a token budget to K (or micro-batch, or devices)."""

from __future__ import annotations

import argparse

from bigbatch.cli.common import add_precision
from bigbatch.errors import BigBatchError
from bigbatch.ranges import POSITIVE_INT, VOCAB_OR_DEFAULT

HELP = "derive K (or micro-batch, or devices) from a token budget; memory and step time"
DESCRIPTION = (
    "Give the tokens per step, the sequence length and all but one of micro-batch, K and devices; "
    "the missing one is derived (devices default to 1)."
)


def _count(text: str) -> int:
    """``--tokens-per-step``: a positive count such as 524288, 2M or 512Ki."""
    from bigbatch.plan import parse_count

    try:
        return parse_count(text)
    except BigBatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens-per-step", "--total-batch-tokens", dest="tokens_per_step", type=_count,
                        help="e.g. 524288, 2M (2,000,000) or 512Ki")  # fmt: skip
    parser.add_argument("--seq-len", type=POSITIVE_INT.argtype(), required=True)
    parser.add_argument("--micro-batch", type=POSITIVE_INT.argtype(), help="sequences per micro-batch per device")
    parser.add_argument("--k", type=POSITIVE_INT.argtype(), help="accumulation steps")
    parser.add_argument("--devices", "--world-size", dest="devices", type=POSITIVE_INT.argtype(), help="world size")
    parser.add_argument("--model", help="a preset, for memory (and with --measure, step time)")
    parser.add_argument("--vocab-size", type=VOCAB_OR_DEFAULT.argtype(), default=0,
                        help="vocabulary (default: the preset's, 50257)")  # fmt: skip
    parser.add_argument("--measure", action="store_true", help="measure memory and time of a micro-step here")
    add_precision(parser, default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-ramp", metavar="START_TOKENS:RAMP_TOKENS|auto", default="",
                        help="also print the ramp table: step, K, tokens per step, cumulative tokens "
                        "(e.g. 32K:10M)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from bigbatch.plan import solve_plan
    from bigbatch.plan_report import report_plan

    solved = solve_plan(args.seq_len, args.tokens_per_step, args.micro_batch, args.k, args.devices)
    ramp = None
    if args.batch_ramp:
        from bigbatch.ramp import BatchRamp, check_ramp_settings, format_ramp_table

        spec = check_ramp_settings(args.batch_ramp, solved.plan.tokens_per_step, 0)
        ramp = format_ramp_table(BatchRamp(spec, solved.plan)) if spec is not None else None
    print(report_plan(solved, args.model, args.vocab_size, args.precision, args.device, args.measure))
    if ramp:
        print(ramp)
    return 0
