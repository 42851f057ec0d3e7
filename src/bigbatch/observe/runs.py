"""A run read back from its directory: its step and evaluation records (``metrics.jsonl``), its settings
(``config.toml``), and the name reports label it by."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bigbatch.errors import BigBatchError
from bigbatch.observe.metrics import METRICS_FILE, read_records

CONFIG_FILE = "config.toml"
"""The run's settings as its latest session resolved them (written by :mod:`bigbatch.run.loop.run_dir_files`)."""


@dataclass
class RunMetrics:
    """The step, evaluation and documents records of one run's ``metrics.jsonl``, in file order."""

    run_dir: Path
    label: str
    steps: list[dict[str, Any]] = field(default_factory=list)  # kind "step"
    evals: list[dict[str, Any]] = field(default_factory=list)  # kind "eval"
    documents: list[dict[str, Any]] = field(default_factory=list)  # kind "documents": one per session's start

    @property
    def trained(self) -> list[dict[str, Any]]:
        """Steps that applied an update (a skipped step has the number it tried, which the next applied one takes)."""
        return [r for r in self.steps if not r.get("skipped")]

    def cumulative_tokens(self) -> dict[int, int]:
        """Valid target tokens trained on up to and including each applied step (as the trainer counts them)."""
        total, out = 0, {}
        for r in self.trained:
            total += int(r.get("tokens", 0))
            out[int(r["step"])] = total
        return out


def read_metrics(run_dir: Path | str, label: str | None = None) -> RunMetrics:
    """The step, evaluation and documents records of ``RUN_DIR/metrics.jsonl`` (read by
    :func:`bigbatch.observe.metrics.read_records`), labelled ``label`` (default: the directory's name); a missing
    directory or file, or a file without step records, is a BigBatchError."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise BigBatchError(f"run directory {run_dir} does not exist")
    if not path.is_file():
        raise BigBatchError(f"{run_dir} has no {METRICS_FILE}; give a run directory written by bigbatch train")
    run = RunMetrics(run_dir=run_dir, label=label or run_dir.resolve().name)
    for record in read_records(run_dir):
        if "step" not in record:
            continue
        if record.get("kind") == "step":
            run.steps.append(record)
        elif record.get("kind") == "eval" and "val_loss" in record:
            run.evals.append(record)
        elif record.get("kind") == "documents":
            run.documents.append(record)
    if not run.steps:
        raise BigBatchError(f"{path} holds no step records; has the run trained a step yet?")
    return run


def run_settings(run_dir: Path) -> dict[str, Any]:
    """The run's resolved ``config.toml`` as a mapping (empty when it is missing or unreadable)."""
    try:
        with (run_dir / CONFIG_FILE).open("rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def setting(settings: dict[str, Any], section: str, key: str) -> Any:
    """``settings[section][key]``, or ``None`` when either is missing."""
    value = settings.get(section, {})
    return value.get(key) if isinstance(value, dict) else None


def run_name(run_dir: Path) -> str:
    """The name the run was given (``bigbatch train --name``, kept in its ``config.toml``), or ``""``."""
    name = setting(run_settings(run_dir), "run", "name")
    return name.strip() if isinstance(name, str) else ""


def run_labels(run_dirs: list[Path]) -> list[str]:
    """One label per run: its name (``bigbatch train --name``) when it was given one, else its directory's name
    (``runs/nano-6771823094`` -> ``nano-6771823094``, ``--out runs/my-experiment`` -> ``my-experiment``).

    Where two runs would get the same label, each of them takes in its parent directory, then the one above, as
    long as it takes: ``a/run`` and ``b/run``; a named one as ``NAME (a/run)``. The same directory given twice
    keeps one label twice."""
    resolved = [d.resolve() for d in run_dirs]
    parts = [d.parts[1:] for d in resolved]  # without the root
    names = [run_name(d) for d in run_dirs]
    deepest = [len(p) - (0 if name else 1) for p, name in zip(parts, names, strict=True)]

    def label(i: int, depth: int) -> str:
        """Run ``i``'s label with ``depth`` more trailing directories than it has at first."""
        if not names[i]:
            return "/".join(parts[i][-(depth + 1) :])
        return names[i] if depth == 0 else f"{names[i]} ({'/'.join(parts[i][-depth:])})"

    depths = [0] * len(run_dirs)
    labels = [label(i, 0) for i in range(len(run_dirs))]
    while True:
        clashing = [
            i
            for i, text in enumerate(labels)
            if any(other == text and resolved[j] != resolved[i] for j, other in enumerate(labels))
        ]
        deeper = [i for i in clashing if depths[i] < deepest[i]]
        if not deeper:
            return labels
        for i in deeper:
            depths[i] += 1
            labels[i] = label(i, depths[i])
