"""``bigbatch report``: plots and a text summary from one or more runs' ``metrics.jsonl``.

Every run becomes one line per plot, labelled with its name (``bigbatch train --name``) or else its directory's
name (see :func:`run_labels`), so runs at the same tokens per step with different K (or world sizes) can be laid
on top of each other: exact accumulation makes their curves coincide.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigbatch.errors import BigBatchError, ConfigError
from bigbatch.files.atomic import write_text_atomically
from bigbatch.files.outputs import REPORT_MARKER, is_legacy_report, mark_own_dir, require_own_dir
from bigbatch.observe.metrics import Throughput
from bigbatch.observe.noise_report import NOISE_PLOT, noise_series, plot_noise_scale, why_unmeasured
from bigbatch.observe.runs import RunMetrics, read_metrics, run_labels, run_settings
from bigbatch.progress import plural

log = logging.getLogger(__name__)

PLOTS = (
    "loss_vs_step.png",
    "loss_vs_tokens.png",
    "lr.png",
    "grad_norm.png",
    "tokens_per_s.png",
)
"""Files every report writes (``mfu.png`` as well when a run's records carry MFU, ``noise_scale.png`` when a run
measured the gradient noise scale, ``expert_load.png`` and ``router_loss.png`` for a mixture of experts)."""


@dataclass(frozen=True)
class Positions:
    """Where a documents run's positions went: those of its applied steps (from each step record's valid targets
    and shares: a ratio of totals), and one epoch's layout (its latest ``documents`` record) when there is one."""

    trained: int  # positions of the applied steps, all ranks
    padding: float  # shares of them
    prompt: float
    layout: dict[str, Any] | None = None  # the documents record: packed, rows, seq_len, padding_share, prompt_share

    def format(self) -> list[str]:
        lines = [
            f"  positions          {self.trained:,} trained on: {self.padding:.1%} padding, {self.prompt:.1%} masked "
            f"prompts, {1 - self.padding - self.prompt:.1%} valid targets"
        ]
        layout = self.layout
        if layout is not None and _finite(layout.get("padding_share")) and _finite(layout.get("prompt_share")):
            rows, seq_len = int(layout.get("rows", 0)), layout.get("seq_len", "?")  # as the run header words it
            if layout.get("packed"):
                how = f"packed into {plural(rows, 'row')} of {seq_len}"
            else:
                how = f"{plural(rows, 'sequence')}, one per row of {seq_len}"
            lines.append(
                f"  epoch layout       {how}: {float(layout['padding_share']):.1%} padding, "
                f"{float(layout['prompt_share']):.1%} masked prompts"
            )
        return lines


@dataclass(frozen=True)
class RunSummary:
    label: str
    steps: int  # the last optimizer step reached
    tokens: int  # valid target tokens trained on (skipped steps excluded)
    final_loss: float | None
    best_val_loss: float | None
    best_val_step: int | None
    final_val_loss: float | None
    throughput: Throughput | None  # tokens / time of the applied steps after step 1 (step 1 includes warm-up)
    mfu: float | None  # total FLOPs / total peak FLOPs of the same steps, when their records carry "mfu"
    skipped: int
    positions: Positions | None = None  # documents runs: padding and masked-prompt shares
    noise_scale: str = ""  # the measured noise scale, or why there is none
    experts: str = ""  # a mixture of experts: its last step's router loss and expert load
    preference: str = ""  # a preference objective's rewards (its loss is the objective's, not per token)
    rewards: str = ""  # learning from rewards: the reward's course

    @property
    def tokens_per_s(self) -> float | None:
        return self.throughput.tokens_per_s if self.throughput is not None else None

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
            said = f" (perplexity {_perplexity(self.best_val_loss)})" if not self.preference else " (the objective)"
            lines.append(f"  best val loss      {self.best_val_loss:.4f} at step {self.best_val_step}{said}")
            lines.append(f"  final val loss     {number(self.final_val_loss, '.4f')}")
        if self.throughput is None:
            lines.append("  tok/s              n/a (no applied step)")
        else:
            t = self.throughput
            lines.append(f"  tok/s              {t.tokens_per_s:,.0f} ({t.basis()})")
        if self.mfu is not None:
            lines.append(f"  MFU                {self.mfu:.1%} (at that tok/s)")
        if self.positions is not None:
            lines += self.positions.format()
        if self.noise_scale:
            lines.append(f"  noise scale        {self.noise_scale}")
        if self.experts:
            lines.append(f"  experts            {self.experts}")
        if self.preference:
            lines.append(f"  preference         {self.preference}")
        if self.rewards:
            lines.append(f"  rewards            {self.rewards}")
        lines.append(f"  skipped steps      {self.skipped}")
        return "\n".join(lines)


