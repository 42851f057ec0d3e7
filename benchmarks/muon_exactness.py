"""``--optimizer muon`` is exact under accumulation: the same update however the step is cut, on CPU.

    python benchmarks/muon_exactness.py            # about 45 s on one thread (4 runs of `bigbatch train`)
    python benchmarks/muon_exactness.py --quick    # the engine parts only, no `bigbatch train` runs (seconds)

Muon orthogonalises the step's gradient (Newton-Schulz), which is not linear in the gradient: an implementation
that orthogonalised each micro-batch's gradient, or built the momentum per micro-batch, would give a different
update at every K. bigbatch runs it once per optimizer step, after the last backward and the one gradient sync.
This script checks that three ways:

* ``bigbatch train --optimizer muon`` (pico, byte tokenizer on tiny Shakespeare or its stand-in, fp32, 3 steps of
  256 tokens = 8 rows of 32, lr 1e-2 without warm-up, the data's order): 8 x K 1 (the reference), 1 x K 8,
  2 DDP processes of 4 x K 1 and 2 FSDP2 processes of 4 x K 1 (``--nproc 2 --parallel ddp|fsdp``, gloo; each
  matrix orthogonalised by one owner rank). Relative L2 of the final parameters against the reference, over the
  Muon matrices and over the whole model (goal: at most 1e-5).
* the engine directly in float64 (a GPT of 2 layers x 32 wide, vocabulary 61, ``AccumulationEngine`` +
  ``build_muon``, 3 steps of 8 random rows of 16): K = 2 and 8 against K = 1, with the library's loss (its head's
  logits are cast to float32: the floor of what float64 can show) and with a float64 cross-entropy of the whole
  logits (rounding only).
* Newton-Schulz calls per step at K = 1, 2, 8 (``bigbatch.engine.muon.orthogonalise`` counted): must equal the
  number of Muon matrices, whatever K.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import bench_corpus  # noqa: E402

import bigbatch.engine.muon as muon_module  # noqa: E402
from bigbatch.engine.accumulate import AccumulationEngine  # noqa: E402
from bigbatch.engine.batch import MicroBatch  # noqa: E402
from bigbatch.engine.muon import MuonSettings, build_muon  # noqa: E402
from bigbatch.engine.muon_matrices import muon_parameters  # noqa: E402
from bigbatch.engine.optim import constant_schedule  # noqa: E402
from bigbatch.models import GPT, GPTConfig  # noqa: E402

GOAL = 1e-5
MUON_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> float:
    """||a - b|| / ||b|| over the named tensors flattened together (float64 arithmetic)."""
    num = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in names)
    den = sum(float(b[n].double().pow(2).sum()) for n in names)
    return (num / den) ** 0.5


def rel_change(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor], names: list[str]
) -> float:
    """||a - b|| / ||b - start||: the difference as a share of what the steps moved (a harder measure)."""
    num = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in names)
    den = sum(float((b[n].double() - start[n].double()).pow(2).sum()) for n in names)
    return (num / den) ** 0.5


# ---- through `bigbatch train` -----------------------------------------------------------------------------


def bigbatch(*args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "bigbatch"), *args], capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"bigbatch {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def trained(run: Path) -> dict[str, torch.Tensor]:
    from bigbatch.run.checkpoints.checkpoint import load_checkpoint, resolve_checkpoint

    state = load_checkpoint(resolve_checkpoint(run))["model"]
    return {k: v.float() for k, v in state.items() if v.is_floating_point()}


def through_train(root: Path, corpus: Path) -> list[tuple[str, float, float, float]]:
    common = [
        *("train", "--model", "pico", "--data", str(corpus), "--tokenizer", "byte", "--optimizer", "muon"),
        *("--seq-len", "32", "--total-batch-tokens", "256", "--max-steps", "3", "--eval-every", "0"),
        *("--sample-tokens", "0", "--lr", "1e-2", "--warmup-steps", "0", "--shuffle", "off", "--precision", "fp32"),
        *("--noise-scale-every", "0", "--cache-dir", str(root / "cache")),
    ]
    arms = {
        "8 x K 1": ["--micro-batch", "8"],
        "1 x K 8": ["--micro-batch", "1"],
        "2 DDP processes x 4 x K 1": ["--micro-batch", "4", "--nproc", "2", "--parallel", "ddp"],
        "2 FSDP2 processes x 4 x K 1": ["--micro-batch", "4", "--nproc", "2", "--parallel", "fsdp"],
    }
    print("bigbatch train --optimizer muon, pico, fp32, 3 steps of 8 x 32 tokens, lr 1e-2: relative L2 of the final")
    print(f"parameters against 8 x K 1 (goal <= {GOAL:g})")
    print(f"  {'run':<28} {'Muon matrices':>13} {'whole model':>12} {'seconds':>8}")
    reference: dict[str, torch.Tensor] | None = None
    rows = []
    for label, extra in arms.items():
        out = root / "runs" / label.replace(" ", "")
        seconds = bigbatch(*common, *extra, "--out", str(out))
        params = trained(out)
        matrices = sorted(n for n in params if n.endswith(MUON_SUFFIXES) and ".h." in n)
        if reference is None:
            reference = params
            print(f"  {label:<28} {'reference':>13} {'reference':>12} {seconds:>8.1f}  ({len(matrices)} Muon matrices)")
            continue
        a, w = rel_l2(params, reference, matrices), rel_l2(params, reference, sorted(reference))
        rows.append((label, a, w, seconds))
        print(f"  {label:<28} {a:>13.2e} {w:>12.2e} {seconds:>8.1f}", flush=True)
    return rows


# ---- the engine in float64 ----------------------------------------------------------------------------------


class Counter:
    """``orthogonalise`` counted: the module's name is replaced, which the optimizer looks up at each call."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = muon_module.orthogonalise

    def __enter__(self) -> Counter:
        def counting(*args: object, **kwargs: object) -> torch.Tensor:
            self.calls += 1
            return self.original(*args, **kwargs)

        muon_module.orthogonalise = counting
        return self

    def __exit__(self, *exc: object) -> None:
        muon_module.orthogonalise = self.original


