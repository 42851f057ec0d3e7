"""Packed documents against one document per row: padding and valid target tokens per second, side by side.

    python benchmarks/packing.py [--seq-len 512] [--tokenizer byte]

The data is prompt/completion pairs harvested from this Python's standard library: the prompt a function's
``def name(signature):`` line, the completion its docstring (a few thousand pairs, written as a ``.jsonl`` into a
temporary directory and prepared in documents mode, prompts masked). The same nano-shaped model (block size
``--seq-len``) is trained by two engines, one reading the documents one per padded row (``--pack off``), the
other packed into rows (``--pack on``), on the same micro-batch shape (``B x T``, K micro-batches per step):
rounds interleaved after a warm-up, the order flipping every round. It prints each one's share of padding and of
masked prompt positions, and its valid target tokens per second (the valid targets of all its timed steps over
their total time: a ratio of totals, as the steps hold different numbers of valid targets) and their ratio.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bigbatch.data.dataset import open_dataset
from bigbatch.data.documents import DocumentLoader
from bigbatch.data.loader import loader_for
from bigbatch.data.prepare import prepare_dataset
from bigbatch.engine.accumulate import AccumulationEngine
from bigbatch.engine.batch import StepPolicy, read_step
from bigbatch.engine.optim import build_adamw, constant_schedule
from bigbatch.models import build_model, model_preset
from bigbatch.parallel.distributed import DistContext

MODULES = (
    "os",
    "os.path",
    "shutil",
    "json",
    "re",
    "string",
    "textwrap",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "inspect",
    "typing",
    "datetime",
    "calendar",
    "argparse",
    "logging",
    "subprocess",
    "tempfile",
    "statistics",
    "random",
    "fractions",
    "decimal",
    "heapq",
    "bisect",
    "csv",
    "zipfile",
    "tarfile",
    "gzip",
    "base64",
    "hashlib",
    "urllib.parse",
    "http.client",
    "email.message",
    "email.utils",
    "xml.dom.minidom",
    "unittest",
    "doctest",
    "pdb",
    "threading",
    "multiprocessing",
    "asyncio",
    "socket",
    "ssl",
    "sqlite3",
    "pickle",
    "copy",
    "pprint",
    "difflib",
    "enum",
    "dataclasses",
    "contextlib",
    "abc",
    "numbers",
    "operator",
    "glob",
    "fnmatch",
    "configparser",
    "codecs",
    "locale",
    "gettext",
    "ast",
    "dis",
    "tokenize",
    "importlib",
    "pkgutil",
)


def harvest_pairs() -> list[dict[str, str]]:
    """(``def name(signature):`` , docstring) of every documented function and method of :data:`MODULES`."""
    import importlib

    pairs, seen = [], set()
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        members = list(vars(module).values())
        members += [m for cls in members if inspect.isclass(cls) for m in vars(cls).values()]
        for member in members:
            if not (inspect.isfunction(member) or inspect.ismethod(member)) or id(member) in seen:
                continue
            seen.add(id(member))
            doc = inspect.getdoc(member)
            try:
                signature = str(inspect.signature(member))
            except (TypeError, ValueError):
                continue
            if doc:
                pairs.append({"prompt": f"def {member.__name__}{signature}:\n", "completion": f'    """{doc}"""\n'})
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokenizer", default="byte")
    args = parser.parse_args()
    torch.manual_seed(0)
    B, T, K = args.micro_batch, args.seq_len, args.k
    pairs = harvest_pairs()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "pairs.jsonl"
        source.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        prepare_dataset(str(source), Path(tmp) / "data", args.tokenizer, val_fraction=0.0, mode="documents")
        dataset = open_dataset(Path(tmp) / "data")
        loaders: dict[str, DocumentLoader] = {}
        engines: dict[str, AccumulationEngine] = {}
        for name, pack in (("one per row", False), ("packed", True)):
            loader = loader_for(dataset, "train", B, T, shuffle=True, seed=0, pack=pack)
            assert isinstance(loader, DocumentLoader)
            loaders[name] = loader
            torch.manual_seed(0)
            model = build_model(model_preset("nano", vocab_size=dataset.vocab_size, block_size=T))
            engines[name] = AccumulationEngine(model, build_adamw(model, 1e-3), constant_schedule(1e-3))
        seconds = dict.fromkeys(engines, 0.0)  # of the timed steps
        positions = {name: [0, 0, 0] for name in engines}  # positions, padding, valid targets of the timed steps
        order = list(engines)
        for r in range(args.rounds + 1):  # round 0 is warm-up
            for name in order if r % 2 == 0 else order[::-1]:
                step = read_step(loaders[name], StepPolicy(k=K), DistContext(), torch.device("cpu"))
                started = time.perf_counter()
                engines[name].step(step.micro_batches, step.n_valid)
                elapsed = time.perf_counter() - started
                if r:
                    seconds[name] += elapsed
                    for i, value in enumerate((step.positions, step.padding, step.n_valid)):
                        positions[name][i] += value
    lengths = [len(p["prompt"]) + len(p["completion"]) for p in pairs]
    print(
        f"{len(pairs):,} prompt/completion pairs from the standard library ({args.tokenizer} tokens; median "
        f"{statistics.median(lengths):,.0f} bytes per pair), nano at seq_len {T}, micro_batch {B} x K {K}, CPU "
        f"fp32, {args.rounds} interleaved rounds (after 1 warm-up); valid tok/s: valid targets / time of the timed "
        "steps"
    )
    rates = {name: positions[name][2] / seconds[name] for name in engines}
    for name in engines:
        total, padding, valid = positions[name]
        print(
            f"  {name:<12} padding {padding / total:6.1%} | masked prompts {(total - padding - valid) / total:6.1%} "
            f"| valid targets {valid / total:6.1%} | {rates[name]:>8,.0f} valid tok/s"
        )
    ratio = rates["packed"] / rates["one per row"]
    print(f"packed / one per row, valid target tokens per second: {ratio:.2f}x")


if __name__ == "__main__":
    main()
