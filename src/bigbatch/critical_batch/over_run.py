"""The critical batch over a whole run: ``bigbatch critical-batch --every N`` measures it by branching at several
checkpoints of one run, and writes it as a function of tokens seen beside the noise scale the run logged.

Merrill et al. (2025) find the critical batch near zero early in training, rising, then levelling off; the
gradient noise scale is a cheap stand-in whose distance from the measurement this table and plot show. Each point
is one :func:`~bigbatch.critical_batch.measure.measure_critical_batch` (its branches and ``result.json`` in its own
directory, reused when run again); the spread of a point is the bracket the sizes tried leave: the critical size and
the next size tried, which was already out of tolerance (none above when every size was within it).

``RUN/critical-batch/over-run-RULE.json`` holds the points; ``--batch-ramp from:RUN`` follows them in a new run
(:mod:`bigbatch.sizing.ramp`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bigbatch.critical_batch.result import CriticalBatchResult, noise_scale_series
from bigbatch.errors import CheckpointError, ConfigError
from bigbatch.files.atomic import write_atomically, write_json_atomically

OVER_RUN_PREFIX = "over-run-"


@dataclass(frozen=True)
class CriticalPoint:
    """The critical batch measured at one checkpoint: ``low`` is the critical size, ``high`` the next size tried
    (out of tolerance), 0 when every size tried was within it (the answer is at least ``low``)."""

    step: int
    tokens_seen: int
    critical_tokens_per_step: int
    bound: str  # at least, at most, between (see CriticalBatchResult.bound)
    low: int
    high: int
    noise_scale: float | None  # the run's smoothed estimate at or before the step


@dataclass(frozen=True)
class CriticalBatchOverRun:
    run: str
    batch_change_rule: str
    tokens_per_step_tried: list[int]
    budget: int
    tolerance: float
    points: list[CriticalPoint] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        lines = [
            f"critical batch over the run {self.run} | {len(self.points)} points | sizes tried "
            f"{', '.join(f'{s:,}' for s in self.tokens_per_step_tried)} | {self.budget:,} tokens per branch | rule "
            f"{self.batch_change_rule}",
            f"{'step':>8} {'tokens seen':>14} {'critical batch':>16} {'spread':>24} {'noise scale':>13} {'ratio':>7}",
        ]
        for p in self.points:
            spread = f"[{p.low:,}, {p.high:,})" if p.high else f"[{p.low:,}, above)"
            noise = f"{p.noise_scale:,.0f}" if p.noise_scale else "-"
            ratio = f"{p.noise_scale / p.critical_tokens_per_step:.2g}x" if p.noise_scale else "-"
            critical = ("<= " if p.bound == "at most" else ">= " if p.bound == "at least" else "") + f"{p.low:,}"
            lines.append(f"{p.step:>8,} {p.tokens_seen:>14,} {critical:>16} {spread:>24} {noise:>13} {ratio:>7}")
        lines.append(
            "ratio: the noise scale the run logged over the critical batch measured by branching (1x: the cheap "
            "estimate agrees); a new run follows this curve with --batch-ramp from:RUN"
        )
        return "\n".join(lines)


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


def over_run_path(run_dir: Path, rule_label: str) -> Path:
    return run_dir / "critical-batch" / f"{OVER_RUN_PREFIX}{rule_label}.json"


def write_over_run(result: CriticalBatchOverRun, run_dir: Path, plot: bool) -> Path:
    """``over-run-RULE.json`` (and its plot beside it, ``.png``), each written whole or not at all."""
    path = over_run_path(run_dir, result.batch_change_rule)
    if plot:
        plot_over_run(result, noise_scale_series(run_dir), path.with_suffix(".png"))
    write_json_atomically(path, result.to_dict())
    return path


def read_over_run(source: Path) -> CriticalBatchOverRun:
    """A curve written by :func:`write_over_run`: the file itself, or the newest ``over-run-*.json`` of a run."""
    path = source
    if source.is_dir():
        found = sorted((source / "critical-batch").glob(f"{OVER_RUN_PREFIX}*.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError(
                f"--batch-ramp from:{source}: the run holds no critical batch measured over it (expected "
                f"{source}/critical-batch/{OVER_RUN_PREFIX}RULE.json); measure it with bigbatch critical-batch "
                f"{source} --every N first"
            )
        path = found[-1]
    try:
        data = json.loads(path.read_text())
        points = [CriticalPoint(**p) for p in data.pop("points")]
        result = CriticalBatchOverRun(**data, points=points)
    except FileNotFoundError:
        raise ConfigError(f"--batch-ramp from:{source}: no such run or file") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"--batch-ramp from:{source}: {path} is not a critical batch over a run ({exc})") from None
    if not result.points:
        raise ConfigError(f"--batch-ramp from:{source}: {path} holds no measured point")
    return result


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
        axis.plot(
            [t for _, t, _ in noise],
            [max(v, 1.0) for _, _, v in noise],
            ".-",
            color="C1",
            alpha=0.7,
            label="noise scale (B_simple) logged by the run",
        )
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
