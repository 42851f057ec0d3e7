"""Learning per step: bigbatch's validation loss against the minimal reference's, on the same validation windows.

    OMP_NUM_THREADS=1 python benchmarks/val_vs_reference.py [--steps 2000] [--eval-every 250] [--seeds 1337]
        [--data PATH] [--plot docs/val-vs-reference.png]

The setting of issue 14: the nano shape (4 layers, 4 heads, 128 wide), T=64, B=12, K=1, tiny Shakespeare with
the byte tokenizer and bigbatch's 10% validation split, 2,000 steps, bigbatch's default optimizer settings
(AdamW lr 2e-3, betas (0.9, 0.95), weight decay 0.1, 20 warmup steps, cosine to 10% at the last step, clip 1.0).
Four runs per seed (``--runs`` picks some):

* bigbatch ``--shuffle on`` (the default): the ``bigbatch train`` path (:class:`~bigbatch.run.loop.trainer.Trainer`);
* bigbatch ``--shuffle off``: the same, windows in the order of the data;
* the reference (``benchmarks/reference_gpt.py``, a minimal GPT-2 and the plainest loop) with windows at
  random offsets, the way the minimal scripts sample them, seeded with the same seed (``reference``);
* the same reference starting from bigbatch's initial weights for that seed (``reference same init``): with
  the weights shared, a seed's two runs differ only in their windows, so their difference is paired. The
  verdict uses it where present.

Every evaluation of every run scores the same windows: all the ``T``-token windows of the validation split
(tiny Shakespeare's 111,540 validation tokens are below bigbatch's 131,072-token default, so bigbatch's own
evaluation reads the whole split; the reference is given the same windows). The script prints the validation
loss of each run at each evaluation, the difference bigbatch minus reference at 500, 1,000 and 2,000 steps with
its standard error, the verdict on the goal (no higher after the last step) with its 95% interval, and writes a
plot of the curves and the difference (and their numbers, per seed, as JSON beside it). Runs in parallel
processes, one per run and seed range, are combined with ``--merge A.json B.json ...``.

``--data`` (or ``--corpus``) defaults to tiny Shakespeare beside the checkout (``../shared/data``). Without it,
the script trains on the tests' generated English-like text of the same size, says so, and writes the plot only
where ``--plot`` says: docs/benchmarks.md's numbers and docs/val-vs-reference.png are tiny Shakespeare's.
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

from bigbatch.data.cache import ensure_prepared
from bigbatch.data.dataset import open_dataset
from bigbatch.data.validation_windows import validation_windows
from bigbatch.data.windows import TokenStreamWindows
from bigbatch.models import preset
from bigbatch.observe.metrics import read_records
from bigbatch.run.configuration.train_config import TrainConfig
from bigbatch.run.loop.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import bench_corpus, cpu_run_config  # noqa: E402
from reference_gpt import ReferenceGPT, train_reference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS_PLOT = ROOT / "docs" / "val-vs-reference.png"
B, T, PRESET = 12, 64, "nano"
MARKS = (500, 1000, 2000)
RUN_NAMES = {
    "shuffle on": "bigbatch, shuffle on",
    "shuffle off": "bigbatch, shuffle off",
    "reference": "reference, random windows",
    "reference same init": "reference, bigbatch's initial weights",
}
Curves = dict[str, dict[int, dict[int, float]]]
"""Run -> step -> seed -> validation loss."""


def bigbatch_config(
    data: str, cache: Path, out: Path, steps: int, eval_every: int, seed: int, shuffle: str
) -> TrainConfig:
    config = cpu_run_config(data, out, B, T, 1, steps)
    config.model.preset = PRESET
    config.data.cache_dir, config.data.shuffle = str(cache), shuffle
    config.run.eval_every, config.run.seed = eval_every, seed
    config.run.noise_scale_every, config.run.compile = 0, "off"
    return config


def bigbatch_run(
    data: str, cache: Path, out: Path, steps: int, eval_every: int, seed: int, shuffle: str
) -> dict[int, float]:
    """Validation loss by step of ``bigbatch train`` (the Trainer) with ``--shuffle shuffle``."""
    Trainer(bigbatch_config(data, cache, out, steps, eval_every, seed, shuffle)).train()
    records = read_records(out)
    return {int(r["step"]): float(r["val_loss"]) for r in records if r["kind"] == "eval"}


def reference_run(
    train_tokens: np.ndarray,
    windows: list[tuple[torch.Tensor, torch.Tensor]],
    vocab: int,
    steps: int,
    eval_every: int,
    seed: int,
    initial: dict[str, torch.Tensor] | None = None,
) -> dict[int, float]:
    """Validation loss by step of the reference with windows at random offsets, from its own initial weights
    drawn with ``seed`` or from ``initial``."""
    shape = preset(PRESET, vocab_size=vocab)
    torch.manual_seed(seed)
    model = ReferenceGPT(vocab, shape.n_layer, shape.n_head, shape.n_embd, shape.block_size)
    if initial is not None:
        model.load_state_dict(initial)
    result = train_reference(
        model,
        train_tokens,
        steps=steps,
        micro_batch=B,
        seq_len=T,
        order="random",
        seed=seed,
        val_windows=windows,
        eval_every=eval_every,
    )
    return dict(result.val_losses)


def plot(curves: Curves, path: Path, title: str) -> None:
    """Left: each run's mean validation loss over seeds, its standard error shaded. Right: each bigbatch run
    minus the reference (paired where it can be), with the 95% interval of that difference (the goal: at or
    below zero)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    colors: dict[str, str] = {}
    for name, by_step in curves.items():
        steps = sorted(by_step)
        means = [statistics.fmean(by_step[s].values()) for s in steps]
        seeds = min(len(by_step[s]) for s in steps)
        label = name if "seed" in name else f"{name} ({seeds} seed{'s' * (seeds > 1)})"
        (line,) = ax.plot(steps, means, marker="o", markersize=3, label=label)
        colors[name] = line.get_color()
        if seeds > 1:  # the standard error of each mean, shaded
            se = [statistics.stdev(by_step[s].values()) / math.sqrt(len(by_step[s])) for s in steps]
            ax.fill_between(
                steps,
                [m - e for m, e in zip(means, se, strict=True)],
                [m + e for m, e in zip(means, se, strict=True)],
                color=line.get_color(),
                alpha=0.2,
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for name in curves:
        against = None if name.startswith("reference") else gaps_against(curves, name)
        if against is None:
            continue
        reference, gaps = against
        steps = sorted(gaps)
        diff.plot(
            steps,
            [gaps[s].mean for s in steps],
            marker="o",
            markersize=3,
            color=colors[name],
            label=f"{name} minus {reference}",
        )
        diff.fill_between(
            steps,
            [gaps[s].mean - 1.96 * gaps[s].se for s in steps],
            [gaps[s].mean + 1.96 * gaps[s].se for s in steps],
            color=colors[name],
            alpha=0.15,
        )
    diff.axhline(0.0, color="black", lw=1)
    diff.set_xlabel("optimizer step")
    diff.set_ylabel("difference in validation loss (nats)")
    diff.set_title("bigbatch minus the reference (95% interval shaded)", fontsize=9)
    diff.grid(alpha=0.3)
    if diff.get_legend_handles_labels()[0]:  # a difference needs two seeds of a run and the reference
        diff.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337])
    parser.add_argument(
        "--data", "--corpus", help="the text to train on (default: tiny Shakespeare beside the checkout)"
    )
    parser.add_argument(
        "--plot", type=Path, help=f"default: {DOCS_PLOT.relative_to(ROOT)}, unless the corpus is generated"
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["shuffle on", "shuffle off", "reference", "reference same init"],
        choices=list(RUN_NAMES),
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        help="train nothing: combine the JSON files of earlier invocations (e.g. one per run, run "
        "in parallel) into one table and plot",
    )
    args = parser.parse_args()
    args.corpus_name = "tiny Shakespeare"
    if args.merge:
        args.plot = args.plot or DOCS_PLOT
        curves: Curves = {}
        for path in args.merge:
            for name, by_step in read_curves(path).items():
                for step, by_seed in by_step.items():
                    curves.setdefault(name, {}).setdefault(step, {}).update(by_seed)
        return report(curves, args)
    logging.basicConfig(level=logging.WARNING)
    if args.data is not None and not Path(args.data).is_file():
        print(f"{args.data} not found; give --data (tiny Shakespeare)", file=sys.stderr)
        return 2

    curves = {RUN_NAMES[r]: {} for r in args.runs}
    with tempfile.TemporaryDirectory(prefix="val-vs-ref-") as tmp:
        work = Path(tmp)
        corpus, corpus_line, generated = bench_corpus(args.data, work)
        print(corpus_line, flush=True)
        if generated:
            args.corpus_name = "generated text"
        elif args.data is not None:
            args.corpus_name = Path(args.data).name
        if args.plot is None and not generated:
            args.plot = DOCS_PLOT
        data = str(corpus)
        dataset = open_dataset(ensure_prepared(data, "byte", 0.1, work / "cache"))
        val = validation_windows(dataset, "val", B, T, eval_batches=0, whole=True)
        assert val.whole
        windows = TokenStreamWindows(dataset.shard_arrays("val"), T)
        reference_windows = []
        for start in range(0, windows.count, B):  # the same windows bigbatch's evaluation reads
            batch = windows.read(list(range(start, min(start + B, windows.count))))
            keep = batch.targets[:, 0] >= 0
            reference_windows.append((batch.inputs[keep], batch.targets[keep]))
        train_tokens = np.concatenate([np.asarray(s) for s in dataset.shard_arrays("train")])
        print(
            f"data: {dataset.meta.tokens['train']:,} train tokens, validation {val.describe()} "
            f"({val.windows * T:,} tokens), every evaluation of every run"
        )
        for seed in args.seeds:
            for run in args.runs:
                started = time.perf_counter()
                if run.startswith("reference"):
                    initial = None
                    if run == "reference same init":  # bigbatch's initial weights for this seed, untrained
                        init_config = bigbatch_config(
                            data, work / "cache", work / f"init-{seed}", args.steps, args.eval_every, seed, "on"
                        )
                        initial = Trainer(init_config).model.state_dict()
                    losses = reference_run(
                        train_tokens, reference_windows, dataset.vocab_size, args.steps, args.eval_every, seed, initial
                    )
                else:
                    out = work / f"{run.replace(' ', '-')}-{seed}"
                    losses = bigbatch_run(data, work / "cache", out, args.steps, args.eval_every, seed, run.split()[1])
                for step, loss in losses.items():
                    curves[RUN_NAMES[run]].setdefault(step, {})[seed] = loss
                shown = " ".join(f"{s}:{losses[s]:.4f}" for s in sorted(losses))
                print(
                    f"seed {seed} | {RUN_NAMES[run]:26s} | {time.perf_counter() - started:6.0f}s | {shown}", flush=True
                )

    return report(curves, args)