def float64_loss(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Summed cross-entropy of the whole logits, in the model's dtype (float64 here): no float32 head."""
    logits = model(batch.inputs)
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100, reduction="sum")


def engine_runs(
    base: GPT, k: int, steps: int, counter: Counter, loss: str
) -> tuple[dict[str, torch.Tensor], list[int]]:
    model = copy.deepcopy(base)
    optimizer = build_muon(model, MuonSettings(lr=1e-2), lr=1e-2)
    engine = AccumulationEngine(
        model, optimizer, constant_schedule(1e-2), grad_clip=1.0, loss_fn=float64_loss if loss == "float64" else None
    )
    calls = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        rows = torch.randint(0, base.config.vocab_size, (8, 17), generator=gen)
        batches = [MicroBatch(x, y) for x, y in zip(rows[:, :-1].chunk(k), rows[:, 1:].chunk(k), strict=True)]
        before = counter.calls
        engine.step(batches)
        calls.append(counter.calls - before)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, calls


def through_engine(steps: int = 3) -> tuple[list[tuple[str, int, float, float, float]], bool]:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        base = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=61))
        start = {n: p.detach().clone() for n, p in base.named_parameters()}
        ids = {id(p) for _, p in muon_parameters(base)}
        matrices = [n for n, p in base.named_parameters() if id(p) in ids]
        everything = list(start)
        print(
            f"the engine in float64: GPT 2 layers x 32, vocab 61, {steps} steps of 8 random rows of 16, Muon lr 1e-2 "
            "(AdamW lr 1e-2), clip 1.0; K against K = 1"
        )
        print(
            f"  {'loss':<32} {'K':>2} {'Muon rel L2':>11} {'model rel L2':>12} {'model / change':>14} {'NS calls/step':>14}"
        )
        rows, counts_ok = [], True
        for loss, label in (("float64", "float64 cross-entropy"), ("library", "library's (float32 head)")):
            with Counter() as counter:
                reference, calls = engine_runs(base, 1, steps, counter, loss)
                results = {1: (reference, calls)}
                for k in (2, 8):
                    results[k] = engine_runs(base, k, steps, counter, loss)
            for k, (params, calls) in results.items():
                counts_ok &= all(c == len(matrices) for c in calls)
                shown = ",".join(map(str, calls))
                if k == 1:
                    print(f"  {label:<32} {k:>2} {'reference':>11} {'reference':>12} {'':>14} {shown:>14}")
                    continue
                a = rel_l2(params, reference, matrices)
                w = rel_l2(params, reference, everything)
                c = rel_change(params, reference, start, everything)
                rows.append((label, k, a, w, c))
                print(f"  {label:<32} {k:>2} {a:>11.2e} {w:>12.2e} {c:>14.2e} {shown:>14}", flush=True)
        print(
            f"  Newton-Schulz calls per step: {len(matrices)} Muon matrices; every step at K = 1, 2, 8: "
            + ("equal (once per matrix and step)" if counts_ok else "DIFFER")
        )
        return rows, counts_ok
    finally:
        torch.set_default_dtype(torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the engine parts only (no `bigbatch train` runs)")
    parser.add_argument("--corpus", help="raw text (default: tiny Shakespeare beside the checkout, else its stand-in)")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    summary = []
    with tempfile.TemporaryDirectory(prefix="bigbatch-muon-exact-") as tmp:
        root = Path(tmp)
        if not args.quick:
            corpus, line, _ = bench_corpus(args.corpus, root)
            print(line)
            rows = through_train(root, corpus)
            worst = max(max(a, w) for _, a, w, _ in rows)
            summary.append(
                f"bigbatch train --optimizer muon: worst relative L2 against 8 x K 1 {worst:.2e} "
                f"(goal <= {GOAL:g}: {'met' if worst <= GOAL else 'NOT met'})"
            )
        rows64, counts_ok = through_engine()
        exact = max(w for label, _, _, w, _ in rows64 if label.startswith("float64"))
        library = max(w for label, _, _, w, _ in rows64 if label.startswith("library"))
        summary.append(
            f"float64 engine: worst whole-model relative L2 {exact:.2e} with a float64 loss, {library:.2e} with the "
            "library's float32 head"
        )
        summary.append(f"Newton-Schulz once per Muon matrix and step at every K: {'yes' if counts_ok else 'NO'}")
    print("summary")
    for line in summary:
        print(f"  {line}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
