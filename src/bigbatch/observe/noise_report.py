"""The gradient noise scale of a run, read back from its ``metrics.jsonl``: the series ``bigbatch report`` plots
against tokens (with the run's tokens per step beside it), and the estimate ``bigbatch plan --from-run`` sizes a
batch from.

Every measured step's record carries the raw squared norms and the smoothed estimate after it (``noise_*``, see
:mod:`bigbatch.noise.scale`); steps that were not measured carry none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigbatch.errors import BigBatchError
from bigbatch.noise.scale import unbiased_estimates
from bigbatch.observe.runs import RunMetrics, read_metrics, run_settings, setting
from bigbatch.progress import plural
from bigbatch.sizing.plan import SolvedPlan, solve_plan

NOISE_PLOT = "noise_scale.png"
"""Written by ``bigbatch report`` when at least one run measured the noise scale."""


class NoiseScaleUnavailable(BigBatchError):
    """A run that holds no usable noise-scale measurement (the message says why and how to get one)."""


@dataclass(frozen=True)
class NoisePoint:
    """One measured step."""

    step: int
    tokens: int  # valid target tokens trained on up to and including this step
    smoothed: float  # the smoothed estimate after this measurement, in tokens (NaN or <= 0 while unusable)
    single: float  # this measurement alone, tr(Sigma)_i / |G|^2_i (NaN when its |G|^2_i is not positive)
    loss: float  # the step's training loss


@dataclass(frozen=True)
class NoiseSeries:
    """A run's measurements, and its tokens per step on every applied step (for comparison)."""

    label: str
    points: list[NoisePoint]
    steps: list[tuple[int, int]]  # (cumulative tokens, tokens of that step) of every applied step

    def usable(self) -> list[NoisePoint]:
        """Measurements whose smoothed estimate is a positive number."""
        return [p for p in self.points if math.isfinite(p.smoothed) and p.smoothed > 0]


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _single(record: dict[str, Any]) -> float:
    """One measurement's own estimate, from its raw norms (noisy: for showing the spread, never for deciding)."""
    try:
        b_small, b_big = _number(record["noise_b_small"]), _number(record["noise_b_big"])
        g_sq, trace = unbiased_estimates(
            _number(record["noise_small_sq"]), _number(record["noise_big_sq"]), b_small, b_big
        )
    except (KeyError, ValueError):
        return math.nan
    return trace / g_sq if g_sq > 0 and math.isfinite(trace) else math.nan


def noise_series(run: RunMetrics) -> NoiseSeries:
    """The measured steps of ``run`` in file order, with cumulative tokens (skipped steps measure nothing)."""
    tokens = run.cumulative_tokens()
    points = [
        NoisePoint(
            step=int(r["step"]),
            tokens=tokens[int(r["step"])],
            smoothed=_number(r["noise_scale"]),
            single=_single(r),
            loss=_number(r.get("loss")),
        )
        for r in run.trained
        if "noise_scale" in r
    ]
    steps = [(tokens[int(r["step"])], int(r.get("tokens", 0))) for r in run.trained]
    return NoiseSeries(run.label, points, steps)


NOISE_TITLE = "Gradient noise scale (critical batch estimate) and tokens per step\nagainst tokens seen"


def left_out(series: NoiseSeries) -> str:
    """Why a run is not in the plot: ``measured on no step`` or ``3 measurements, none positive``."""
    if not series.points:
        return "measured on no step"
    return f"{plural(len(series.points), 'measurement')}, none positive"