def read_curves(path: Path) -> Curves:
    """A JSON file this script wrote: ``{run: {step: {seed: loss}}}``, or the earlier form (a list per step, in
    the order of the file's ``seeds``)."""
    saved = json.loads(path.read_text())
    curves: Curves = {}
    for name, by_step in saved["val_loss"].items():
        for step, values in by_step.items():
            pairs = values.items() if isinstance(values, dict) else zip(saved["seeds"], values, strict=False)
            curves.setdefault(name, {})[int(step)] = {int(seed): float(v) for seed, v in pairs}
    return curves


@dataclass(frozen=True)
class Gap:
    """Mean of ours minus the reference's over seeds: paired (the same seed on both sides: the same initial
    weights, so only the windows differ) or over independent seeds."""

    mean: float
    se: float  # its standard error (paired: of the per-seed differences; else Welch's)
    seeds: int
    paired: bool


def gap(ours: dict[int, float], reference: dict[int, float], paired: bool) -> Gap:
    if paired:
        diffs = [ours[seed] - reference[seed] for seed in sorted(set(ours) & set(reference))]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
        return Gap(statistics.fmean(diffs) if diffs else math.nan, se, len(diffs), True)

    def var(values: list[float]) -> float:
        return statistics.variance(values) if len(values) > 1 else math.nan

    a, b = list(ours.values()), list(reference.values())
    se = math.sqrt(var(a) / len(a) + var(b) / len(b))
    return Gap(statistics.fmean(a) - statistics.fmean(b), se, min(len(a), len(b)), False)