def _perplexity(loss: float) -> str:
    return f"{math.exp(loss):,.2f}" if loss < 700 else "inf"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def throughput(trained: list[dict[str, Any]]) -> Throughput | None:
    """Total valid target tokens over the total time (``dt``) of the applied steps after step 1, which includes
    warm-up and compilation; a run of step 1 alone: that step's, said to include warm-up."""
    steps = [r for r in trained if _finite(r.get("dt")) and r["dt"] > 0 and _finite(r.get("tokens"))]
    timed = [r for r in steps if int(r["step"]) > 1]
    warm_up = not timed
    timed = timed or steps[:1]
    if not timed:
        return None
    tokens, seconds = sum(int(r["tokens"]) for r in timed), sum(float(r["dt"]) for r in timed)
    return Throughput(tokens, seconds, int(timed[0]["step"]), int(timed[-1]["step"]), warm_up=warm_up)


def total_mfu(trained: list[dict[str, Any]], timed: Throughput | None) -> float | None:
    """Model FLOPs utilization of the steps ``timed`` covers: the FLOPs they did over the peak FLOPs of their time.

    A step's ``mfu`` is F x tokens / (dt x P) (F: FLOPs per token, P: peak FLOP/s of all devices), so its peak
    FLOPs P x dt are F x tokens / mfu, and the ratio of totals is sum(tokens) / sum(tokens / mfu): with one F and P
    that is F x (tokens / time) / P, the MFU of the run's tok/s, whatever the steps' times."""
    if timed is None:
        return None
    steps = [
        r
        for r in trained
        if timed.first_step <= int(r["step"]) <= timed.last_step
        and _finite(r.get("mfu"))
        and r["mfu"] > 0
        and _finite(r.get("tokens"))
        and r["tokens"] > 0
    ]
    if not steps:
        return None
    return sum(float(r["tokens"]) for r in steps) / sum(float(r["tokens"]) / float(r["mfu"]) for r in steps)


def positions(run: RunMetrics) -> Positions | None:
    """A documents run's positions: each applied step's are its valid targets over its valid share (1 - padding -
    prompt), so padding and prompts are summed in positions, not averaged as shares."""
    steps = [r for r in run.trained if _finite(r.get("padding_share")) and _finite(r.get("tokens"))]
    total = padding = prompt = 0.0
    for r in steps:
        pad, masked = float(r["padding_share"]), float(r.get("prompt_share", 0.0) or 0.0)
        if pad + masked < 1:
            n = float(r["tokens"]) / (1 - pad - masked)
            total, padding, prompt = total + n, padding + pad * n, prompt + masked * n
    layout = run.documents[-1] if run.documents else None
    if not total:
        return None
    return Positions(round(total), padding / total, prompt / total, layout)


def describe_noise_scale(run: RunMetrics) -> str:
    """The run's measured noise scale (its last usable smoothed estimate, as ``plan --from-run`` takes it), or
    why it has none: a run left out of ``noise_scale.png`` says so here."""
    series = noise_series(run)
    usable = series.usable()
    if usable:
        last = usable[-1]
        return f"{last.smoothed:,.0f} tokens (the smoothed estimate at step {last.step})"
    if series.points:
        return (
            f"no estimate yet: {plural(len(series.points), 'measurement')}, none positive (the gradient noise still "
            "drowns the signal); not in noise_scale.png"
        )
    return f"not measured: {why_unmeasured(run, run_settings(run.run_dir))}"


