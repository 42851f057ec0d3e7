"""Learning per step: bigbatch's validation loss against the minimal reference's, on the same validation windows.

    OMP_NUM_THREADS=1 python benchmarks/val_vs_reference.py [--steps 2000] [--eval-every 250] [--seeds 1337]
        [--plot docs/val-vs-reference.png]

The setting of issue 14: the nano shape (4 layers, 4 heads, 128 wide), T=64, B=12, K=1, tiny Shakespeare with
the byte tokenizer and bigbatch's 10% validation split, 2,000 steps, bigbatch's default optimizer settings
(AdamW lr 2e-3, betas (0.9, 0.95), weight decay 0.1, 20 warmup steps, cosine to 10% at the last step, clip 1.0).
Three runs per seed:

* bigbatch ``--shuffle on`` (the default): the ``bigbatch train`` path (:class:`~bigbatch.trainer.Trainer`);
* bigbatch ``--shuffle off``: the same, windows in the order of the data;
* the reference (``benchmarks/reference_gpt.py``, a minimal GPT-2 and the plainest loop) with windows at
  random offsets, the way the minimal scripts sample them, seeded with the same seed.

Every evaluation of every run scores the same windows: all the ``T``-token windows of the validation split
(tiny Shakespeare's 111,540 validation tokens are below bigbatch's 131,072-token default, so bigbatch's own
evaluation reads the whole split; the reference is given the same windows). The script prints the validation
loss of each run at each evaluation, the difference bigbatch minus reference at 500, 1,000 and 2,000 steps,
and writes a plot of the curves (and their numbers as JSON beside it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bigbatch.config import TrainConfig
from bigbatch.data.cache import ensure_prepared
from bigbatch.data.dataset import open_dataset
from bigbatch.data.validation import validation_windows
from bigbatch.data.windows import PackedWindows
from bigbatch.model import preset
from bigbatch.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_gpt import ReferenceGPT, train_reference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
B, T, PRESET = 12, 64, "nano"
MARKS = (500, 1000, 2000)


def bigbatch_run(data: str, cache: Path, out: Path, steps: int, eval_every: int, seed: int, shuffle: str) -> dict[int, float]:
    """Validation loss by step of ``bigbatch train`` (the Trainer) with ``--shuffle shuffle``."""
    config = TrainConfig()
    config.model.preset = PRESET
    config.data.data, config.data.cache_dir, config.data.shuffle = data, str(cache), shuffle
    config.batch.micro_batch, config.batch.seq_len, config.batch.total_batch_tokens = B, T, B * T
    config.run.max_steps, config.run.eval_every, config.run.seed = steps, eval_every, seed
    config.run.out, config.run.device = str(out), "cpu"
    config.run.sample_tokens, config.run.noise_scale_every, config.run.compile = 0, 0, "off"
    Trainer(config).train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r["val_loss"]) for r in records if r["kind"] == "eval"}


def reference_run(
    train_tokens: np.ndarray, windows: list[tuple[torch.Tensor, torch.Tensor]], vocab: int, steps: int,
    eval_every: int, seed: int,
) -> dict[int, float]:
    shape = preset(PRESET, vocab_size=vocab)
    torch.manual_seed(seed)
    model = ReferenceGPT(vocab, shape.n_layer, shape.n_head, shape.n_embd, shape.block_size)
    result = train_reference(
        model, train_tokens, steps=steps, micro_batch=B, seq_len=T, order="random", seed=seed,
        val_windows=windows, eval_every=eval_every,
    )  # fmt: skip
    return dict(result.val_losses)


def plot(curves: dict[str, dict[int, list[float]]], path: Path, title: str) -> None:
    """Left: each run's mean validation loss over seeds, its standard error shaded. Right: each bigbatch run
    minus the reference, with the 95% interval of that difference (the goal: at or below zero)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    colors: dict[str, str] = {}
    for name, by_step in curves.items():
        steps = sorted(by_step)
        means = [statistics.fmean(by_step[s]) for s in steps]
        seeds = min(len(by_step[s]) for s in steps)
        label = name if "seed" in name else f"{name} ({seeds} seed{'s' * (seeds > 1)})"
        (line,) = ax.plot(steps, means, marker="o", markersize=3, label=label)
        colors[name] = line.get_color()
        if seeds > 1:  # the standard error of each mean, shaded
            se = [statistics.stdev(by_step[s]) / math.sqrt(len(by_step[s])) for s in steps]
            ax.fill_between(steps, [m - e for m, e in zip(means, se, strict=True)],
                            [m + e for m, e in zip(means, se, strict=True)], color=line.get_color(), alpha=0.2)  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    reference = curves.get("reference, random windows", {})
    for name, by_step in curves.items():
        steps = [s for s in sorted(by_step) if s in reference]
        gaps = [gap(by_step[s], reference[s]) for s in steps]
        if name.startswith("reference") or not steps or not all(math.isfinite(g.se) for g in gaps):
            continue  # the difference is shown for runs with several seeds
        means = [g.mean for g in gaps]
        diff.plot(steps, means, marker="o", markersize=3, color=colors[name], label=f"{name} minus reference")
        diff.fill_between(steps, [g.mean - 1.96 * g.se for g in gaps], [g.mean + 1.96 * g.se for g in gaps],
                          color=colors[name], alpha=0.2, label="95% interval")  # fmt: skip
    diff.axhline(0.0, color="black", lw=1)
    diff.set_xlabel("optimizer step")
    diff.set_ylabel("difference in validation loss (nats)")
    diff.set_title("bigbatch minus the reference (below 0: bigbatch lower)", fontsize=9)
    diff.grid(alpha=0.3)
    diff.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337])
    parser.add_argument("--data", default=str(SHAKESPEARE))
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "val-vs-reference.png")
    parser.add_argument("--runs", nargs="+", default=["shuffle on", "shuffle off", "reference"],
                        choices=["shuffle on", "shuffle off", "reference"])  # fmt: skip
    parser.add_argument("--merge", type=Path, nargs="+", default=[],
                        help="train nothing: combine the JSON files of earlier invocations (e.g. one per run, run "
                        "in parallel) into one table and plot")  # fmt: skip
    args = parser.parse_args()
    if args.merge:
        curves, seeds = {}, set()
        for path in args.merge:
            saved = json.loads(path.read_text())
            seeds.update(saved["seeds"])
            for name, by_step in saved["val_loss"].items():
                for step, values in by_step.items():
                    curves.setdefault(name, {}).setdefault(int(step), []).extend(values)
        args.seeds = sorted(seeds)
        return report(curves, args)
    logging.basicConfig(level=logging.WARNING)
    if not Path(args.data).is_file():
        print(f"{args.data} not found; give --data (tiny Shakespeare)", file=sys.stderr)
        return 2

    names = {"shuffle on": "bigbatch, shuffle on", "shuffle off": "bigbatch, shuffle off",
             "reference": "reference, random windows"}  # fmt: skip
    curves: dict[str, dict[int, list[float]]] = {names[r]: {} for r in args.runs}
    with tempfile.TemporaryDirectory(prefix="val-vs-ref-") as tmp:
        work = Path(tmp)
        dataset = open_dataset(ensure_prepared(args.data, "byte", 0.1, work / "cache"))
        val = validation_windows(dataset, "val", B, T, eval_batches=0, whole=True)
        assert val.whole
        windows = PackedWindows(dataset.shard_arrays("val"), T)
        reference_windows = []
        for start in range(0, windows.count, B):  # the same windows bigbatch's evaluation reads
            batch = windows.read(list(range(start, min(start + B, windows.count))))
            keep = batch.targets[:, 0] >= 0
            reference_windows.append((batch.inputs[keep], batch.targets[keep]))
        train_tokens = np.concatenate([np.asarray(s) for s in dataset.shard_arrays("train")])
        print(f"data: {dataset.meta.tokens['train']:,} train tokens, validation {val.describe()} "
              f"({val.windows * T:,} tokens), every evaluation of every run")  # fmt: skip
        for seed in args.seeds:
            for run in args.runs:
                started = time.perf_counter()
                if run == "reference":
                    losses = reference_run(train_tokens, reference_windows, dataset.vocab_size, args.steps,
                                           args.eval_every, seed)  # fmt: skip
                else:
                    out = work / f"{run.replace(' ', '-')}-{seed}"
                    losses = bigbatch_run(args.data, work / "cache", out, args.steps, args.eval_every, seed,
                                          run.split()[1])  # fmt: skip
                for step, loss in losses.items():
                    curves[names[run]].setdefault(step, []).append(loss)
                shown = " ".join(f"{s}:{losses[s]:.4f}" for s in sorted(losses))
                print(f"seed {seed} | {names[run]:26s} | {time.perf_counter() - started:6.0f}s | {shown}", flush=True)

    return report(curves, args)