def gaps_against(curves: Curves, name: str) -> tuple[str, dict[int, Gap]] | None:
    """``name`` minus the reference at each step: paired with the reference from bigbatch's initial weights
    where both have at least two common seeds, else against the reference's own initial weights."""
    for reference, paired in ((RUN_NAMES["reference same init"], True), (RUN_NAMES["reference"], False)):
        ref = curves.get(reference, {})
        steps = [s for s in sorted(curves[name]) if s in ref]
        gaps = {s: gap(curves[name][s], ref[s], paired) for s in steps}
        if gaps and all(g.seeds > 1 for g in gaps.values()):
            return reference, gaps
    return None


def describe(g: Gap) -> str:
    how = "paired" if g.paired else "independent"
    return f"{g.mean:+.4f} (SE {g.se:.4f}, {g.seeds} {how} seeds)"


def report(curves: Curves, args: argparse.Namespace) -> int:
    """The table, the differences against the reference, the goal, the plot and its numbers as JSON."""
    print("\nvalidation loss (mean over seeds), same windows for every run:")
    marks = [m for m in MARKS if m <= args.steps] or [args.steps]
    print(f"{'run':40s}" + "".join(f"{m:>10d}" for m in marks) + "   seeds")
    for name, by_step in curves.items():
        seeds = sorted(set().union(*(set(v) for v in by_step.values())))
        print(
            f"{name:40s}"
            + "".join(
                f"{statistics.fmean(by_step[m].values()):10.4f}" if m in by_step else f"{'-':>10s}" for m in marks
            )
            + f"   {len(seeds)}"
        )
    for name in curves:
        if name.startswith("reference"):
            continue
        for reference, paired in ((RUN_NAMES["reference same init"], True), (RUN_NAMES["reference"], False)):
            if reference in curves:
                shown = [
                    describe(gap(curves[name][m], curves[reference][m], paired))
                    for m in marks
                    if m in curves[name] and m in curves[reference]
                ]
                print(f"{name} minus {reference}: " + ", ".join(shown) + f" at {', '.join(map(str, marks))} steps")
    ours = RUN_NAMES["shuffle on"]
    against = gaps_against(curves, ours) if ours in curves else None
    if against is not None:
        reference, gaps = against
        final = max(gaps)
        g = gaps[final]
        low, high = g.mean - 1.96 * g.se, g.mean + 1.96 * g.se
        verdict = "met" if g.mean <= 0 else "a tie: the 95% interval holds 0" if low <= 0 else "not met"
        print(
            f"goal: {ours} no higher than the {reference} after {final} steps: {verdict} ({g.mean:+.4f} nats, "
            f"95% interval [{low:+.4f}, {high:+.4f}], {g.seeds} {'paired' if g.paired else 'independent'} "
            "seeds)"
        )
    if args.plot is None:
        print(
            f"plot: none written ({args.corpus_name} is not the corpus of {DOCS_PLOT.relative_to(ROOT)}; give --plot)"
        )
        return 0
    windows = " (1,742 windows)" if args.corpus_name == "tiny Shakespeare" else ""
    title = (
        f"nano (4x4x128), T={T}, B={B}, K=1, {args.corpus_name} (byte)\nvalidation loss on the whole "
        f"validation split{windows}\nmean over seeds, shaded: its standard error"
    )
    plot(curves, args.plot, title)
    numbers = {
        name: {
            str(step): {str(seed): v for seed, v in sorted(by_seed.items())}
            for step, by_seed in sorted(by_step.items())
        }
        for name, by_step in curves.items()
    }
    args.plot.with_suffix(".json").write_text(json.dumps({"val_loss": numbers}, indent=1) + "\n")
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