def summarize(run: RunMetrics) -> RunSummary:
    trained = run.trained
    evals = [r for r in run.evals if _finite(r["val_loss"])]
    best = min(evals, key=lambda r: r["val_loss"]) if evals else None
    timed = throughput(trained)
    return RunSummary(
        label=run.label,
        steps=max(int(r["step"]) for r in run.steps),
        tokens=sum(int(r.get("tokens", 0)) for r in trained),
        final_loss=float(trained[-1]["loss"]) if trained else None,
        best_val_loss=float(best["val_loss"]) if best else None,
        best_val_step=int(best["step"]) if best else None,
        final_val_loss=float(evals[-1]["val_loss"]) if evals else None,
        throughput=timed,
        mfu=total_mfu(trained, timed),
        skipped=sum(1 for r in run.steps if r.get("skipped")),
        positions=positions(run),
        noise_scale=describe_noise_scale(run),
        experts=describe_experts(trained),
        preference=describe_preference(trained, evals),
        rewards=describe_rewards(trained),
    )


def describe_preference(trained: list[dict[str, Any]], evals: list[dict[str, Any]]) -> str:
    """``reward accuracy 0.95, margin 0.48 (last step) | val reward accuracy 1.000`` for a preference run (KTO: its
    rewards and KL point); empty for a next-token run."""
    if any(_finite(r.get("reward/mean")) for r in trained):
        return ""  # learning from rewards: describe_rewards
    last = next((r for r in reversed(trained) if "rewards/accuracy" in r or "kl" in r), None)
    if last is None:
        return ""
    if "rewards/accuracy" in last:
        text = (
            f"reward accuracy {float(last['rewards/accuracy']):.2f}, margin {float(last['rewards/margin']):.3f} "
            "(last step)"
        )
        val = next((r for r in reversed(evals) if _finite(r.get("val_rewards/accuracy"))), None)
        if val is not None:
            text += f" | val reward accuracy {float(val['val_rewards/accuracy']):.3f}"
        return text
    return (
        f"rewards desirable {float(last.get('rewards/desirable', math.nan)):.3f}, undesirable "
        f"{float(last.get('rewards/undesirable', math.nan)):.3f}, kl {float(last['kl']):.3f} (last step)"
    )


def describe_rewards(trained: list[dict[str, Any]]) -> str:
    """``reward 0.300 (step 1) -> 0.524 (step 200) | clipped 0.0%, completion 3.5 tokens (last step)`` for a run
    that learns from rewards; empty for any other."""
    rewarded = [r for r in trained if _finite(r.get("reward/mean"))]
    if not rewarded:
        return ""
    first, last = rewarded[0], rewarded[-1]
    text = (
        f"reward {float(first['reward/mean']):.3f} (step {first['step']}) -> {float(last['reward/mean']):.3f} "
        f"(step {last['step']}) | clipped {float(last.get('clipped', 0.0)):.1%}, completion "
        f"{float(last.get('completion/tokens', 0.0)):.1f} tokens (last step)"
    )
    return text + (f", kl {float(last['kl']):.4f}" if _finite(last.get("kl")) else "")


def describe_experts(trained: list[dict[str, Any]]) -> str:
    """``router loss 0.0101 | load max/mean 1.21, cv 0.09 (busiest layer, last step)`` for a mixture of experts."""
    last = next((r for r in reversed(trained) if _finite(r.get("expert_load_cv"))), None)
    if last is None:
        return ""
    return (
        f"router loss {float(last.get('router_loss', 0.0)):.4f} | load max/mean "
        f"{float(last.get('expert_load_max_over_mean', 1.0)):.2f}, cv {float(last['expert_load_cv']):.2f} (busiest "
        "layer, last step)"
    )


Draw = Callable[[Any, RunMetrics, str, float], None]
"""Draws one run's curve on a plot's axes, in its color and line width."""


@dataclass(frozen=True)
class _Plot:
    """One of the report's PNGs: its file, title, axes and how a run is drawn on it."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    draw: Draw
    logy: bool = False


def plot_runs(runs: list[RunMetrics], out_dir: Path) -> list[Path]:
    """One PNG per quantity, every run overlaid; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = [_draw_plot(plot, runs, colors, out_dir) for plot in _plots(runs)]
    noise_plot = plot_noise_scale(runs, out_dir / NOISE_PLOT, colors)  # runs that measured it; else no file
    if noise_plot is not None:
        written.append(noise_plot)
    return written