def noise_figure(runs: list[RunMetrics], colors: list[str]) -> Any:
    """The figure of :func:`plot_noise_scale` (a matplotlib ``Figure``), or ``None`` when no run has a usable
    measurement. Each run's tokens per step are dashed in its own colour, the dashes of the ``i``-th run drawn
    shifted by ``i`` dash lengths, so that runs at the same tokens per step alternate along the line instead of
    the last one hiding the others (and earlier runs' estimates are drawn wider); a run left out gets a legend
    entry saying why."""
    all_series = [noise_series(run) for run in runs]
    measured = [(i, run, s) for i, (run, s) in enumerate(zip(runs, all_series, strict=True)) if s.usable()]
    if not measured:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    dash = 4.0  # points; every run's pattern is one dash in len(measured), at its own offset
    for position, (i, _, s) in enumerate(measured):
        color = colors[i % len(colors)]  # each run's colour in every plot of the report
        usable = s.usable()
        ax.plot(
            [p.tokens for p in usable],
            [p.smoothed for p in usable],
            "-" if len(usable) > 1 else "o",
            color=color,
            lw=2 + 1.5 * (len(measured) - 1 - position),  # earlier runs wider: coinciding curves stay visible
            ms=5,
            label=f"{s.label} noise scale (smoothed)",
        )
        singles = [p for p in s.points if math.isfinite(p.single) and p.single > 0]
        if singles:
            ax.plot(
                [p.tokens for p in singles],
                [p.single for p in singles],
                ".",
                color=color,
                alpha=0.3,
                ms=4,
                label=f"{s.label} single measurements (> 0)",
            )
        if s.steps:
            xs = [0] + [x for x, _ in s.steps]
            ys = [s.steps[0][1]] + [y for _, y in s.steps]
            style: Any = "--" if len(measured) == 1 else (position * dash, (dash, dash * (len(measured) - 1)))
            ax.step(xs, ys, where="pre", ls=style, color=color, lw=1.5, label=f"{s.label} tokens per step")
    ax.set_yscale("log")
    ax.set_xlabel("tokens (valid targets, cumulative)")
    ax.set_ylabel("tokens")
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.set_title(NOISE_TITLE)
    ax.grid(alpha=0.3, which="both")
    handles, labels = ax.get_legend_handles_labels()
    if len(measured) == 1:
        _, run, s = measured[0]
        twin = ax.twinx()
        losses = [
            (x, float(r["loss"]))
            for (x, _), r in zip(s.steps, run.trained, strict=True)
            if math.isfinite(_number(r.get("loss")))
        ]
        if losses:
            twin.plot([x for x, _ in losses], [y for _, y in losses], "-", color="0.55", lw=1, label="training loss")
            twin.set_ylabel("training loss (nats per token)", color="0.4")
            more = twin.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
    plotted = {i for i, _, _ in measured}
    for i, s in enumerate(all_series):
        if i not in plotted:  # no line of its own: the legend says why
            handles.append(Line2D([], [], ls="none", marker="x", color=colors[i % len(colors)]))
            labels.append(f"{s.label}: no noise-scale estimate ({left_out(s)})")
    fig.legend(handles, labels, fontsize="small", loc="lower center", ncol=2, frameon=False)  # below the axes
    fig.tight_layout(rect=(0, 0.01 + 0.04 * math.ceil(len(handles) / 2), 1, 1))
    return fig


def plot_noise_scale(runs: list[RunMetrics], path: Path, colors: list[str]) -> Path | None:
    """``noise_scale.png``: each run's smoothed noise scale against tokens seen (solid), its single measurements
    (faint dots, the positive ones), and its tokens per step (dashed, same colour); with one run, its training
    loss on a second axis. Runs without a usable measurement have no line, and a legend entry saying why (the
    report's summary says it too); ``None`` (nothing written) when that is every run."""
    fig = noise_figure(runs, colors)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# bigbatch plan --from-run: the estimate a batch is sized from
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredNoise:
    """The noise scale a run measured, and what the run itself used."""

    run_dir: Path
    tokens: float  # the estimate: the smoothed noise scale at ``step``
    step: int  # the measured step it is from: the run's last usable measurement
    last_measured_step: int  # the run's last measurement (later than ``step`` when that one was unusable)
    last_step: int
    tokens_seen: int
    tokens_per_step: int  # the run's last applied step's tokens
    micro_batch: int | None  # from the run's config.toml (None when not a number there)
    seq_len: int | None
    world_size: int | None  # derived from a full step's tokens (packed data, fixed K), else None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def why_unmeasured(run: RunMetrics, settings: dict[str, Any]) -> str:
    """Why ``run`` has no noise-scale measurement, and how to get one (from its config and step records)."""
    every = setting(settings, "run", "noise_scale_every")
    processes = _positive_int(setting(settings, "run", "nproc")) or 1
    if every == 0:
        return "it was trained with --noise-scale-every 0; train with --noise-scale-every N (e.g. 10) to measure it"
    if not run.trained:
        return "no step applied an update (every step was skipped), and skipped steps measure nothing"
    if processes == 1 and all(int(r.get("micro_batches", 0)) < 2 for r in run.trained):
        return (
            "every step was one micro-batch in one process (K = 1), so there were not two batch sizes to "
            "compare; train with a smaller --micro-batch (K >= 2) to measure it"
        )
    # DDP and FSDP2 measure it at any K (each rank's own micro-batch gradient, read before the reduction)
    return (
        "no step record carries noise_* fields (measured at step 1 and every --noise-scale-every steps; "
        "a run from a bigbatch without the measurement?); train with --noise-scale-every N to measure it"
    )


