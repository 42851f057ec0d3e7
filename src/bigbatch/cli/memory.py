"""``bigbatch memory``: measured peak memory of a training micro-step for micro-batch sizes 1, 2, 4, ..."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli.common import (
    add_config_flag,
    add_device,
    add_k,
    add_model,
    add_precision,
    add_seq_len,
    add_vocab_size,
)
from bigbatch.run.configuration.optim_section import OptimSection
from bigbatch.run.configuration.train_config import ModelSection
from bigbatch.settings.ranges import AUTO, MEMORY_K, POSITIVE_INT

HELP = "measure peak memory of a training micro-step for micro-batch sizes 1, 2, 4, ..."
DESCRIPTION = (
    "Measured, not estimated: CUDA allocator peaks, or on CPU the peak resident memory of a fresh "
    "process per size (see bigbatch/sizing/memory.py). Prints fixed and activation parts, checks linear growth "
    "and that the peak does not grow with K, and can write a PNG plot."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser)
    add_seq_len(parser)
    parser.add_argument("--max-micro-batch", type=POSITIVE_INT.argtype(), default=16)
    add_k(parser, default=4, note="; memory: the whole step's peak, against one micro-step's", least=MEMORY_K)
    add_vocab_size(parser)
    add_config_flag(parser, ModelSection, "activation_checkpointing")
    add_config_flag(parser, ModelSection, "chunked_loss")
    add_config_flag(parser, OptimSection, "optimizer", note="; memory: the state the measured step holds")
    add_precision(parser)
    add_device(parser)
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (a new file)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --plot file if it exists")


def run(args: argparse.Namespace) -> int:
    from bigbatch.engine.accumulate import resolve_precision
    from bigbatch.files.outputs import require_new_file
    from bigbatch.parallel.distributed import resolve_device
    from bigbatch.run.configuration.seq_len import model_auto_seq_len
    from bigbatch.sizing.memory import plot_memory, sweep_memory

    if args.plot:
        require_new_file(args.plot, "--plot", args.overwrite)  # before minutes of measuring
    seq_len = model_auto_seq_len(args.model)[0] if args.seq_len == AUTO else args.seq_len  # capped as in train
    device = resolve_device(args.device)
    sweep = sweep_memory(
        args.model,
        seq_len,
        args.max_micro_batch,
        k=args.k,
        vocab_size=0 if args.vocab_size == AUTO else args.vocab_size,  # 0: the model's
        device=device,
        precision=resolve_precision(args.precision, device),
        activation_checkpointing=args.activation_checkpointing,
        chunked_loss=args.chunked_loss,
        optimizer=args.optimizer,
    )
    print(sweep.format())
    if args.plot:
        plot_memory(sweep.rows, args.plot, f"{args.model}, seq_len {seq_len}, {device.type}")
        print(f"plot: {args.plot}")
    return 0
