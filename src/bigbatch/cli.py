"""Command-line interface: ``bigbatch prepare | train | sample | plan | memory | verify | report | export | eval``.

The CLI only parses arguments and calls the library. User errors
(:class:`~bigbatch.errors.BigBatchError`) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bigbatch import __version__
from bigbatch.errors import BigBatchError
from bigbatch.launch import peer_exit_code, record_quiet_exit, record_user_error
from bigbatch.ranges import (
    MEMORY_K,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    PROBABILITY,
    SEED,
    VOCAB_OR_DEFAULT,
)

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a writer ended by a closed pipe


def _cmd_prepare(args: argparse.Namespace) -> int:
    from bigbatch.data.prepare import DEFAULT_SHARD_TOKENS, prepare_dataset

    meta = prepare_dataset(
        args.source,
        args.out,
        tokenizer_name=args.tokenizer,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
        mode=args.mode,
        workers=args.workers or None,
    )
    print(
        f"{args.out}: {meta.documents} documents, train {meta.tokens['train']:,} tokens, "
        f"val {meta.tokens['val']:,} tokens ({meta.tokenizer}, vocab {meta.vocab_size}, {meta.mode})"
    )
    from bigbatch.data.prepare import prepared_notes

    for note in prepared_notes(meta):
        print(f"{args.out}: {note}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from bigbatch.config import config_from_args
    from bigbatch.distributed import distributed_session, launched_by_torchrun
    from bigbatch.trainer import Trainer

    config = config_from_args(args)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    if config.run.nproc > 1 and not launched_by_torchrun():
        from bigbatch.preflight import check_before_launch

        check_before_launch(config, config.run.nproc)  # a user error is one line from here, not one per rank
        return launch_torchrun(config.run.nproc, ["train", *strip_nproc(args.argv)])
    with distributed_session(config.run.device, config.run.collective_timeout) as (dist, device):
        result = Trainer(config, dist, device).train()
    return 128 + result.stopped_by if result.stopped_by else 0  # the shell's convention for a signal


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """The command line without ``--nproc N`` / ``--nproc=N``, for the workers."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def launch_torchrun(nproc: int, worker_args: list[str]) -> int:
    """Run ``torchrun --standalone --nproc-per-node N -m bigbatch ...`` and return its exit code, through
    :mod:`bigbatch.launch` (a worker's failure becomes one line); the workers die with this process (see
    :mod:`bigbatch.lifeline`)."""
    from bigbatch.lifeline import run_supervised

    command = [
        sys.executable, "-m", "bigbatch.launch", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "bigbatch", *worker_args,
    ]  # fmt: skip
    return run_supervised(command)