@dataclass(frozen=True)
class Gap:
    """Mean of ours minus mean of the reference, over independent seeds."""

    mean: float
    se: float  # standard error of that difference (Welch: each side's variance over its seeds)
    spread: float  # the pooled seed-to-seed standard deviation of one run


def gap(ours: list[float], reference: list[float]) -> Gap:
    def var(values: list[float]) -> float:
        return statistics.variance(values) if len(values) > 1 else math.nan

    se = math.sqrt(var(ours) / len(ours) + var(reference) / len(reference))
    spread = math.sqrt((var(ours) + var(reference)) / 2)
    return Gap(statistics.fmean(ours) - statistics.fmean(reference), se, spread)


def report(curves: dict[str, dict[int, list[float]]], args: argparse.Namespace) -> int:
    """The table, the differences against the reference, the goal, the plot and its numbers as JSON."""
    names = {"reference": "reference, random windows", "shuffle on": "bigbatch, shuffle on"}
    print("\nvalidation loss (mean over seeds), same windows for every run:")
    marks = [m for m in MARKS if m <= args.steps] or [args.steps]
    print(f"{'run':28s}" + "".join(f"{m:>10d}" for m in marks))
    for name, by_step in curves.items():
        print(f"{name:28s}" + "".join(f"{statistics.fmean(by_step[m]):10.4f}" if m in by_step else f"{'-':>10s}"
                                      for m in marks))  # fmt: skip
    reference = curves.get(names["reference"])
    if reference:
        for name, by_step in curves.items():
            if name != names["reference"]:
                gaps = [gap(by_step[m], reference[m]) for m in marks if m in by_step and m in reference]
                print(f"{name} minus reference: " + ", ".join(f"{g.mean:+.4f} ({f'SE {g.se:.4f}' if math.isfinite(g.se) else 'one seed'})" for g in gaps)
                      + f" at {', '.join(str(m) for m in marks)} steps")  # fmt: skip
        final = max(reference)
        ours = curves.get(names["shuffle on"], {})
        if final in ours:
            g = gap(ours[final], reference[final])
            low, high = g.mean - 1.96 * g.se, g.mean + 1.96 * g.se
            verdict = ("met" if g.mean <= 0 else "a tie: the 95% interval holds 0" if low <= 0 else "not met")
            print(f"goal: bigbatch (shuffle on) no higher than the reference after {final} steps: {verdict} "
                  f"({g.mean:+.4f} nats, 95% interval [{low:+.4f}, {high:+.4f}], {len(ours[final])} and "
                  f"{len(reference[final])} seeds; seed-to-seed spread {g.spread:.4f} nats)")  # fmt: skip
    title = (f"nano (4x4x128), T={T}, B={B}, K=1, tiny Shakespeare (byte)\nvalidation loss on the whole "
             f"validation split (1,742 windows)\nmean over seeds, shaded: its standard error")  # fmt: skip
    plot(curves, args.plot, title)
    numbers = {name: {str(s): v for s, v in sorted(by_step.items())} for name, by_step in curves.items()}  # lists
    args.plot.with_suffix(".json").write_text(json.dumps({"seeds": args.seeds, "val_loss": numbers}, indent=1) + "\n")
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
