"""``bigbatch train --optimizer muon`` against a reference Muon in the plainest loop, side by side, on CPU.

    python benchmarks/muon_vs_reference.py              # 3 seeds x 300 steps, about 4.5 CPU-minutes on one thread (11 min wall when shared)
    python benchmarks/muon_vs_reference.py --seeds 1    # one seed
    python benchmarks/muon_vs_reference.py --quick      # 1 seed x 40 steps: a smoke check (under a minute)

The nanoGPT CPU recipe's shape: nano (4 layers, 4 heads, 128 wide) on tiny Shakespeare (or its generated
stand-in, said so) with the byte tokenizer, T=64, B=12, K=1 (768 tokens a step), bigbatch's defaults otherwise
(lr 2e-3 with 20 warmup steps and cosine to 0.1x, weight decay 0.1, clip 1.0). bigbatch: ``--optimizer muon``
at its defaults (Muon lr = --lr, momentum 0.95, 5 quintic Newton-Schulz iterations, update x 0.2 sqrt(max(m, n)),
Muon weight decay 0.1). The reference (benchmarks/reference_muon.py, written from Jordan's description, importing
nothing from bigbatch): the same settings, in reference_gpt.py's model and loop.

Per seed (the Trainer's initial weights, copied into the reference), the two read the same windows in the same
order (bigbatch with ``--shuffle off``; the reference sequentially) one after the other, which goes first swapping
every seed. Reported: the training loss of each at a few steps and their difference (the same computation up to
rounding, which Newton-Schulz and training amplify over the steps), the largest parameter difference at the end,
and tokens/s (wall clock and this process's CPU time, from the end of step 1 to the end of the last) of each and
bigbatch / reference (goal >= 1.0). The Trainer runs as ``bigbatch train`` does (metrics.jsonl, step lines logged,
the noise-scale meter at its default, a final checkpoint; no evaluation or sample: the reference has neither).
Timings on a shared machine are noisy: read the CPU-time ratio beside the wall-clock one.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import bench_corpus  # noqa: E402
from reference_gpt import ReferenceGPT  # noqa: E402
from reference_muon import train_reference_muon  # noqa: E402
from speed_vs_reference import make_config, now, rates, stamp  # noqa: E402

from bigbatch.data.cache import ensure_prepared  # noqa: E402
from bigbatch.data.shards import TokenDataset  # noqa: E402
from bigbatch.observe.metrics import read_records  # noqa: E402
from bigbatch.run.loop.trainer import Trainer  # noqa: E402

T, B, K = 64, 12, 1
GOAL = 1.0


def one_seed(
    dataset: Path, tokens: np.ndarray, out: Path, steps: int, seed: int, bigbatch_first: bool
) -> tuple[list[float], list[float], tuple[float, float], tuple[float, float], float]:
    """Per-step losses of bigbatch and of the reference, their (tokens/s, tokens/CPU-s), and the largest absolute
    parameter difference at the end."""
    config = make_config(dataset, out, T, B, K, steps)
    config.optim.optimizer = "muon"
    config.run.seed = seed
    trainer = Trainer(config)
    cfg = trainer.model_config
    reference = ReferenceGPT(cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size)
    reference.load_state_dict(trainer.model.state_dict())  # the same initial parameters
    ours_ends: list[tuple[float, float]] = []
    theirs_ends: list[tuple[float, float]] = []
    trainer.engine.step = stamp(trainer.engine.step, ours_ends)
    opt = trainer.config.optim
    theirs: list[float] = []

    def run_reference() -> None:
        result = train_reference_muon(
            reference,
            tokens,
            steps=steps,
            micro_batch=B,
            seq_len=T,
            accum=K,
            order="sequential",
            lr=opt.lr,
            muon_lr=opt.muon_lr or opt.lr,
            momentum=opt.muon_momentum,
            min_lr_ratio=opt.min_lr_ratio,
            warmup_steps=opt.warmup_steps,
            weight_decay=opt.weight_decay,
            muon_weight_decay=opt.muon_weight_decay,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            grad_clip=opt.grad_clip,
            on_step=lambda step, loss: theirs_ends.append(now()),
        )
        theirs.extend(result.losses)

    runs = [trainer.train, run_reference]
    for run in runs if bigbatch_first else reversed(runs):
        run()
    ours = [float(r["loss"]) for r in read_records(out) if r.get("kind") == "step"]
    a, b = trainer.model.state_dict(), reference.state_dict()
    diff = max(float((a[name] - b[name]).abs().max()) for name in b)
    tokens_per_step = B * T * K
    return ours, theirs, rates(ours_ends, tokens_per_step), rates(theirs_ends, tokens_per_step), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, help="seeds (default 3; --quick 1)")
    parser.add_argument("--steps", type=int, help="steps per run (default 300; --quick 40)")
    parser.add_argument("--quick", action="store_true", help="1 seed x 40 steps")
    parser.add_argument("--corpus", help="raw text (default: tiny Shakespeare beside the checkout, else its stand-in)")
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.quick else 3)
    steps = args.steps or (40 if args.quick else 300)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115  # step lines formatted, as the CLI does
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    started = time.perf_counter()
    at = sorted({s for s in (1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 1000, steps) if s <= steps})
    with tempfile.TemporaryDirectory(prefix="bigbatch-muon-ref-") as tmp:
        root = Path(tmp)
        corpus, line, _ = bench_corpus(args.corpus, root)
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; nano, byte tokenizer, T={T} B={B} K={K}, {steps} steps, "
            f"{seeds} seed(s); {line}"
        )
        dataset = ensure_prepared(str(corpus), "byte", 0.1, root / "cache")
        shards = TokenDataset(dataset).shard_arrays("train")
        if len(shards) != 1:
            raise SystemExit("expected one training shard (the reference reads one token array)")
        tokens = np.asarray(shards[0])
        diffs: dict[int, list[float]] = {s: [] for s in at}
        wall, cpu, param_diffs = [], [], []
        print("training loss, bigbatch (b) and reference (r), and b - r, at steps:")
        for seed in range(seeds):
            ours, theirs, rate_b, rate_r, pdiff = one_seed(
                dataset, tokens, root / f"run-{seed}", steps, seed, seed % 2 == 0
            )
            if len(ours) != steps or len(theirs) != steps:
                raise SystemExit(f"seed {seed}: {len(ours)} and {len(theirs)} steps logged, expected {steps}")
            cells = []
            for s in at:
                diffs[s].append(ours[s - 1] - theirs[s - 1])
                cells.append(f"{s}: b {ours[s - 1]:.4f} r {theirs[s - 1]:.4f} ({diffs[s][-1]:+.1e})")
            mean_abs = statistics.fmean(abs(x - y) for x, y in zip(ours, theirs, strict=True))
            wall.append((rate_b[0], rate_r[0]))
            cpu.append((rate_b[1], rate_r[1]))
            param_diffs.append(pdiff)
            print(f"  seed {seed} ({'bigbatch' if seed % 2 == 0 else 'reference'} first)")
            for i in range(0, len(cells), 4):
                print("    " + " | ".join(cells[i : i + 4]))
            print(
                f"    mean |b - r| over all {steps} steps {mean_abs:.1e}; max |parameter difference| at the end {pdiff:.1e}"
            )
            print(
                f"    tokens/s      bigbatch {rate_b[0]:8,.0f}  reference {rate_r[0]:8,.0f}  ratio {rate_b[0] / rate_r[0]:.3f}\n"
                f"    tokens/CPU-s  bigbatch {rate_b[1]:8,.0f}  reference {rate_r[1]:8,.0f}  ratio {rate_b[1] / rate_r[1]:.3f}"
            )
        print("over seeds")
        print(f"  {'step':>5} {'mean b - r':>11} {'max |b - r|':>11}")
        for s in at:
            print(f"  {s:>5} {statistics.fmean(diffs[s]):>+11.1e} {max(abs(d) for d in diffs[s]):>11.1e}")
        w = statistics.median(b / r for b, r in wall)
        c = statistics.median(b / r for b, r in cpu)
        print(
            f"  tokens/s (median over seeds): bigbatch {statistics.median(b for b, _ in wall):,.0f}, reference "
            f"{statistics.median(r for _, r in wall):,.0f}; ratio bigbatch / reference {w:.3f} by the wall clock, "
            f"{c:.3f} by CPU time (goal >= {GOAL}: {'met' if w >= GOAL else 'NOT met'} by the wall clock, "
            f"{'met' if c >= GOAL else 'NOT met'} by CPU time; the machine is shared, so noisy)"
        )
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