def _plots(runs: list[RunMetrics]) -> list[_Plot]:
    """The report's plots, in order: ``mfu.png`` only when a run's records carry MFU; the gradient norm on a log
    scale when every norm is positive."""
    norms = [r["grad_norm"] for run in runs for r in run.trained if _finite(r.get("grad_norm"))]
    plots = [
        _Plot(
            "loss_vs_step.png",
            "Loss",
            "optimizer step",
            "loss (nats per token; preference, rewards: the objective)",
            lambda ax, run, c, lw: _draw_loss(ax, run, c, lw, by_tokens=False),
        ),
        _Plot(
            "loss_vs_tokens.png",
            "Loss",
            "tokens (valid targets, cumulative)",
            "loss (nats per token; preference, rewards: the objective)",
            lambda ax, run, c, lw: _draw_loss(ax, run, c, lw, by_tokens=True),
        ),
        _Plot("lr.png", "Learning rate", "optimizer step", "learning rate", _draw_key("lr")),
        _Plot(
            "grad_norm.png",
            "Gradient norm (before clipping)",
            "optimizer step",
            "global L2 norm",
            _draw_key("grad_norm"),
            logy=bool(norms) and min(norms) > 0,
        ),
        _Plot(
            "tokens_per_s.png",
            "Throughput (step 1, warm-up, left out)",
            "optimizer step",
            "tokens/s (valid targets)",
            _draw_key("tokens_per_s", skip_first=True),
        ),
    ]
    if any(_finite(r.get("expert_load_cv")) for run in runs for r in run.steps):
        plots.append(
            _Plot(
                "expert_load.png",
                "Expert load: coefficient of variation, busiest layer (0: balanced)",
                "optimizer step",
                "CV of tokens per expert",
                _draw_key("expert_load_cv"),
            )
        )
        plots.append(
            _Plot(
                "router_loss.png",
                "Router loss (balancing and z-loss, weighted)",
                "optimizer step",
                "router loss",
                _draw_key("router_loss"),
            )
        )
    if any(_finite(r.get("reward/mean")) for run in runs for r in run.steps):  # learning from rewards
        plots.append(
            _Plot(
                "reward_vs_step.png",
                "Reward: mean over each step's completions",
                "optimizer step",
                "mean reward",
                _draw_key("reward/mean"),
            )
        )
    if any(_finite(r.get("mfu")) for run in runs for r in run.steps):
        plots.append(
            _Plot(
                "mfu.png",
                "Model FLOPs utilization (step 1 left out)",
                "optimizer step",
                "MFU",
                _draw_key("mfu", skip_first=True),
            )
        )
    return plots