def _world_size(run: RunMetrics, settings: dict[str, Any], micro_batch: int | None, seq_len: int | None) -> int | None:
    """The run's world size from a step of full micro-batches: tokens = B x T x K x world (packed data, fixed K;
    with documents or a token budget the valid tokens do not tell)."""
    packed = setting(settings, "data", "data_mode") == "packed" and not setting(settings, "batch", "token_budget")
    if micro_batch is None or seq_len is None or not packed:
        return None
    for r in run.trained:
        per_world = micro_batch * seq_len * int(r.get("micro_batches", 0))
        tokens = int(r.get("tokens", 0))
        if per_world and tokens and tokens % per_world == 0:
            return tokens // per_world
    return None


def measured_noise(run_dir: Path | str) -> MeasuredNoise:
    """The noise scale to size a batch from: the smoothed estimate of the run's last usable measurement (the
    number its end-of-run line reports). One-line errors for a missing run, a missing ``metrics.jsonl``, and a
    run without (usable) measurements, saying why."""
    run_dir = Path(run_dir)
    run = read_metrics(run_dir)
    settings = run_settings(run_dir)
    series = noise_series(run)
    if not series.points:
        raise NoiseScaleUnavailable(f"{run_dir} has no noise-scale measurements: {why_unmeasured(run, settings)}")
    usable = series.usable()
    if not usable:
        raise NoiseScaleUnavailable(
            f"{run_dir} has {plural(len(series.points), 'noise-scale measurement')} "
            "but no usable estimate (the smoothed |G|^2 or tr(Sigma) is not yet positive: the gradient noise "
            "still drowns the signal); train longer, or measure more often with a smaller --noise-scale-every"
        )
    micro_batch = _positive_int(setting(settings, "batch", "micro_batch"))
    seq_len = _positive_int(setting(settings, "batch", "seq_len"))
    trained = run.trained
    return MeasuredNoise(
        run_dir=run_dir,
        tokens=usable[-1].smoothed,
        step=usable[-1].step,
        last_measured_step=series.points[-1].step,
        last_step=int(trained[-1]["step"]),
        tokens_seen=series.steps[-1][0],
        tokens_per_step=int(trained[-1].get("tokens", 0)),
        micro_batch=micro_batch,
        seq_len=seq_len,
        world_size=_world_size(run, settings, micro_batch, seq_len),
    )


def plan_from_run(
    run_dir: Path | str, micro_batch: int | None = None, seq_len: int | None = None, devices: int | None = None
) -> tuple[SolvedPlan, list[str]]:
    """Tokens per step from the run's measured noise scale, as whole micro-batches of ``micro_batch`` x
    ``seq_len`` on every one of ``devices`` (each defaults to the run's own), K derived and rounded to the nearest
    whole number (at least 1) by :func:`bigbatch.sizing.plan.solve_plan`. Returns the plan and the lines saying where
    the number comes from."""
    measured = measured_noise(run_dir)
    micro_batch = micro_batch or measured.micro_batch
    seq_len = seq_len or measured.seq_len
    devices = devices or measured.world_size or 1
    if micro_batch is None or seq_len is None:
        missing = " and ".join(f"--{n}" for n, v in (("micro-batch", micro_batch), ("seq-len", seq_len)) if v is None)
        raise NoiseScaleUnavailable(
            f"{measured.run_dir} has no readable config.toml with the run's settings; give {missing}"
        )
    target = max(1, round(measured.tokens))
    solved = solve_plan(seq_len, target, micro_batch, None, devices)
    plan = solved.plan
    where = (
        "its last measurement"
        if measured.step == measured.last_measured_step
        else (f"its last usable one; the last measurement, at step {measured.last_measured_step}, is not usable yet")
    )
    lines = [
        f"from run {measured.run_dir}: measured noise scale {target:,} tokens, the smoothed estimate at step "
        f"{measured.step} ({where}; {measured.tokens_seen:,} tokens seen in {plural(measured.last_step, 'step')}); "
        f"the run used {measured.tokens_per_step:,} tokens per step ({measured.tokens_per_step / target:.2g}x the "
        "noise scale)",
        f"suggested tokens per step: the noise scale in whole micro-batches of {micro_batch} x {seq_len} on "
        f"{plural(devices, 'device')}: {plan.tokens_per_step:,} (K {plan.accumulation_steps})",
    ]
    notes = []
    if plan.accumulation_steps == 1 and target < plan.tokens_per_step:
        notes.append(
            f"the noise scale is below one micro-batch on every device ({plan.tokens_per_step:,} tokens); a smaller "
            "--micro-batch, --seq-len or fewer --devices gets closer to it"
        )
    if plan.accumulation_steps == 1 and plan.world_size == 1:
        notes.append("with K = 1 in one process a run cannot measure the noise scale (it needs two batch sizes)")
    from bigbatch.sizing.tradeoff import tradeoff_lines

    lines += tradeoff_lines(Path(measured.run_dir), measured.tokens)
    return solved, lines + [f"note: {n}" for n in notes]
