"""``bigbatch plan``: the batch arithmetic, from a token budget to K (or micro-batch, or devices)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from bigbatch.cli.common import (
    add_config_flag,
    add_device,
    add_k,
    add_micro_batch,
    add_model,
    add_precision,
    add_seq_len,
    add_vocab_size,
    config_default,
)
from bigbatch.errors import BigBatchError, PlanError
from bigbatch.run.configuration.optim_section import OptimSection
from bigbatch.run.configuration.train_config import BatchSection, ModelSection
from bigbatch.settings.ranges import AUTO, POSITIVE_INT

if TYPE_CHECKING:
    from bigbatch.sizing.plan import SolvedPlan

HELP = "derive K (or micro-batch, or devices) from a token budget; memory and step time"
DESCRIPTION = (
    "Give the tokens per step, the sequence length and all but one of micro-batch, K and devices; "
    "the missing one is derived (devices default to 1). With --from-run RUN_DIR the tokens per step come from the "
    "gradient noise scale the run measured."
)


def _count(text: str) -> int:
    """``--tokens-per-step``: a positive count such as 524288, 2M or 512Ki."""
    from bigbatch.sizing.plan import parse_count

    try:
        return parse_count(text)
    except BigBatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flag(
        parser,
        BatchSection,
        "total_batch_tokens",
        default=None,
        note="; plan: e.g. 524288, 2M (2,000,000) or 512Ki; derived when --micro-batch, --k and --devices are given",
        parse=_count,
        aliases=("--tokens-per-step",),
    )
    add_seq_len(parser, note="; plan: the run's with --from-run")
    add_micro_batch(
        parser, default=None, note="; plan: derived when --k and --devices are given, else train's 16", allow_auto=False
    )
    add_k(parser, default=None, note="; plan: derived unless given")
    parser.add_argument("--devices", "--world-size", dest="devices", type=POSITIVE_INT.argtype(), help="world size")
    parser.add_argument(
        "--from-run",
        type=Path,
        metavar="RUN_DIR",
        help="tokens per step from the gradient noise scale measured by a run (the smoothed "
        "estimate of its last usable measurement); micro-batch, seq-len and devices default to the "
        "run's",
    )
    add_model(
        parser,
        default=None,
        note="; plan: for memory (and with --measure, step time); unset: the demo's, nano at the byte tokenizer's "
        "vocabulary 256, unless --from-run",
    )
    add_vocab_size(parser, note="; plan: 256 without --model, the demo's byte tokens")
    parser.add_argument("--measure", action="store_true", help="measure memory and time of a micro-step here")
    add_config_flag(
        parser, OptimSection, "optimizer", note="; plan: its state in the memory table, and Newton-Schulz's FLOPs"
    )
    add_config_flag(parser, OptimSection, "muon_ns_steps", note="; plan: with --optimizer muon, its FLOPs per step")
    add_precision(parser)
    add_device(parser)
    add_config_flag(
        parser, BatchSection, "batch_ramp", note="; plan: also prints the ramp table (step, K, tokens per step, tokens)"
    )


def run(args: argparse.Namespace) -> int:
    from bigbatch.sizing.plan import solve_plan

    vocab_size = 0 if args.vocab_size == AUTO else args.vocab_size  # 0: the preset's
    if args.from_run is not None:
        return _from_run(args, vocab_size)
    demo = ""  # said once the plan is known to hold (a refused budget prints nothing but its line)
    if args.model is None:  # the run `bigbatch train` makes with no flags (make demo)
        args.model = config_default(ModelSection, "preset")
        if not vocab_size:
            from bigbatch.data.tokenizers import ByteTokenizer

            # train's default data, the built-in corpus, is raw text read with byte tokens (--tokenizer auto): the
            # preset's own vocabulary (GPT-2's 50,257) would plan another model, 9x the parameters
            vocab_size = ByteTokenizer.vocab_size
            demo = (
                f"model {args.model} at vocabulary {vocab_size}: the demo, train's default run on the byte tokens of "
                "its built-in corpus (--model and --vocab-size plan another)"
            )
    if args.micro_batch is None and args.k is None:  # train's micro-batch, K derived
        args.micro_batch = config_default(BatchSection, "micro_batch")
    seq_len = args.seq_len
    if seq_len == AUTO:
        from bigbatch.run.configuration.seq_len import model_auto_seq_len

        seq_len, capped = model_auto_seq_len(args.model)
        if capped:  # a directory's context may be 131,072: capped as train caps it
            print(f"seq_len {seq_len} (the {args.model} model's block size, capped; --seq-len sets it)")
        else:
            print(f"seq_len {seq_len} (the {args.model} model's block size)")
    solved = solve_plan(seq_len, args.total_batch_tokens, args.micro_batch, args.k, args.devices, exact=True)
    if demo:
        print(demo)
    ramp = None
    if args.batch_ramp:
        from bigbatch.sizing.ramp import BatchRamp, check_ramp_settings, format_ramp_table

        spec = check_ramp_settings(args.batch_ramp, solved.plan.tokens_per_step, 0)
        ramp = format_ramp_table(BatchRamp(spec, solved.plan)) if spec is not None else None
    print(_report(args, solved, vocab_size))
    if ramp:
        print(ramp)
    return 0


def _from_run(args: argparse.Namespace, vocab_size: int) -> int:
    """``--from-run``: tokens per step from the run's measured noise scale; K derived for the devices given."""
    from bigbatch.observe.noise_report import plan_from_run

    for given, flag in ((args.total_batch_tokens, "--tokens-per-step"), (args.k, "--k")):
        if given is not None:
            raise PlanError(f"--from-run derives tokens per step and K from the run's noise scale; leave out {flag}")
    seq_len = None if args.seq_len == AUTO else args.seq_len  # None: the run's
    solved, lines = plan_from_run(args.from_run, args.micro_batch, seq_len, args.devices)
    print("\n".join(lines))
    print(_report(args, solved, vocab_size))
    return 0


def _report(args: argparse.Namespace, solved: SolvedPlan, vocab_size: int) -> str:
    """The plan's table for the flags given (the optimizer's state and cost among them)."""
    from bigbatch.sizing.plan_report import report_plan

    return report_plan(
        solved,
        args.model,
        vocab_size,
        args.precision,
        args.device,
        args.measure,
        args.optimizer,
        args.muon_ns_steps,
    )
