"""``bigbatch report``: plots and a text summary from one or more runs' ``metrics.jsonl``.

Every run becomes one line per plot, labelled with its name (``bigbatch train --name``) or else its directory's
name (see :func:`run_labels`), so runs at the same tokens per step with different K (or world sizes) can be laid
on top of each other: exact accumulation makes their curves coincide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigbatch.errors import BigBatchError
from bigbatch.files.atomic import write_text_atomically
from bigbatch.files.outputs import REPORT_MARKER, is_legacy_report, mark_own_dir, require_own_dir
from bigbatch.observe.noise_report import NOISE_PLOT, plot_noise_scale
from bigbatch.observe.runs import RunMetrics, read_metrics, run_labels

PLOTS = (
    "loss_vs_step.png",
    "loss_vs_tokens.png",
    "lr.png",
    "grad_norm.png",
    "tokens_per_s.png",
)
"""Files every report writes (``mfu.png`` as well when a run's records carry MFU, ``noise_scale.png`` when a run
measured the gradient noise scale)."""


@dataclass(frozen=True)
class RunSummary:
    label: str
    steps: int  # the last optimizer step reached
    tokens: int  # valid target tokens trained on (skipped steps excluded)
    final_loss: float | None
    best_val_loss: float | None
    best_val_step: int | None
    final_val_loss: float | None
    mean_tokens_per_s: float | None  # over applied steps after step 1 (step 1 includes warm-up)
    mean_mfu: float | None  # over the same steps, when the records carry "mfu"
    skipped: int

    def format(self) -> str:
        def number(value: float | None, spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        lines = [
            f"run {self.label}",
            f"  steps              {self.steps:,}",
            f"  tokens seen        {self.tokens:,}",
            f"  final train loss   {number(self.final_loss, '.4f')}",
        ]
        if self.best_val_loss is None:
            lines.append("  best val loss      n/a (no eval records)")
        else:
            lines.append(
                f"  best val loss      {self.best_val_loss:.4f} at step {self.best_val_step} "
                f"(perplexity {_perplexity(self.best_val_loss)})"
            )
            lines.append(f"  final val loss     {number(self.final_val_loss, '.4f')}")
        lines.append(f"  mean tokens/s      {number(self.mean_tokens_per_s, ',.0f')} (step 1, warm-up, left out)")
        if self.mean_mfu is not None:
            lines.append(f"  mean MFU           {self.mean_mfu:.1%}")
        lines.append(f"  skipped steps      {self.skipped}")
        return "\n".join(lines)


def _perplexity(loss: float) -> str:
    return f"{math.exp(loss):,.2f}" if loss < 700 else "inf"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(run: RunMetrics) -> RunSummary:
    trained = run.trained
    timed = [r for r in trained if int(r["step"]) > 1] or trained  # step 1 includes warm-up (and compilation)
    evals = [r for r in run.evals if _finite(r["val_loss"])]
    best = min(evals, key=lambda r: r["val_loss"]) if evals else None
    mfus = [float(r["mfu"]) for r in timed if _finite(r.get("mfu"))]
    return RunSummary(
        label=run.label,
        steps=max(int(r["step"]) for r in run.steps),
        tokens=sum(int(r.get("tokens", 0)) for r in trained),
        final_loss=float(trained[-1]["loss"]) if trained else None,
        best_val_loss=float(best["val_loss"]) if best else None,
        best_val_step=int(best["step"]) if best else None,
        final_val_loss=float(evals[-1]["val_loss"]) if evals else None,
        mean_tokens_per_s=_mean([float(r["tokens_per_s"]) for r in timed if _finite(r.get("tokens_per_s"))]),
        mean_mfu=_mean(mfus),
        skipped=sum(1 for r in run.steps if r.get("skipped")),
    )


def plot_runs(runs: list[RunMetrics], out_dir: Path) -> list[Path]:
    """One PNG per quantity, every run overlaid; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written: list[Path] = []

    def figure(name: str, title: str, xlabel: str, ylabel: str, draw: Any, logy: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
        for i, run in enumerate(runs):
            draw(ax, run, colors[i % len(colors)], width(i))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if logy:
            ax.set_yscale("log")
        if "tokens" in xlabel:
            ax.xaxis.set_major_formatter(EngFormatter())
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if "tokens/s" in ylabel:
            ax.yaxis.set_major_formatter(EngFormatter())
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    def width(i: int) -> float:
        """Earlier runs drawn wider, so curves that coincide (K=1 vs K=8, same tokens per step) stay visible."""
        return max(1.0, 1.2 + 1.2 * (len(runs) - 1 - i))

    def series(records: list[dict[str, Any]], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
        points = [(r[x_key], r[key]) for r in records if _finite(r.get(key))]
        return [p[0] for p in points], [p[1] for p in points]

    def loss(ax: Any, run: RunMetrics, color: str, lw: float, by_tokens: bool) -> None:
        tokens = run.cumulative_tokens()
        train = [dict(r, x=tokens[int(r["step"])] if by_tokens else r["step"]) for r in run.trained]
        evals = [dict(r, x=tokens.get(int(r["step"]), 0) if by_tokens else r["step"]) for r in run.evals]
        xs, ys = series(train, "loss", "x")
        ax.plot(xs, ys, "-" if len(xs) > 1 else "o", color=color, lw=lw, label=f"{run.label} train")
        xs, ys = series(evals, "val_loss", "x")
        if xs:
            ax.plot(xs, ys, "o--", color=color, ms=2 + 2 * lw, lw=lw, label=f"{run.label} val")

    def simple(key: str, skip_first: bool = False) -> Any:
        def draw(ax: Any, run: RunMetrics, color: str, lw: float) -> None:
            records = run.steps if key == "lr" else run.trained
            if skip_first and len(records) > 1:
                records = [r for r in records if int(r["step"]) > 1]
            xs, ys = series(records, key)
            marker = "-" if len(xs) > 1 else "o"
            ax.plot(xs, ys, marker, color=color, lw=lw, ms=2 + 2 * lw, label=run.label)

        return draw

    figure(
        "loss_vs_step.png",
        "Loss",
        "optimizer step",
        "loss (nats per token)",
        lambda ax, run, c, lw: loss(ax, run, c, lw, by_tokens=False),
    )
    figure(
        "loss_vs_tokens.png",
        "Loss",
        "tokens (valid targets, cumulative)",
        "loss (nats per token)",
        lambda ax, run, c, lw: loss(ax, run, c, lw, by_tokens=True),
    )
    figure("lr.png", "Learning rate", "optimizer step", "learning rate", simple("lr"))
    norms = [r["grad_norm"] for run in runs for r in run.trained if _finite(r.get("grad_norm"))]
    figure(
        "grad_norm.png",
        "Gradient norm (before clipping)",
        "optimizer step",
        "global L2 norm",
        simple("grad_norm"),
        logy=bool(norms) and min(norms) > 0,
    )
    figure(
        "tokens_per_s.png",
        "Throughput (step 1, warm-up, left out)",
        "optimizer step",
        "tokens/s (valid targets)",
        simple("tokens_per_s", skip_first=True),
    )
    if any(_finite(r.get("mfu")) for run in runs for r in run.steps):
        figure(
            "mfu.png",
            "Model FLOPs utilization (step 1 left out)",
            "optimizer step",
            "MFU",
            simple("mfu", skip_first=True),
        )

    noise_plot = plot_noise_scale(runs, out_dir / NOISE_PLOT, colors)  # runs that measured it; else no file
    if noise_plot is not None:
        written.append(noise_plot)
    return written


def make_report(
    run_dirs: list[Path | str], out_dir: Path | str | None = None
) -> tuple[Path, list[RunSummary], list[Path]]:
    """Read every run, write the plots and ``summary.txt`` into ``out_dir``; return (out_dir, summaries, plots).

    ``out_dir`` defaults to ``RUN_DIR/report`` for one run and ``./report`` for several.
    """
    if not run_dirs:
        raise BigBatchError("give at least one run directory")
    dirs = [Path(d) for d in run_dirs]
    runs = [read_metrics(d, label) for d, label in zip(dirs, run_labels(dirs), strict=False)]
    out = Path(out_dir) if out_dir is not None else (dirs[0] / "report" if len(dirs) == 1 else Path("report"))
    require_own_dir(out, "report directory", "--out", REPORT_MARKER, is_legacy_report)
    summaries = [summarize(run) for run in runs]
    mark_own_dir(out, REPORT_MARKER, "report")
    plots = plot_runs(runs, out)
    text = "\n\n".join(s.format() for s in summaries) + "\n"
    write_text_atomically(out / "summary.txt", text)
    return out, summaries, plots
