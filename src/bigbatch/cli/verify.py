"""``bigbatch verify``: prove that the accumulated gradient equals the full-batch gradient."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bigbatch.cli.common import add_precision, add_vocab_size
from bigbatch.files.atomic import write_json_atomically
from bigbatch.settings.ranges import (
    AUTO,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    PROBABILITY,
    SEED,
)

HELP = "prove that the accumulated gradient equals the full-batch gradient"
DESCRIPTION = (
    "Compare the full-batch gradient with the gradient accumulated over K micro-batches, show the "
    "classic mistakes next to it, and name modules that break equivalence. Exit 0 when equivalent, 1 when not."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="nano", help="model preset, GPT or Llama, or hf:DIR (default: nano)")
    parser.add_argument("--factory", help="package.module:function returning your model, or (model, batch[, loss_fn])")
    parser.add_argument("--k", type=POSITIVE_INT.argtype(), default=4, help="micro-batches (default: 4)")
    parser.add_argument(
        "--micro-batch", type=POSITIVE_INT.argtype(), default=2, help="sequences per micro-batch (default: 2)"
    )
    parser.add_argument(
        "--seq-len",
        type=POSITIVE_INT.argtype(),
        default=64,
        help="tokens per sequence, at most the model's block size (default: 64, which every preset holds)",
    )
    add_vocab_size(parser)
    parser.add_argument(
        "--dropout",
        type=PROBABILITY.argtype(),
        default=0.0,
        help="dropout probability of the model, 0 for none (for hf: models, every dropout of its config.json); "
        "verify turns it off for the comparison, as dropout draws differ between micro-batch and full batch "
        "(default: 0)",
    )
    parser.add_argument(
        "--ragged",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mask a random-length tail of each sequence so micro-batches hold different valid counts (default: on)",
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="rows of random documents packed by the training loader (--pack on): checks that its positions restart "
        "at each document and that its rows give the gradient of the same documents one per row",
    )
    add_precision(parser, default="fp32")
    parser.add_argument(
        "--splits",
        default="equal,unequal,permuted",
        help="how the batch is cut into micro-batches, comma-separated: equal (K pieces), unequal (sizes 1, 2, 3, "
        "... and the remainder), permuted (K pieces of the shuffled samples) (default: all three)",
    )
    parser.add_argument("--tolerance", type=POSITIVE.argtype(), help="relative L2 tolerance (default: by precision)")
    parser.add_argument(
        "--top",
        type=NON_NEGATIVE_INT.argtype(),
        default=5,
        help="parameters listed, worst first; 0 lists none (default: 5)",
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON (a new file)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    parser.add_argument(
        "--nproc", type=POSITIVE_INT.argtype(), default=1, help="processes: >1 checks DDP across ranks via torchrun"
    )
    parser.add_argument(
        "--seed", type=SEED.argtype(), default=0, help="random seed, any integer from 0 to 2**63 - 1 (default: 0)"
    )
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    from bigbatch.files.outputs import require_new_file
    from bigbatch.parallel.distributed import launched_by_torchrun
    from bigbatch.parallel.launch import relaunch_under_torchrun
    from bigbatch.verify.command import VerifySettings, verify_across_ranks, verify_here

    if args.json:
        require_new_file(args.json, "--json", args.overwrite)
    if not args.factory:
        _check_seq_len(args.model, args.seq_len)  # before torchrun starts, and with the flag that fixes it
    if args.nproc > 1 and not launched_by_torchrun():
        return relaunch_under_torchrun(args.nproc, "verify", args.argv)
    vocab_size = 0 if args.vocab_size == AUTO else args.vocab_size  # 0: the model's
    settings = VerifySettings(
        model=args.model,
        factory=args.factory,
        k=args.k,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        vocab_size=vocab_size,
        dropout=args.dropout,
        ragged=args.ragged,
        packed=args.packed,
        precision=args.precision,
        splits=tuple(name.strip() for name in args.splits.split(",") if name.strip()),
        tolerance=args.tolerance,
        seed=args.seed,
        device=args.device,
    )
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        distributed, is_main = verify_across_ranks(settings)
        if is_main:
            print(distributed.format())
        return 0 if distributed.equivalent else 1
    report = verify_here(settings)
    print(report.format(top=args.top))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before verifying
        write_json_atomically(Path(args.json), report.to_dict())
    return 0 if report.equivalent else 1


def _check_seq_len(model: str, seq_len: int) -> None:
    """A preset's (or hf:DIR's) block size holds ``--seq-len``, or a one-line error that says the flag's limit."""
    from bigbatch.errors import ConfigError
    from bigbatch.models import model_preset

    block_size = model_preset(model).block_size
    if seq_len > block_size:
        raise ConfigError(
            f"--seq-len {seq_len} exceeds the {model} block size {block_size:,}; lower --seq-len to at most "
            f"{block_size:,}"
        )