def _draw_plot(plot: _Plot, runs: list[RunMetrics], colors: list[str], out_dir: Path) -> Path:
    """Draw every run on ``plot`` and save it in ``out_dir``; returns its path."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for i, run in enumerate(runs):
        plot.draw(ax, run, colors[i % len(colors)], _line_width(i, len(runs)))
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel(plot.ylabel)
    ax.set_title(plot.title)
    if plot.logy:
        ax.set_yscale("log")
    if "tokens" in plot.xlabel:
        ax.xaxis.set_major_formatter(EngFormatter())
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if "tokens/s" in plot.ylabel:
        ax.yaxis.set_major_formatter(EngFormatter())
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / plot.name
    fig.savefig(path)
    plt.close(fig)
    return path


def _line_width(i: int, runs: int) -> float:
    """Earlier runs drawn wider, so curves that coincide (K=1 vs K=8, same tokens per step) stay visible."""
    return max(1.0, 1.2 + 1.2 * (runs - 1 - i))


def _series(records: list[dict[str, Any]], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    points = [(r[x_key], r[key]) for r in records if _finite(r.get(key))]
    return [p[0] for p in points], [p[1] for p in points]


def _draw_loss(ax: Any, run: RunMetrics, color: str, lw: float, by_tokens: bool) -> None:
    """The training loss, and the validation loss as points, against steps or cumulative tokens."""
    tokens = run.cumulative_tokens()
    train = [dict(r, x=tokens[int(r["step"])] if by_tokens else r["step"]) for r in run.trained]
    evals = [dict(r, x=tokens.get(int(r["step"]), 0) if by_tokens else r["step"]) for r in run.evals]
    xs, ys = _series(train, "loss", "x")
    ax.plot(xs, ys, "-" if len(xs) > 1 else "o", color=color, lw=lw, label=f"{run.label} train")
    xs, ys = _series(evals, "val_loss", "x")
    if xs:
        ax.plot(xs, ys, "o--", color=color, ms=2 + 2 * lw, lw=lw, label=f"{run.label} val")


def _draw_key(key: str, skip_first: bool = False) -> Draw:
    """A step record's ``key`` against the step (``lr`` of every step, the rest of applied steps)."""

    def draw(ax: Any, run: RunMetrics, color: str, lw: float) -> None:
        records = run.steps if key == "lr" else run.trained
        if skip_first and len(records) > 1:
            records = [r for r in records if int(r["step"]) > 1]
        xs, ys = _series(records, key)
        marker = "-" if len(xs) > 1 else "o"
        ax.plot(xs, ys, marker, color=color, lw=lw, ms=2 + 2 * lw, label=run.label)

    return draw


def default_report_dir(dirs: list[Path]) -> Path:
    """Where a report goes without ``--out``: ``RUN_DIR/report`` for one run; for several, ``report`` in the
    nearest directory that holds them all (``runs/report`` for runs under ``runs/``), beside the runs and never in
    the working directory itself, which is often the user's checkout. Runs whose nearest common directory is the
    working directory or one above it (``/``, a home directory) are refused: ``--out`` says where."""
    if len(dirs) == 1:
        return dirs[0] / "report"
    common = Path(os.path.commonpath([d.resolve() for d in dirs]))
    here = Path.cwd().resolve()
    if common == here or common in here.parents:
        raise ConfigError(
            f"the runs {dirs[0]}, {dirs[1]}{', ...' if len(dirs) > 2 else ''} meet only in {common}, the working "
            "directory or one above it; a report of several runs goes into the directory that holds them (runs/a "
            "and runs/b: runs/report), so give --out DIR for these"
        )
    return common.relative_to(here) / "report" if common.is_relative_to(here) else common / "report"


def leave_out_reports(dirs: list[Path]) -> list[Path]:
    """``dirs`` less the report directories among them (``runs/*`` takes in ``runs/report`` from a report before),
    each said; a :class:`BigBatchError` when nothing else is left."""
    runs = []
    for directory in dirs:
        if (directory / REPORT_MARKER).is_file():
            log.warning("%s is a report written by bigbatch report, not a run: left out", directory)
        else:
            runs.append(directory)
    if not runs and dirs:
        raise BigBatchError(f"{dirs[0]} is a report written by bigbatch report, not a run; give run directories")
    return runs


def make_report(
    run_dirs: list[Path | str], out_dir: Path | str | None = None
) -> tuple[Path, list[RunSummary], list[Path]]:
    """Read every run, write the plots and ``summary.txt`` into ``out_dir``; return (out_dir, summaries, plots).

    ``out_dir`` defaults to ``RUN_DIR/report`` for one run and, for several, ``report`` in the directory that
    holds them all (:func:`default_report_dir`).
    """
    if not run_dirs:
        raise BigBatchError("give at least one run directory")
    dirs = leave_out_reports([Path(d) for d in run_dirs])
    runs = [read_metrics(d, label) for d, label in zip(dirs, run_labels(dirs), strict=False)]
    out = Path(out_dir) if out_dir is not None else default_report_dir(dirs)
    require_own_dir(out, "report directory", "--out", REPORT_MARKER, is_legacy_report)
    summaries = [summarize(run) for run in runs]
    mark_own_dir(out, REPORT_MARKER, "report")
    plots = plot_runs(runs, out)
    text = "\n\n".join(s.format() for s in summaries) + "\n"
    write_text_atomically(out / "summary.txt", text)
    return out, summaries, plots