def _cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from bigbatch.checkpoint import load_checkpoint, model_from_checkpoint
    from bigbatch.distributed import resolve_device
    from bigbatch.model.sampling import decoded_pieces, generate, generate_stream, prompt_ids
    from bigbatch.tokenizer_files import checkpoint_tokenizer

    device = resolve_device(args.device)
    document = load_checkpoint(args.checkpoint)
    model = model_from_checkpoint(document).to(device)
    tokenizer = checkpoint_tokenizer(document, args.checkpoint)  # the run's own copy first: the cache may move
    ids = prompt_ids(tokenizer, args.prompt, model.config.vocab_size)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    if args.num_samples == 1:  # stream: each piece of text as soon as it is sampled
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
        tokens = generate_stream(model, idx, args.max_new_tokens, args.temperature, args.top_k, generator=generator)
        for piece in decoded_pieces(tokens, tokenizer.decode):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 0
    out = generate(model, idx, args.max_new_tokens, args.temperature, args.top_k, generator=generator)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(args.prompt + tokenizer.decode(out[i, len(ids) :].tolist()))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from bigbatch.accumulate import resolve_precision
    from bigbatch.distributed import resolve_device
    from bigbatch.memory import measure
    from bigbatch.model import preset
    from bigbatch.plan import solve_plan
    from bigbatch.plan_report import format_plan

    solved = solve_plan(args.seq_len, args.tokens_per_step, args.micro_batch, args.k, args.devices)
    model_config = measured = None
    precision = "fp32"
    if args.model:
        device = resolve_device(args.device)
        precision = resolve_precision(args.precision, device)
        model_config = preset(args.model, **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
        if solved.plan.seq_len > model_config.block_size:
            model_config = preset(args.model, block_size=solved.plan.seq_len,
                                  **({"vocab_size": args.vocab_size} if args.vocab_size else {}))  # fmt: skip
        if args.measure:
            measured = measure(model_config, solved.plan.micro_batch, solved.plan.seq_len,
                               k=min(solved.plan.accumulation_steps, 4), device=device, precision=precision)  # fmt: skip
    print(format_plan(solved, args.model, model_config, precision, measured))
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    from bigbatch.accumulate import resolve_precision
    from bigbatch.distributed import resolve_device
    from bigbatch.memory import estimate_memory, measure, memory_report, plot_memory
    from bigbatch.model import preset
    from bigbatch.outputs import require_new_file
    from bigbatch.progress import ProgressBar

    if args.plot:
        require_new_file(args.plot, "--plot", args.overwrite)  # before minutes of measuring
    device = resolve_device(args.device)
    precision = resolve_precision(args.precision, device)
    overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
    config = preset(args.model, **overrides)
    if args.seq_len > config.block_size:
        raise BigBatchError(f"--seq-len {args.seq_len} exceeds the {args.model} block size {config.block_size}")
    sizes = [2**i for i in range(args.max_micro_batch.bit_length()) if 2**i <= args.max_micro_batch]
    rows = []
    with ProgressBar(len(sizes), label="measured", stream=sys.stderr, min_interval=0) as bar:  # only on a TTY
        for i, size in enumerate(sizes):
            bar.update(i, extra=f"measuring micro-batch {size}")
            rows.append(measure(config, size, args.seq_len, k=args.k, device=device, precision=precision,
                                activation_checkpointing=args.activation_checkpointing))  # fmt: skip
            if bar.enabled:
                bar.update(i + 1, extra=f"measured micro-batch {size}")
            else:
                print(f"measured micro-batch {size}", file=sys.stderr)
    estimates = {s: estimate_memory(config, s, args.seq_len, precision).activations for s in sizes}
    how = "allocator peaks" if device.type == "cuda" else "peak resident memory of a fresh process per size"
    print(f"{args.model} | seq_len {args.seq_len} | {precision} | {device} ({how})"
          f"{' | activation checkpointing' if args.activation_checkpointing else ''}")  # fmt: skip
    print(memory_report(rows, estimates))
    if args.plot:
        plot_memory(rows, args.plot, f"{args.model}, seq_len {args.seq_len}, {device.type}")
        print(f"plot: {args.plot}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from bigbatch.report import make_report

    out, summaries, plots = make_report(args.runs, args.out)
    print("\n\n".join(s.format() for s in summaries))
    print(f"\nreport: {out} ({', '.join(p.name for p in plots)}, summary.txt)")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from bigbatch.checkpoint import (
        load_checkpoint,
        model_from_checkpoint,
        resolve_checkpoint,
    )
    from bigbatch.model.hf import save_hf_gpt2
    from bigbatch.tokenizer_files import export_tokenizer

    out = args.out_dir
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # before the (possibly long) load
        raise BigBatchError(f"{out} already exists and is not empty; choose a new output directory")
    path = resolve_checkpoint(args.run)
    document = load_checkpoint(path)
    model = model_from_checkpoint(document)
    save_hf_gpt2(model, out)
    tokenizer_note = export_tokenizer(document, path, out, model.config.block_size)
    cfg = model.config
    print(
        f"exported step {document.get('step', '?')} of {path} to {out} (Hugging Face GPT-2 layout: config.json + "
        f"model.safetensors; {cfg.n_layer} layers, {cfg.n_embd} wide, vocab {cfg.vocab_size}, "
        f"{document.get('tokenizer', 'byte')} tokens{tokenizer_note}); load it with "
        "transformers.GPT2LMHeadModel.from_pretrained and AutoTokenizer.from_pretrained"
    )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from bigbatch.distributed import resolve_device
    from bigbatch.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(
        args.run, args.data, split=args.split, batches=args.batches, micro_batch=args.micro_batch,
        seq_len=args.seq_len, device=resolve_device(args.device), precision=args.precision, cache_dir=args.cache_dir,
    )  # fmt: skip
    print(result.format())
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import json

    from bigbatch.distributed import launched_by_torchrun, resolve_device
    from bigbatch.outputs import require_new_file
    from bigbatch.verify import check_equivalence
    from bigbatch.verify_cli import build_case

    if args.json:
        require_new_file(args.json, "--json", args.overwrite)
    if args.nproc > 1 and not launched_by_torchrun():
        return launch_torchrun(args.nproc, ["verify", *strip_nproc(args.argv)])
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        return _verify_distributed(args)
    case = build_case(args.factory, args.model, args.vocab_size, args.dropout, args.seed,
                      args.k * args.micro_batch, args.seq_len, args.ragged)  # fmt: skip
    try:
        report = check_equivalence(
            case.model, case.batch, loss_fn=case.loss_fn, k=args.k, precision=args.precision,
            tolerance=args.tolerance, device=resolve_device(args.device), seed=args.seed,
            splits=[name.strip() for name in args.splits.split(",") if name.strip()],
        )
    except ValueError as exc:
        raise BigBatchError(str(exc)) from exc
    print(report.format(top=args.top))
    if args.json:
        payload = report.to_dict()
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if report.equivalent else 1


def _verify_distributed(args: argparse.Namespace) -> int:
    """``bigbatch verify --nproc N``: every rank's gradient after the one sync equals the single-process gradient."""

    from bigbatch.distributed import distributed_session
    from bigbatch.verify import check_distributed_equivalence
    from bigbatch.verify_cli import build_case

    with distributed_session(args.device) as (dist, device):
        case = build_case(args.factory, args.model, args.vocab_size, args.dropout, args.seed,
                          args.k * args.micro_batch * dist.world_size, args.seq_len, args.ragged)  # fmt: skip
        report = check_distributed_equivalence(
            case.model, case.batch, dist, loss_fn=case.loss_fn, k=args.k, device=device,
            tolerance=args.tolerance or 1e-5,
        )
        if dist.is_main:
            print(report.format())
    return 0 if report.equivalent else 1


def _count(text: str) -> int:
    """``--tokens-per-step``: a positive count such as 524288, 2M or 512Ki."""
    from bigbatch.plan import parse_count

    try:
        return parse_count(text)
    except BigBatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class UsageError(BigBatchError):
    """A command line that does not parse: reported like every user error (one line, exit 2)."""


class CommandParser(argparse.ArgumentParser):
    """A command's parser: a usage error is one line (the usage of ``train`` alone is dozens), with a pointer to
    ``--help``, and exit code 2 as for every user error."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    from bigbatch.config import add_config_arguments
    from bigbatch.data.tokenizers import TOKENIZER_NAMES

    parser = argparse.ArgumentParser(
        prog="bigbatch",
        description="Train GPT-style models with exact gradient accumulation: the update of a huge batch "
        "on a machine that holds only a small one.",
    )
    parser.add_argument("--version", action="version", version=f"bigbatch {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    commands.required = True

    prepare = commands.add_parser("prepare", help="tokenize text into token shards")
    prepare.add_argument(
        "source", help="a text file, a directory, a glob, 'builtin', or hf:NAME[:CONFIG][:SPLIT] (needs datasets)"
    )
    prepare.add_argument("--out", required=True, type=Path, help="new dataset directory to create")
    prepare.add_argument("--tokenizer", default="byte", help=f"one of {', '.join(TOKENIZER_NAMES)} (default: byte)")
    prepare.add_argument("--val-fraction", type=PROBABILITY.argtype(), default=0.1,
                         help="held-out share (default: 0.1)")
    prepare.add_argument("--shard-tokens", type=NON_NEGATIVE_INT.argtype(), default=0,
                         help="tokens per shard (default: 100M)")
    prepare.add_argument("--workers", type=NON_NEGATIVE_INT.argtype(), default=0,
                         help="tokenizer processes (default: one per core)")
    prepare.add_argument(
        "--mode", default="packed", choices=("packed", "documents"),
        help="packed: one token stream; documents: one padded sequence per document, .jsonl prompts masked",
    )
    prepare.set_defaults(handler=_cmd_prepare)

    train = commands.add_parser(
        "train", help="train a GPT", description="Train a GPT. With no flags, trains the nano demo on the built-in corpus."
    )
    train.add_argument("--config", type=Path, help="TOML config file; flags override it")
    train.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    add_config_arguments(train)
    train.set_defaults(handler=_cmd_train)

    sample = commands.add_parser("sample", help="generate text from a saved run")
    sample.add_argument("--checkpoint", required=True, type=Path, help="run directory or checkpoint file")
    sample.add_argument("--prompt", default="\n", help="text to continue")
    sample.add_argument("--max-new-tokens", type=POSITIVE_INT.argtype(), default=200)
    sample.add_argument("--temperature", type=NON_NEGATIVE.argtype(), default=0.8, help="0 samples greedily")
    sample.add_argument("--top-k", type=NON_NEGATIVE_INT.argtype(), default=50, help="0 disables top-k filtering")
    sample.add_argument("--num-samples", type=POSITIVE_INT.argtype(), default=1)
    sample.add_argument("--seed", type=SEED.argtype(), default=1337)
    sample.add_argument("--device", default="auto")
    sample.set_defaults(handler=_cmd_sample)

    plan = commands.add_parser(
        "plan",
        help="derive K (or micro-batch, or devices) from a token budget; memory and step time",
        description="Give the tokens per step, the sequence length and all but one of micro-batch, K and devices; "
        "the missing one is derived (devices default to 1).",
    )
    plan.add_argument("--tokens-per-step", "--total-batch-tokens", dest="tokens_per_step", type=_count,
                      help="e.g. 524288, 2M (2,000,000) or 512Ki")  # fmt: skip
    plan.add_argument("--seq-len", type=POSITIVE_INT.argtype(), required=True)
    plan.add_argument("--micro-batch", type=POSITIVE_INT.argtype(), help="sequences per micro-batch per device")
    plan.add_argument("--k", type=POSITIVE_INT.argtype(), help="accumulation steps")
    plan.add_argument("--devices", "--world-size", dest="devices", type=POSITIVE_INT.argtype(), help="world size")
    plan.add_argument("--model", help="a preset, for memory (and with --measure, step time)")
    plan.add_argument("--vocab-size", type=VOCAB_OR_DEFAULT.argtype(), default=0,
                      help="vocabulary (default: the preset's, 50257)")
    plan.add_argument("--measure", action="store_true", help="measure memory and time of a micro-step here")
    plan.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    plan.add_argument("--device", default="auto")
    plan.set_defaults(handler=_cmd_plan)

    memory = commands.add_parser(
        "memory",
        help="measure peak memory of a training micro-step for micro-batch sizes 1, 2, 4, ...",
        description="Measured, not estimated: CUDA allocator peaks, or on CPU the peak resident memory of a fresh "
        "process per size (see bigbatch/memory.py). Prints fixed and activation parts, checks linear growth "
        "and that the peak does not grow with K, and can write a PNG plot.",
    )
    memory.add_argument("--model", default="nano", help="preset (default: nano)")
    memory.add_argument("--seq-len", type=POSITIVE_INT.argtype(), default=256)
    memory.add_argument("--max-micro-batch", type=POSITIVE_INT.argtype(), default=16)
    memory.add_argument("--k", type=MEMORY_K.argtype(), default=8, help="K for the whole-step peak (default: 8)")
    memory.add_argument("--vocab-size", type=POSITIVE_INT.argtype(), default=256, help="default: 256 (byte tokens)")
    memory.add_argument("--activation-checkpointing", action="store_true")
    memory.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    memory.add_argument("--device", default="auto")
    memory.add_argument("--plot", type=Path, help="write a PNG plot here (a new file)")
    memory.add_argument("--overwrite", action="store_true", help="replace the --plot file if it exists")
    memory.set_defaults(handler=_cmd_memory)

    verify = commands.add_parser(
        "verify",
        help="prove that the accumulated gradient equals the full-batch gradient",
        description="Compare the full-batch gradient with the gradient accumulated over K micro-batches, show the "
        "classic mistakes next to it, and name modules that break equivalence. Exit 0 when equivalent, 1 when not.",
    )
    verify.add_argument("--model", default="nano", help="model preset (default: nano)")
    verify.add_argument(
        "--factory", help="package.module:function returning your model, or (model, batch[, loss_fn])"
    )
    verify.add_argument("--k", type=POSITIVE_INT.argtype(), default=4, help="micro-batches (default: 4)")
    verify.add_argument("--micro-batch", type=POSITIVE_INT.argtype(), default=2,
                        help="sequences per micro-batch (default: 2)")
    verify.add_argument("--seq-len", type=POSITIVE_INT.argtype(), default=64, help="tokens per sequence (default: 64)")
    verify.add_argument("--vocab-size", type=VOCAB_OR_DEFAULT.argtype(), default=0,
                        help="vocabulary (default: the model's)")
    verify.add_argument("--dropout", type=PROBABILITY.argtype(), default=0.0,
                        help="preset dropout (disabled for the comparison)")
    verify.add_argument(
        "--ragged", action=argparse.BooleanOptionalAction, default=True,
        help="mask a random-length tail of each sequence so micro-batches hold different valid counts (default: on)",
    )
    verify.add_argument("--precision", default="fp32", choices=("auto", "fp32", "bf16", "fp16"))
    verify.add_argument(
        "--splits", default="equal,unequal,permuted",
        help="how the batch is cut into micro-batches, comma-separated: equal (K pieces), unequal (sizes 1, 2, 3, "
        "... and the remainder), permuted (K pieces of the shuffled samples) (default: all three)",
    )
    verify.add_argument("--tolerance", type=POSITIVE.argtype(), help="relative L2 tolerance (default: by precision)")
    verify.add_argument("--top", type=NON_NEGATIVE_INT.argtype(), default=5,
                        help="parameters listed, worst first (default: 5)")
    verify.add_argument("--json", type=Path, help="also write the report as JSON (a new file)")
    verify.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    verify.add_argument("--nproc", type=POSITIVE_INT.argtype(), default=1,
                        help="processes: >1 checks DDP across ranks via torchrun")
    verify.add_argument("--seed", type=SEED.argtype(), default=0)
    verify.add_argument("--device", default="cpu")
    verify.set_defaults(handler=_cmd_verify)

    report = commands.add_parser(
        "report",
        help="plot loss, learning rate, gradient norm and throughput of runs; print a summary",
        description="Read each run's metrics.jsonl and write PNG plots (runs overlaid, labelled by directory name) "
        "and summary.txt: steps, tokens, best validation loss, final train loss, mean tokens/s and MFU, skipped steps.",
    )
    report.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
    report.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/report for one run, "
                        "./report for several)")  # fmt: skip
    report.set_defaults(handler=_cmd_report)

    export = commands.add_parser(
        "export",
        help="write a run's newest valid checkpoint as a Hugging Face GPT-2 model",
        description="Write the model of the newest valid checkpoint (config.json + model.safetensors), loadable "
        "with transformers' GPT2LMHeadModel.from_pretrained(OUT_DIR).",
    )
    export.add_argument("run", type=Path, metavar="RUN_DIR", help="run directory or checkpoint file")
    export.add_argument("--format", default="hf", choices=("hf",), help="hf: Hugging Face GPT-2 layout (default)")
    export.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="new (or empty) output directory")
    export.set_defaults(handler=_cmd_export)

    evaluate = commands.add_parser(
        "eval",
        help="loss and perplexity of a saved run's model on a token set",
        description="Token-weighted mean loss over valid targets, read from the start of the split as training's "
        "validation pass reads it. Defaults come from the run: micro-batch, seq_len, eval_batches.",
    )
    evaluate.add_argument("run", type=Path, metavar="RUN_DIR", help="run directory or checkpoint file")
    evaluate.add_argument("--data", help="prepared dataset directory or raw text (file, dir, glob, 'builtin'), "
                          "prepared with the checkpoint's tokenizer (default: the run's own data)")  # fmt: skip
    evaluate.add_argument("--split", default="val", choices=("val", "train"))
    evaluate.add_argument("--batches", type=NON_NEGATIVE_INT.argtype(),
                          help="micro-batches to read (default: the run's eval_batches; "
                          "0 reads the whole split)")  # fmt: skip
    evaluate.add_argument("--micro-batch", type=POSITIVE_INT.argtype(),
                          help="sequences per micro-batch (default: the run's)")
    evaluate.add_argument("--seq-len", type=POSITIVE_INT.argtype(), help="tokens per sequence (default: the run's)")
    evaluate.add_argument("--cache-dir", type=Path, help="where raw text is prepared (default: the run's cache "
                          "if it exists, else the default cache)")  # fmt: skip
    evaluate.add_argument("--precision", default="fp32", choices=("auto", "fp32", "bf16", "fp16"))
    evaluate.add_argument("--device", default="auto")
    evaluate.set_defaults(handler=_cmd_eval)
    return parser


class CurrentStdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Log lines to whatever ``sys.stdout`` is when they are written, not the stream it was when logging
    was set up (a redirected or replaced stdout would otherwise receive, or fail on, later lines)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        """A closed output pipe (``bigbatch train | head``) is not a logging error to report on every line.

        The rest of the output goes nowhere; a run that listens for SIGTERM stops as politely as on SIGTERM
        (the step ends and is saved), anything else ends at once, quietly (see :func:`main`)."""
        if not isinstance(sys.exc_info()[1], BrokenPipeError):
            super().handleError(record)
            return
        silence_stdout()
        if callable(signal.getsignal(signal.SIGTERM)):  # a polite-stop handler is installed (the training loop)
            signal.raise_signal(signal.SIGTERM)
            return
        raise BrokenPipeError(errno.EPIPE, "output pipe closed")


def out_of_memory(exc: BaseException) -> str:
    """What ran out, when ``exc`` is an allocation failure (CPU allocator, CUDA, Python); else ``""``."""
    text = str(exc)
    if isinstance(exc, MemoryError):
        return "Python could not allocate memory"
    for pattern in (r"tried to allocate [\d.]+ ?[KMGT]?i?B", r"tried to allocate \d+ bytes"):
        match = re.search(pattern, text)
        if match and ("out of memory" in text.lower() or "can't allocate memory" in text):
            return match.group(0)
    return "the device is out of memory" if "out of memory" in text.lower() else ""


def silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so later writes (and the flush at exit) neither fail nor complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (a test's StringIO): nothing to silence
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(raw)
    except UsageError as exc:
        print(f"bigbatch: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    args.argv = raw[1:]  # after the subcommand
    rank = int(os.environ.get("RANK", "0"))  # under torchrun only rank 0 speaks
    if "RANK" in os.environ:
        from bigbatch.lifeline import watch_parents

        watch_parents()  # a worker dies with its launcher and its torchrun agent
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handler = CurrentStdoutHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    from bigbatch.signals import Terminated, sigterm_unwinds

    def user_error(message: str) -> int:
        """One line from one process: under bigbatch's launcher it prints the first rank's; else rank 0."""
        recorded = world > 1 and record_user_error(message)
        if rank == 0 and not recorded:
            print(f"bigbatch: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR

    try:
        with sigterm_unwinds():
            return int(args.handler(args))
    except BigBatchError as exc:
        return user_error(str(exc))
    except BrokenPipeError:  # the reader of our output went away (| head): end quietly, as a pipe's writer does
        silence_stdout()
        if world > 1:
            record_quiet_exit(EXIT_BROKEN_PIPE)
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # disk full, permissions, a file where a directory should be
        where = f": {exc.filename}" if exc.filename else ""
        print(f"bigbatch: error: {exc.strerror or exc}{where}; check the path, its permissions and free space",
              file=sys.stderr)
        return EXIT_USER_ERROR
    except Terminated:
        print("bigbatch: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("bigbatch: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        code = peer_exit_code() if world > 1 else None
        if code is not None:  # a broken collective after a peer's user error or closed pipe: not news
            return code
        if out_of_memory(exc):  # the settings asked for more than there is
            return user_error(
                f"out of memory: {out_of_memory(exc)}; lower --micro-batch, --seq-len, --block-size or the model size"
            )
        raise
