"""The critical batch over a whole run: ``bigbatch critical-batch --every N`` measures it by branching at several
checkpoints of one run, and writes it as a function of tokens seen beside the noise scale the run logged.

Merrill et al. (2025) find the critical batch near zero early in training, rising, then levelling off; the
gradient noise scale is a cheap stand-in whose distance from the measurement this table and plot show. Each point
is one :func:`~bigbatch.critical_batch.measure.measure_critical_batch` (its branches and ``result.json`` in its own
directory, reused when run again); the spread of a point is the bracket the sizes tried leave: the critical size and
the next size tried, which was already out of tolerance (none above when every size was within it).

``RUN/critical-batch/over-run-RULE.json`` holds the points (:mod:`bigbatch.sizing.critical_curve`); ``--batch-ramp
from:RUN`` follows them in a new run (:mod:`bigbatch.sizing.ramp`).
"""

from __future__ import annotations

from pathlib import Path

from bigbatch.critical_batch.result import CriticalBatchResult, noise_scale_series, plot_logged_noise
from bigbatch.errors import CheckpointError
from bigbatch.files.atomic import write_atomically, write_json_atomically
from bigbatch.sizing.critical_curve import CriticalBatchOverRun, CriticalPoint, over_run_path


def checkpoints_every(steps: list[int], every: int, run_dir: Path) -> list[int]:
    """The run's checkpoint steps that are multiples of ``every``; at least two, or a one-line error."""
    chosen = [s for s in sorted(steps) if s % every == 0]
    if len(chosen) < 2:
        have = ", ".join(str(s) for s in sorted(steps)) or "none"
        raise CheckpointError(
            f"--every {every}: {run_dir} has {len(chosen)} checkpoint{'s' if len(chosen) != 1 else ''} at a multiple "
            f"of {every} (its checkpoints are at steps: {have}); the critical batch over a run needs two or more: "
            "train with --save-every N --keep-checkpoints 0, or choose --every among those steps"
        )
    return chosen


def point_of(result: CriticalBatchResult, run_dir: Path) -> CriticalPoint:
    """One point of the curve from one measurement, with the run's noise scale at its step beside it."""
    sizes = [b.tokens_per_step for b in result.branches]
    critical = result.critical_tokens_per_step
    above = [s for s in sizes if s > critical]
    noise = noise_scale_series(run_dir, up_to_step=result.parent_step)
    return CriticalPoint(
        step=result.parent_step,
        tokens_seen=result.parent_tokens_seen,
        critical_tokens_per_step=critical,
        bound=result.bound,
        low=critical,
        high=0 if result.bound == "at least" else above[0],
        noise_scale=noise[-1][2] if noise else None,
    )


def write_over_run(result: CriticalBatchOverRun, run_dir: Path, plot: bool) -> Path:
    """``over-run-RULE.json`` (and its plot beside it, ``.png``), each written whole or not at all."""
    path = over_run_path(run_dir, result.batch_change_rule)
    path.parent.mkdir(parents=True, exist_ok=True)
    if plot:
        plot_over_run(result, noise_scale_series(run_dir), path.with_suffix(".png"))
    write_json_atomically(path, result.to_dict())
    return path


def plot_over_run(result: CriticalBatchOverRun, noise: list[tuple[int, int, float]], path: Path) -> Path:
    """The critical batch (with its bracket) and the noise scale against tokens seen, log-scaled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 4.5))
    seen = [p.tokens_seen for p in result.points]
    axis.plot(seen, [p.low for p in result.points], "o-", color="C2", label="critical batch (branching)")
    for p in result.points:
        top = p.high or p.low * 2
        axis.vlines(p.tokens_seen, p.low, top, color="C2", alpha=0.4, lw=6)
        if not p.high:
            axis.annotate("", (p.tokens_seen, top), (p.tokens_seen, p.low), arrowprops={"arrowstyle": "->"})
    if noise:
        plot_logged_noise(axis, noise, alpha=0.7)
    axis.set_xscale("symlog", linthresh=max(1, min(seen) or 1))
    axis.set_yscale("log", base=2)
    axis.set_xlabel("tokens seen")
    axis.set_ylabel("tokens per step")
    axis.set_title(f"critical batch over {Path(result.run).name} (bar: the bracket the sizes tried leave)")
    axis.legend(fontsize=8)
    fig.tight_layout()
    try:
        write_atomically(path, lambda handle: fig.savefig(handle, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path
