"""The critical batch measured along a run, as data: the points ``bigbatch critical-batch --every`` writes
(``RUN/critical-batch/over-run-RULE.json``) and ``--batch-ramp from:RUN`` reads (torch-free: the ramp and the
command line use it). Measuring it is :mod:`bigbatch.critical_batch.over_run`'s."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bigbatch.errors import ConfigError
from bigbatch.files.json_text import from_json

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


def over_run_path(run_dir: Path, rule_label: str) -> Path:
    return run_dir / "critical-batch" / f"{OVER_RUN_PREFIX}{rule_label}.json"


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
        data = from_json(path.read_text())
        points = [CriticalPoint(**p) for p in data.pop("points")]
        result = CriticalBatchOverRun(**data, points=points)
    except FileNotFoundError:
        raise ConfigError(f"--batch-ramp from:{source}: no such run or file") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"--batch-ramp from:{source}: {path} is not a critical batch over a run ({exc})") from None
    if not result.points:
        raise ConfigError(f"--batch-ramp from:{source}: {path} holds no measured point")
    return result
